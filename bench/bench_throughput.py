"""Issue 7, benchmark 1: service throughput against the Kafka limit.

Run: ``.venv/bin/python bench/bench_throughput.py [--events 20000] [--partitions 4]
[--repetitions 3] [--hypervisors 500]``

Measured: events/s of the full service (``Runtime`` in-process: watch-mode cache,
exactly-once transactions, default batch 500, its JSON logging rendered to /dev/null) on
a stream of no-host-found outcomes, and events/s of a raw aiokafka loop that does what
the service does on the Kafka side and nothing else: ``getmany`` (same ``max_records``,
read_committed), then one transaction per batch holding ``send_offsets_to_transaction``
and one produced record (the input's bytes) per input record.

Why it is fair: same broker, same pre-published topic (N partitions), a fresh consumer
group and transactional id for every repetition, the two alternating (raw, service,
raw, ...) so that load drift on the shared machine hits both alike. Both clocks start
when the first record is handed over (service: the first ``Processor.process`` call,
or the end of the cache's initial sync if that is later; raw: the first non-empty
``getmany``) and stop when the last batch is committed. The service's outcomes are
worst-case no-host-found: the project has an active CR, so all 10 input hosts are
queried.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
import uuid

from _common import (
    Cluster,
    Timed,
    check_mix,
    create_topics,
    delete_topics,
    env_endpoints,
    load,
    median,
    no_host_found,
    outcomes,
    publish,
    quiet_logging,
    running_service,
    service_config,
    topic_name,
    wait_processed,
)
from _verdict import finish, goals
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

# The worst case the figure is about: every event a no-host-found of a project with an
# active CR, so the classifier queries all its hosts (no_cr or cr_exhausted would not).
WORST_CASE = {"no_host_found/slot_exhausted|no_host_found/slot_blocked": 1.0}


async def raw_loop(
    bootstrap: str, topic: str, out_topic: str, n: int, max_batch: int
) -> tuple[float, float]:
    """Consume ``n`` records, re-produce each, one transaction per batch.

    Returns (events/s, CPU µs of this process per event)."""
    fresh = uuid.uuid4().hex[:8]
    group = f"g-raw-{fresh}"
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
        max_poll_records=max_batch,
    )
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=f"tx-raw-{fresh}")
    await producer.start()
    await consumer.start()
    try:
        done, t0, cpu0 = 0, 0.0, 0.0
        while done < n:
            batch = await consumer.getmany(timeout_ms=500, max_records=max_batch)
            if not batch:
                continue
            if not t0:
                t0, cpu0 = time.perf_counter(), time.process_time()
            offsets = {tp: records[-1].offset + 1 for tp, records in batch.items()}
            async with producer.transaction():
                await producer.send_offsets_to_transaction(offsets, group)
                for records in batch.values():
                    for r in records:
                        await producer.send(out_topic, r.value, key=r.key, headers=list(r.headers))
            done += sum(len(r) for r in batch.values())
        return n / (time.perf_counter() - t0), (time.process_time() - cpu0) / n * 1e6
    finally:
        await consumer.stop()
        await producer.stop()


async def service_run(
    bootstrap: str, kubeconfig: str, topics: dict[str, str], n: int
) -> tuple[float, float]:
    """The service on the same topic; (events/s, CPU µs of the process per event)."""
    timed = Timed()
    timed.install()
    try:
        cfg = service_config(bootstrap, kubeconfig, topics, "thr")
        async with running_service(cfg) as (runtime, synced):
            cpu0 = time.process_time()
            end = await wait_processed(runtime, n, timeout_s=600)
            cpu = (time.process_time() - cpu0) / n * 1e6
            # A dead letter is committed like an outcome: count only what was classified.
            check_mix(outcomes(runtime), n, WORST_CASE)
        return n / (end - max(timed.first, synced)), cpu
    finally:
        timed.uninstall()


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--hypervisors", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    bootstrap, kubeconfig = env_endpoints()
    quiet_logging()

    async with Cluster.connect(kubeconfig) as cluster:
        print(await cluster.ensure(args.hypervisors))
    topics = {
        "input": topic_name("thr-in"),
        "output": topic_name("thr-out"),
        "dlq": topic_name("thr-dlq"),
        "raw": topic_name("thr-raw"),
    }
    await create_topics(
        bootstrap, {t: args.partitions if k == "input" else 1 for k, t in topics.items()}
    )
    try:
        rng = random.Random(args.seed)
        t = time.perf_counter()
        n = await publish(
            bootstrap,
            topics["input"],
            (no_host_found(rng, args.hypervisors) for _ in range(args.events)),
        )
        print(
            f"published {n} no-host-found outcomes to {args.partitions} partitions "
            f"in {time.perf_counter() - t:.1f}s"
        )
        raw: list[float] = []
        svc: list[float] = []
        raw_cpu: list[float] = []
        svc_cpu: list[float] = []
        for rep in range(args.repetitions):
            rate, cpu = await raw_loop(bootstrap, topics["input"], topics["raw"], n, 500)
            raw.append(rate)
            raw_cpu.append(cpu)
            print(f"  rep {rep}: raw     {rate:8.0f} events/s {cpu:6.0f} CPU µs/event   [{load()}]")
            rate, cpu = await service_run(bootstrap, kubeconfig, topics, n)
            svc.append(rate)
            svc_cpu.append(cpu)
            print(f"  rep {rep}: service {rate:8.0f} events/s {cpu:6.0f} CPU µs/event   [{load()}]")
        ratios = [s / r for s, r in zip(svc, raw, strict=True)]
        print()
        print(f"{'':10} {'raw aiokafka EOS':>18} {'service':>10} {'service/raw':>12}")
        print(f"{'median':10} {median(raw):18.0f} {median(svc):10.0f} {median(ratios):12.2f}")
        print(
            f"{'runs':10} {' '.join(f'{x:.0f}' for x in raw):>18} "
            f"{' '.join(f'{x:.0f}' for x in svc):>10} "
            f"{' '.join(f'{x:.2f}' for x in ratios):>12}"
        )
        print(
            f"{'CPU µs/ev':10} {median(raw_cpu):18.0f} {median(svc_cpu):10.0f} "
            f"{median(raw_cpu) / median(svc_cpu):12.2f}  (raw/service: the CPU-bound ratio)"
        )
        return goals({"goal service >= 0.5 x raw": median(ratios) >= 0.5}, f"[{load()}]")
    finally:
        await delete_topics(bootstrap, list(topics.values()))


if __name__ == "__main__":
    finish(lambda: asyncio.run(main()))
