"""The raw reference loop of the engine benchmarks: an aiokafka exactly-once pass-through.

Run: ``.venv/bin/python bench/raw_eos.py --bootstrap B --input T --output O --group G``
(until SIGTERM). With ``--kubeconfig K --part P`` it is the *write-first bound* of the
latency benchmark (bench_latency.py).

It does what the service does on the Kafka side and nothing else: ``getmany`` (same
``max_records`` as the service's batch, read_committed), then one transaction per batch
holding ``send_offsets_to_transaction`` and one produced record per input record (the
input's key, value and headers, unchanged). A separate process, like the service, so that
the benchmark harness measures both from the outside alike (committed offsets, a
read_committed reader, /proc CPU times). Its batching is a floor, not a strawman: it
fetches whatever has arrived (``getmany`` returns at once when records are buffered,
with up to ``--max-batch``), has no linger and no commit pacing, and sends every record
of a batch before awaiting any delivery (see BENCHMARKS.md for the settings tried).

The write-first bound (``--kubeconfig``): the same loop, and for every placement record
(a ``targetHost`` in the outcome) one merge PATCH that adds the record's VM to a slot of
the benchmark's cluster part ``--part`` on that host, guarded by the slot's
resourceVersion, before the batch's transaction commits. The slot is chosen as the
reference's ``pick_slot`` chooses (most coverage, then the tightest fit, then the name)
from what the bound knows of its part: it lists the part once at start and keeps each
slot's resourceVersion and memory left from every answer, so it never reads before a
write (a 409, which only another writer could cause, re-reads the slot and retries).
Writes to different slots run concurrently, writes to one slot one after the other.
The PATCHes are in flight during the batch's Kafka requests and awaited before its
EndTxn: what any engine that commits an output only once its write is decided pays.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import ConsumerRecord, TopicPartition

MERGE = "application/merge-patch+json"
# A fetched batch: records by input partition.
Batch = dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]
GiB = 1024**3
# Transactions begun so far (committed or not), printed as "<TXN_LINE> N" on SIGUSR1.
TRANSACTIONS = [0]
TXN_LINE = "raw_eos transactions:"
# The bound's allocation body: the service's shape (memory and cpu of an m2.small, a
# timestamp); bench_latency.py checks the part for exactly this body afterwards.
ALLOCATION = {
    "creationTimestamp": "2026-12-03T00:00:00Z",
    "resources": {"memory": "4Gi", "cpu": "2"},
}


def target_host(value: bytes) -> str | None:
    """The host a placement went to (``targetHost``), None for a no-host-found outcome."""
    host = json.loads(value)["data"]["decision"]["result"].get("targetHost")
    return str(host) if host else None


def quantity_bytes(text: str) -> int:
    """The bench part's memory quantities (``16Gi``, ``4Gi``, ``512Mi``) in bytes."""
    for suffix, scale in (("Gi", GiB), ("Mi", 1024**2), ("Ki", 1024)):
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * scale
    return int(text)


@dataclass
class Slot:
    name: str
    version: str
    left: int  # bytes of the block not yet allocated (negative: overfilled)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Part:
    """The bound's view of its cluster part: each slot's resourceVersion and memory left,
    by host, kept from the answers to its own writes."""

    def __init__(self, cluster: Any, selector: str) -> None:
        self.cluster, self.selector = cluster, selector
        self.by_host: dict[str, list[Slot]] = {}
        self.writes = self.conflicts = self.failed = 0

    async def load(self) -> int:
        url = self.cluster.url("reservations") + f"?labelSelector={self.selector}"
        status, body = await self.cluster.call("GET", url)
        if status != 200:
            raise RuntimeError(f"listing the part {self.selector}: {status}")
        for obj in json.loads(body)["items"]:
            slot = Slot(obj["metadata"]["name"], "", 0)
            self._update(slot, obj)
            self.by_host.setdefault(obj["spec"]["targetHost"], []).append(slot)
        return sum(len(v) for v in self.by_host.values())

    @staticmethod
    def _update(slot: Slot, obj: dict[str, Any]) -> None:
        from _common import allocations_of  # the service's modules only for the bound

        allocations = allocations_of(obj)
        used = sum(quantity_bytes(a["resources"]["memory"]) for a in allocations.values())
        slot.version = obj["metadata"]["resourceVersion"]
        slot.left = quantity_bytes(obj["spec"]["resources"]["memory"]) - used

    def pick(self, host: str, need: int) -> Slot | None:
        """pick_slot's order: most coverage, then the tightest fit, then the name; the
        memory is taken at once, so the next placement on the host sees it gone."""
        fitting = [s for s in self.by_host.get(host, []) if s.left > 0]
        if not fitting:
            return None
        slot = min(fitting, key=lambda s: (-min(s.left, need), s.left, s.name))
        slot.left -= need
        return slot

    async def write(self, slot: Slot, vm: str) -> None:
        url = self.cluster.url("reservations", slot.name)
        async with slot.lock:
            for _ in range(5):
                body = {
                    "metadata": {"resourceVersion": slot.version},
                    "spec": {"committedResourceReservation": {"allocations": {vm: ALLOCATION}}},
                }
                status, answer = await self.cluster.call("PATCH", url, body, MERGE)
                self.writes += 1
                if status == 200:
                    slot.version = json.loads(answer)["metadata"]["resourceVersion"]
                    return
                if status != 409:
                    break
                self.conflicts += 1
                status, answer = await self.cluster.call("GET", url)
                if status == 200:
                    slot.version = json.loads(answer)["metadata"]["resourceVersion"]
            self.failed += 1


async def run(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # bench_latency.py counts the transactions of its timed part from these lines.
    loop.add_signal_handler(
        signal.SIGUSR1, lambda: print(f"{TXN_LINE} {TRANSACTIONS[0]}", flush=True)
    )
    consumer = AIOKafkaConsumer(
        args.input,
        bootstrap_servers=args.bootstrap,
        group_id=args.group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
        max_poll_records=args.max_batch,
    )
    # retry_backoff_ms: a transaction begun right after the previous one's EndTxn is
    # answered CONCURRENT_TRANSACTIONS until the broker wrote that one's markers, and
    # aiokafka waits its back-off (default 100 ms) before asking again: with the default
    # the loop is a strawman from ~50 events/s on (raw p50 173 ms at 100/s, measured).
    # The service's default (CRS_TXN_RETRY_BACKOFF_MS=2) is the floor's too.
    producer = AIOKafkaProducer(
        bootstrap_servers=args.bootstrap,
        transactional_id=f"tx-{args.group}",
        retry_backoff_ms=args.retry_backoff_ms,
    )
    async with contextlib.AsyncExitStack() as stack:
        part: Part | None = None
        if args.kubeconfig:
            from _common import Cluster  # the service's modules only for the bound

            cluster = await stack.enter_async_context(Cluster.connect(args.kubeconfig))
            part = Part(cluster, args.part)
            print(f"bound: {await part.load()} slots in part {args.part}", flush=True)
        await pass_through(args, stop, consumer, producer, part)


async def pass_through(
    args: argparse.Namespace,
    stop: asyncio.Event,
    consumer: AIOKafkaConsumer,
    producer: AIOKafkaProducer,
    part: Part | None,
) -> None:
    need = int(args.vm_gib * GiB)
    unplaced = 0

    async def write(record: ConsumerRecord[bytes, bytes]) -> None:
        nonlocal unplaced
        assert part is not None
        host = target_host(record.value)
        if host is None:
            return
        slot = part.pick(host, need)
        if slot is None:
            unplaced += 1
            return
        await part.write(slot, bytes(record.key).decode())

    async def commit(producer: AIOKafkaProducer, batch: Batch) -> None:
        """One transaction: ``batch``'s outputs and offsets (and, for the bound, its
        placements' PATCHes, in flight during every Kafka request but the end)."""
        offsets = {tp: records[-1].offset + 1 for tp, records in batch.items()}
        TRANSACTIONS[0] += 1
        async with producer.transaction():
            patches = []
            if part is not None:
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

    await producer.start()
    await consumer.start()
    try:
        if args.txn_per_partition:
            await per_partition(args, stop, consumer, commit)
            return
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=500, max_records=args.max_batch)
            if batch:
                await commit(producer, batch)
    finally:
        await consumer.stop()
        await producer.stop()
        if part is not None:
            # In its log, for a reader of a failed run (bench_latency.py checks the part).
            print(
                f"bound: {part.writes} PATCHes, {part.conflicts} conflicts, "
                f"{part.failed} placements not written, {unplaced} without a slot",
                flush=True,
            )


async def per_partition(
    args: argparse.Namespace,
    stop: asyncio.Event,
    consumer: AIOKafkaConsumer,
    commit: Callable[[AIOKafkaProducer, Batch], Coroutine[Any, Any, None]],
) -> None:
    """``--txn-per-partition``: the loop with the service's fencing model and nothing else
    of the service. Each input partition has a transactional producer of its own (the
    service's zombie fencing: a take-over's InitProducerId aborts the partition's open
    transaction) and its own task, which commits whatever of its partition has arrived in
    one transaction (``commit``, the loop's own) as soon as its previous one ended (no
    pacing, no batch barrier: the fetch loop only hands records on). What it costs over
    the loop above, which commits every partition in one transaction, is what one
    transaction per input partition costs (BENCHMARKS.md, "What bounds it")."""
    queues: dict[TopicPartition, asyncio.Queue[list[ConsumerRecord[bytes, bytes]]]] = {}
    tasks: list[asyncio.Task[None]] = []

    async def committer(tp: TopicPartition) -> None:
        producer = AIOKafkaProducer(
            bootstrap_servers=args.bootstrap,
            transactional_id=f"tx-{args.group}-{tp.partition}",
            retry_backoff_ms=args.retry_backoff_ms,
        )
        await producer.start()
        queue = queues[tp]
        try:
            while True:
                records = await queue.get()
                while not queue.empty():
                    records += queue.get_nowait()
                await commit(producer, {tp: records})
        finally:
            await producer.stop()

    try:
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=500, max_records=args.max_batch)
            for tp, records in batch.items():
                if tp not in queues:  # the benchmark's group has one member: no revokes
                    queues[tp] = asyncio.Queue()
                    tasks.append(asyncio.create_task(committer(tp)))
                queues[tp].put_nowait(list(records))
            for task in tasks:
                if task.done():
                    task.result()  # a failed transaction ends the run, as above
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--max-batch", type=int, default=500)
    ap.add_argument("--retry-backoff-ms", type=int, default=2, help="the producer's back-off")
    ap.add_argument("--kubeconfig", help="the write-first bound: PATCH each placement's slot")
    ap.add_argument("--part", default="crs-bench-part=bound", help="the bound's slots (selector)")
    ap.add_argument(
        "--txn-per-partition",
        action="store_true",
        help="one transactional producer and one transaction per input partition",
    )
    ap.add_argument("--vm-gib", type=float, default=4.0, help="memory of a placed VM")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
