"""Why the engine sets the transactional producers' retry back-off (issue 11).

Run: ``.venv/bin/python bench/bench_txn.py [--transactions 200] [--backoffs 100,20,10]
[--first offsets|outputs|both]``

Measured: wall time and client CPU per transaction of one aiokafka transactional
producer committing transactions back to back, each holding one consumer-group offset
commit and one produced record (what one engine commit of a quiet partition is), for
each ``retry_backoff_ms``. A transaction begun right after the previous commit is
answered CONCURRENT_TRANSACTIONS until the broker has written that one's markers, and
aiokafka retries after ``retry_backoff_ms``: with its default of 100 ms every
back-to-back transaction takes about 100 ms. That holds when the transaction's first
request adds the consumer group (offsets first, the default here); when it adds an
output partition (``--first outputs``) aiokafka waits a fixed 20 ms instead, whatever the
back-off (``--first both`` measures each back-off both ways).

With ``--ahead``, it measures what opening a transaction ahead saves
(``CRS_TXN_OPEN_AHEAD_MS``): transactions paced one per 50 ms (a quiet partition), each
with a record decided 10 ms after it arrived (a PATCH's round trip), in turn committed
the usual way after the decision (begin, produce, offsets, end), opened ahead (begin +
offsets while the 10 ms pass, then produce and end) and opened ahead with the output
partition added too (then only the produce and the end). Measured: the time from the
decision to the committed transaction, p50 and p90 of each.

Fails (exit 2, bench/_verdict.py) when the workload did not happen: the output topic
(read_committed) does not hold exactly one record per transaction, or the group's
committed offset is not the last one written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from _common import OutputReader, create_topics, delete_topics, env_endpoints, load
from _verdict import WorkloadError, finish
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from service.stream.aiokafka_internals import add_partitions_to_txn


async def check(bootstrap: str, topic: str, group: str, n: int) -> None:
    """Every record readable (read_committed) once, and the group's offset the last one."""
    tp = TopicPartition(topic, 0)
    reader = OutputReader(bootstrap, topic, 1)
    checker = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group)
    await reader.start()
    await checker.start()
    try:
        keys = [b"k", *(b"%d" % i for i in range(n))]
        await reader.wait_for(keys, timeout_s=30)
        await asyncio.sleep(0.5)  # anything beyond one record per transaction shows up too
        seen = reader.count
        committed = await checker.committed(tp)
    finally:
        await reader.stop()
        await checker.stop()
        await delete_topics(bootstrap, [topic])
    if seen != n + 1 or committed != n:
        raise WorkloadError(f"{seen} records for {n + 1} transactions, committed {committed}")


@contextlib.asynccontextmanager
async def transactions(
    bootstrap: str, backoff_ms: int, n: int
) -> AsyncIterator[tuple[AIOKafkaProducer, str, str, TopicPartition]]:
    """``(producer, topic, group, tp)``: a transactional producer on a fresh topic, after
    one transaction (coordinator lookups and metadata are not timed); the body commits
    transactions 0..n-1 (record key ``i``, offset ``i + 1``), checked afterwards."""
    topic = f"bench-txn-{uuid.uuid4().hex[:8]}"
    group = f"g-{topic}"
    await create_topics(bootstrap, {topic: 1})
    tp = TopicPartition(topic, 0)
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, transactional_id=topic, retry_backoff_ms=backoff_ms
    )
    await producer.start()
    try:
        async with producer.transaction():
            await producer.send_offsets_to_transaction({tp: OffsetAndMetadata(0, "")}, group)
            await (await producer.send(topic, b"warm-up", key=b"k"))
        yield producer, topic, group, tp
    finally:
        await producer.stop()
    await check(bootstrap, topic, group, n)


async def ahead(bootstrap: str, n: int) -> dict[str, list[float]]:
    """Seconds from decision to commit, n/3 of each way: the usual way, opened ahead
    (the offset sent while the record waits) and opened ahead with the output partition
    added too (aiokafka_internals.add_partitions_to_txn, as the engine uses it)."""
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    async with transactions(bootstrap, 10, n) as (producer, topic, group, tp):
        for i in range(n):
            await asyncio.sleep(0.05)
            offsets = {tp: OffsetAndMetadata(i + 1, "")}
            key = b"%d" % i
            way = WAYS[i % len(WAYS)]
            if way == "the usual way":
                await asyncio.sleep(0.01)  # the PATCH
                decided = time.perf_counter()
                async with producer.transaction():
                    fut = await producer.send(topic, b"x" * 600, key=key)
                    await producer.send_offsets_to_transaction(offsets, group)
                    await fut
            else:
                await producer.begin_transaction()
                wait = asyncio.ensure_future(asyncio.sleep(0.01))  # the PATCH
                if way == "+ output partition":
                    add_partitions_to_txn(producer, topic, [key])
                await producer.send_offsets_to_transaction(offsets, group)
                await wait
                decided = time.perf_counter()
                await (await producer.send(topic, b"x" * 600, key=key))
                await producer.commit_transaction()
            times[way].append(time.perf_counter() - decided)
    return times


WAYS = ("the usual way", "opened ahead", "+ output partition")


async def one(
    bootstrap: str, backoff_ms: int, n: int, first: str = "offsets"
) -> tuple[float, float]:
    """(wall s, CPU s) per transaction for ``n`` back-to-back transactions, each sending
    its offsets or its output (``first``) first."""
    async with transactions(bootstrap, backoff_ms, n) as (producer, topic, group, tp):
        cpu0, wall0 = time.process_time(), time.monotonic()
        for i in range(n):
            async with producer.transaction():
                offsets = {tp: OffsetAndMetadata(i + 1, "")}
                if first == "offsets":
                    await producer.send_offsets_to_transaction(offsets, group)
                    await (await producer.send(topic, b"x" * 600, key=b"%d" % i))
                else:
                    fut = await producer.send(topic, b"x" * 600, key=b"%d" % i)
                    await producer.send_offsets_to_transaction(offsets, group)
                    await fut
        wall, cpu = time.monotonic() - wall0, time.process_time() - cpu0
    return wall / n, cpu / n


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transactions", type=int, default=200)
    ap.add_argument("--backoffs", default="100,20,10")
    ap.add_argument(
        "--first",
        default="offsets",
        help="what each back-to-back transaction sends first: offsets, outputs, or both "
        "(each back-off measured both ways, alternating)",
    )
    ap.add_argument("--ahead", action="store_true", help="measure opening ahead instead")
    args = ap.parse_args()
    bootstrap, _ = env_endpoints()
    if args.ahead:
        measured = await ahead(bootstrap, args.transactions)  # WorkloadError: exit 2
        print(f"{args.transactions} paced transactions, each decided 10 ms after it arrived")
        print("decision -> committed, ms      p50     p90")
        for name, times in measured.items():
            times.sort()
            p50, p90 = times[len(times) // 2], times[int(len(times) * 0.9)]
            print(f"  {name:24s} {p50 * 1e3:7.2f} {p90 * 1e3:7.2f}   [{load()}]")
        return 0
    print(f"{args.transactions} back-to-back transactions (1 offset commit + 1 record each)")
    firsts = ["offsets", "outputs"] if args.first == "both" else [args.first]
    print(f"{'retry_backoff_ms':>16} | {'first':>7} | {'wall ms/txn':>11} | {'CPU µs/txn':>10}")
    for backoff in (int(b) for b in args.backoffs.split(",")):
        for first in firsts:
            wall, cpu = await one(bootstrap, backoff, args.transactions, first)
            print(
                f"{backoff:>16} | {first:>7} | {wall * 1e3:11.1f} | {cpu * 1e6:10.0f}   [{load()}]"
            )
    return 0


if __name__ == "__main__":
    finish(lambda: asyncio.run(main()))
