"""``crs-consumer-demo seed`` and ``crs-consumer-demo demo``.

``seed`` writes the demo region (see :mod:`crs_demo.scenario`) into the cluster and
publishes the demo outcomes to the configured input topic, for a consumer running
elsewhere (docker-compose). ``demo`` does the whole tour on the local dev stack: seed,
run the real service in-process on fresh topics until every event is decided, then
read the classification and dead-letter topics back and print what happened. Each run
replaces the previous run's demo objects (and only those, see :mod:`crs_demo.seeding`),
so it can be repeated without clean-up.
"""

from __future__ import annotations

import asyncio
import collections
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec

from crs_demo import scenario
from crs_demo.seeding import ForeignObjectsError, set_knowledge_ready, write_region
from service.app.config import Config
from service.app.logs import configure_logging
from service.k8s import KubeClient

__all__ = ["demo", "seed"]

_PARTITIONS = 3  # of each demo topic: enough to show partitions processed concurrently


async def _kube(config: Config) -> KubeClient:
    return await KubeClient.create(config.kubeconfig, request_timeout_s=config.k8s_timeout_s)


async def publish(config: Config, topic: str, items: list[scenario.ScenarioEvent]) -> int:
    from aiokafka import AIOKafkaProducer

    from service.stream.codec import encode_input

    producer = AIOKafkaProducer(**config.kafka_client_args(), acks="all", linger_ms=5)
    await producer.start()
    try:
        pending = []
        for i, item in enumerate(items):
            if item.poison is not None:
                pending.append(await producer.send(topic, item.poison, key=b"poison"))
                continue
            assert item.request is not None
            assert item.decision is not None
            value, headers = encode_input(item.decision, item.request, binary=i % 10 == 9)
            key = item.request["spec"]["nova_object.data"]["instance_uuid"].encode()
            pending.append(await producer.send(topic, value, key=key, headers=headers))
        await asyncio.gather(*pending)  # every record acknowledged, or the error surfaces
    finally:
        await producer.stop()
    return len(items)


async def seed(config: Config, *, events: int = 300, rng_seed: int = 7) -> int:
    rng = random.Random(rng_seed)
    region = scenario.build_region(rng)
    async with await _kube(config) as kube:
        try:
            await write_region(kube, region)
        except ForeignObjectsError as exc:
            print(f"crs-consumer-demo: {exc}", file=sys.stderr)
            return 1
    n = await publish(config, config.input_topic, list(scenario.events(region, rng, events)))
    print(f"seeded {len(region.objects())} objects, published {n} outcomes to {config.input_topic}")
    return 0


class _Progress:
    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.start = total, label, time.monotonic()

    def show(self, done: int) -> None:
        width = 40
        filled = int(width * min(done, self.total) / max(self.total, 1))
        rate = done / max(time.monotonic() - self.start, 1e-6)
        bar = "█" * filled + "·" * (width - filled)
        sys.stderr.write(f"\r{self.label} [{bar}] {done}/{self.total}  {rate:6.0f} ev/s")
        sys.stderr.flush()

    def done(self) -> None:
        sys.stderr.write("\n")


async def _create_topics(config: Config, names: list[str], partitions: int) -> None:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(**config.kafka_client_args())
    await admin.start()
    try:
        await admin.create_topics([NewTopic(n, partitions, 1) for n in names])
    finally:
        await admin.close()


async def _read_topic(
    config: Config, topic: str, expected: int, timeout_s: float = 30
) -> list[Any]:
    from aiokafka import AIOKafkaConsumer
    from aiokafka.structs import TopicPartition

    consumer = AIOKafkaConsumer(
        **config.kafka_client_args(),
        isolation_level="read_committed",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(_PARTITIONS)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        records: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while len(records) < expected and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for recs in batch.values():
                records.extend(recs)
        return records
    finally:
        await consumer.stop()


async def demo(config: Config, *, events: int = 300, rng_seed: int = 7) -> int:
    from service.app.runtime import Runtime

    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:4]
    cfg = msgspec.structs.replace(
        config,
        input_topic=f"crs-demo-{run_id}.outcomes",
        output_topic=f"crs-demo-{run_id}.classifications",
        dlq_topic=f"crs-demo-{run_id}.dlq",
        group_id=f"crs-demo-{run_id}",
        max_event_bytes=scenario.DEMO_MAX_EVENT_BYTES,
        log_level="WARNING",
    )
    rng = random.Random(rng_seed)
    # The service's own JSON log goes to a file; the terminal shows progress and results.
    log_path = Path(tempfile.gettempdir()) / f"crs-demo-{run_id}.log"
    log_file = log_path.open("w")
    configure_logging("INFO", "json", stream=log_file)
    print(
        f"crs-consumer-demo demo {run_id}: "
        f"Kafka {cfg.bootstrap_servers}, kubeconfig {cfg.kubeconfig}"
    )
    region = scenario.build_region(rng)
    items = list(scenario.events(region, rng, events))
    kube = await _kube(cfg)
    runtime: Runtime | None = None
    t0 = time.monotonic()
    try:
        try:
            await write_region(kube, region)
        except ForeignObjectsError as exc:
            print(f"crs-consumer-demo: {exc}", file=sys.stderr)
            return 1
        print(
            f"seeded region: {len(region.hypervisors)} hypervisors in 3 AZs, "
            f"{len(region.reservations)} reservation slots, "
            f"{len(region.committed_resources)} committed resources, "
            f"{len(scenario.FLAVOR_GROUPS)} flavor groups"
        )
        await _create_topics(cfg, [cfg.input_topic, cfg.output_topic, cfg.dlq_topic], _PARTITIONS)
        try:
            runtime = Runtime(cfg)
            await runtime.start()
        except OSError:  # the default port is taken: any free port will do for a demo
            runtime = Runtime(msgspec.structs.replace(cfg, http_port=0))
            await runtime.start()
        assert runtime.http is not None
        assert runtime.stream is not None
        loop_task = asyncio.create_task(runtime.run())
        await publish(cfg, cfg.input_topic, items)

        progress = _Progress(len(items) + 5, "processing")
        await _wait_processed(runtime, len(items), progress, loop_task)
        # Phase two: the flavor-groups Knowledge goes not-Ready; placements count as error.
        await set_knowledge_ready(kube, False)
        await asyncio.sleep(1.0)  # the watch cache sees the change
        errors = [e for e in scenario.events(region, rng, 40) if e.expect == "slot_used"][:5]
        await publish(cfg, cfg.input_topic, errors)
        await _wait_processed(runtime, len(items) + len(errors), progress, loop_task)
        progress.done()
        await set_knowledge_ready(kube, True)
        total = len(items) + len(errors)
        outputs = await _read_topic(
            cfg, cfg.output_topic, total - sum(e.poison is not None for e in items)
        )
        dead = await _read_topic(cfg, cfg.dlq_topic, sum(e.poison is not None for e in items))
        _print_summary(outputs, dead, runtime, time.monotonic() - t0)
        print(f"service log (JSON lines): {log_path}")
        ok = len(outputs) + len(dead) == total
        if not ok:
            print(
                f"ERROR: {total} events in, "
                f"{len(outputs)} classified + {len(dead)} dead letters out"
            )
        return 0 if ok else 1
    finally:
        if runtime is not None:
            runtime.request_stop()
            await runtime.stop()
        await kube.close()
        log_file.close()


async def _wait_processed(runtime: Any, target: int, progress: _Progress, loop_task: Any) -> None:
    deadline = time.monotonic() + 300
    while runtime.stream.processed < target:
        if loop_task.done():
            loop_task.result()  # raises what stopped the loop
            raise RuntimeError("the consume loop stopped early")
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {runtime.stream.processed}/{target} events processed in 300s")
        progress.show(runtime.stream.processed)
        await asyncio.sleep(0.2)
    progress.show(runtime.stream.processed)


def _print_summary(outputs: list[Any], dead: list[Any], runtime: Any, seconds: float) -> None:
    table: collections.Counter[tuple[str, str]] = collections.Counter()
    allocations: collections.Counter[str] = collections.Counter()
    for record in outputs:
        data = msgspec.json.decode(record.value)["data"]
        table[(data["kind"], data["cr_slot"])] += 1
        allocations[data["allocation"]] += 1
    codes = collections.Counter(
        dict(record.headers).get("crs.error", b"?").decode() for record in dead
    )
    print(f"\n{len(outputs)} classification events, {len(dead)} dead letters in {seconds:.1f}s\n")
    print(f"{'kind':<15}{'cr_slot':<16}{'events':>7}")
    print("-" * 38)
    for (kind, cr_slot), n in sorted(table.items()):
        print(f"{kind:<15}{cr_slot:<16}{n:>7}")
    print("\nallocations:  " + ", ".join(f"{k}={v}" for k, v in sorted(allocations.items())))
    print("dead letters: " + (", ".join(f"{k}={v}" for k, v in sorted(codes.items())) or "none"))
    port = runtime.http.port
    print(f"\nmetrics were served at http://{runtime.config.http_host}:{port}/metrics")
    from prometheus_client import generate_latest

    totals: collections.Counter[str] = collections.Counter()
    for line in generate_latest(runtime.metrics.registry).decode().splitlines():
        if line.startswith(("cortex_nova_placement_total{", "cortex_nova_no_host_found_total{")):
            name = line.split("{", 1)[0]
            cr_slot = line.split('cr_slot="', 1)[1].split('"', 1)[0]
            totals[f"{name}{{cr_slot={cr_slot!r}}}"] += int(float(line.rsplit(" ", 1)[1]))
    print("reference counters, summed over flavor_group and intent:")
    for series, value in sorted(totals.items()):
        print(f"  {series:<62}{value:>5}")
