"""The raw reference loop of the engine benchmarks: an aiokafka exactly-once pass-through.

Run: ``.venv/bin/python bench/raw_eos.py --bootstrap B --input T --output O --group G``
(until SIGTERM). With ``--kubeconfig K`` it is the *write-first bound* of benchmark 1.

It does what the service does on the Kafka side and nothing else: ``getmany`` (same
``max_records`` as the service's batch, read_committed, same poll timeout), then one
transaction per batch holding ``send_offsets_to_transaction`` and one produced record
per input record (the input's key, value and headers, unchanged). A separate process,
like the service, so that the benchmark harness measures both from the outside alike
(committed offsets, a read_committed reader, /proc CPU times).

The write-first bound (``--kubeconfig``): the same loop, and for every placement record
(a ``targetHost`` in the outcome; benchmark 1's placements go to slot ``res-<n>-0`` of
host ``hv-<n>``) one merge PATCH adding the record's VM to that slot, sent as soon as the
batch is fetched and awaited together with the batch's Kafka requests, before the
commit. It estimates the best a placement can do in an engine that commits its output
only once the write is decided: the PATCH is unguarded (no read, no resourceVersion),
the record is only parsed (``json.loads``), and the PATCH overlaps every Kafka request
but the EndTxn (an engine doing that holds the readers of its output partitions for as
long as the write takes, which the service does not do). Its loop is sequential like
the plain one: a batch fetched while a PATCH is in flight waits for it, which weighs on
the records after a placement (at 20/s, mostly no-host-found ones), not on the
placements. Benchmark 1 compares it with the plain loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

MERGE = "application/merge-patch+json"
ALLOCATION = {"creationTimestamp": "2026-12-03T00:00:00Z", "resources": {"memory": "4Gi"}}


def target_slot(value: bytes) -> str | None:
    """The slot a benchmark placement goes to (``res-<n>-0`` on ``hv-<n>``), else None."""
    target = json.loads(value)["data"]["decision"]["result"].get("targetHost")
    if not target:
        return None
    return f"res-{target.removeprefix('hv-')}-0"


async def run(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    consumer = AIOKafkaConsumer(
        args.input,
        bootstrap_servers=args.bootstrap,
        group_id=args.group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
        max_poll_records=args.max_batch,
    )
    producer = AIOKafkaProducer(
        bootstrap_servers=args.bootstrap, transactional_id=f"tx-{args.group}"
    )
    async with contextlib.AsyncExitStack() as stack:
        cluster: Any = None
        if args.kubeconfig:
            from _common import Cluster  # the service's modules only for the bound

            cluster = await stack.enter_async_context(Cluster.connect(args.kubeconfig))
        await pass_through(args, stop, consumer, producer, cluster)


async def pass_through(
    args: argparse.Namespace,
    stop: asyncio.Event,
    consumer: AIOKafkaConsumer,
    producer: AIOKafkaProducer,
    cluster: Any,
) -> None:
    writes = failed = 0

    async def write(record: ConsumerRecord[bytes, bytes]) -> None:
        nonlocal writes, failed
        slot = target_slot(record.value)
        if slot is None:
            return
        vm = bytes(record.key).decode()
        body = {"spec": {"committedResourceReservation": {"allocations": {vm: ALLOCATION}}}}
        status, _ = await cluster.call("PATCH", cluster.url("reservations", slot), body, MERGE)
        writes += 1
        failed += status != 200

    await producer.start()
    await consumer.start()
    try:
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=500, max_records=args.max_batch)
            if not batch:
                continue
            offsets = {tp: records[-1].offset + 1 for tp, records in batch.items()}
            async with producer.transaction():
                patches = []
                if cluster is not None:  # in flight during every Kafka request but the end
                    patches = [
                        asyncio.create_task(write(r)) for records in batch.values() for r in records
                    ]
                await producer.send_offsets_to_transaction(offsets, args.group)
                futures = [
                    await producer.send(args.output, r.value, key=r.key, headers=list(r.headers))
                    for records in batch.values()
                    for r in records
                ]
                await asyncio.gather(*futures, *patches)
    finally:
        await consumer.stop()
        await producer.stop()
        if cluster is not None:
            # In its log, for a reader of a failed run (bench_latency.py checks the slots).
            print(f"bound: {writes} PATCHes, {failed} not answered 200", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--max-batch", type=int, default=500)
    ap.add_argument("--kubeconfig", help="the write-first bound: PATCH each placement's slot")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
