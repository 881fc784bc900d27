"""The raw reference loop of the engine benchmarks: an aiokafka exactly-once pass-through.

Run: ``.venv/bin/python bench/raw_eos.py --bootstrap B --input T --output O --group G``
(until SIGTERM).

It does what the service does on the Kafka side and nothing else: ``getmany`` (same
``max_records`` as the service's batch, read_committed, same poll timeout), then one
transaction per batch holding ``send_offsets_to_transaction`` and one produced record
per input record (the input's key, value and headers, unchanged). A separate process,
like the service, so that the benchmark harness measures both from the outside alike
(committed offsets, a read_committed reader, /proc CPU times).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer


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
    await producer.start()
    await consumer.start()
    try:
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=500, max_records=args.max_batch)
            if not batch:
                continue
            offsets = {tp: records[-1].offset + 1 for tp, records in batch.items()}
            async with producer.transaction():
                await producer.send_offsets_to_transaction(offsets, args.group)
                futures = [
                    await producer.send(args.output, r.value, key=r.key, headers=list(r.headers))
                    for records in batch.values()
                    for r in records
                ]
                await asyncio.gather(*futures)
    finally:
        await consumer.stop()
        await producer.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--max-batch", type=int, default=500)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
