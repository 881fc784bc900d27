"""The service end to end, through the real broker and the real API server."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from service.app.runtime import Runtime
from service.k8s.client import FENCE_ANNOTATION
from tests import e2e
from tests import factories as f
from tests.conftest import DevStack
from tests.hold_proxy import HoldProxy

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture
async def topics(new_topic: Any) -> dict[str, str]:
    return {
        "input": await new_topic("in", 2),
        "output": await new_topic("out", 2),
        "dlq": await new_topic("dlq", 1),
    }


async def wait_processed(runtime: Runtime, n: int, timeout_s: float = 60) -> None:
    assert runtime.stream is not None
    deadline = time.monotonic() + timeout_s
    while runtime.stream.processed < n:
        assert time.monotonic() < deadline, f"{runtime.stream.processed}/{n} processed"
        await asyncio.sleep(0.05)


async def scrape(runtime: Runtime) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    assert runtime.http is not None
    return await e2e.metrics_at(runtime.http.port)


def sample(metrics: dict[Any, float], name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.parametrize("read_mode", ["watch", "list"])
async def test_every_classification_end_to_end(
    devstack: DevStack, clean_k8s: Any, topics: dict[str, str], read_mode: str
) -> None:
    await e2e.seed_region(clean_k8s)
    P, N, NA, S = "placement", "no_host_found", "not_applicable", "m1.small"
    cases = [
        # name, target, hosts, project, flavor, skip -> kind, cr_slot, allocation
        ("slot_used", "hv-1", ["hv-1", "hv-3"], "p1", S, None, P, "slot_used", "written"),
        ("slot_missed", "hv-3", ["hv-3", "hv-4"], "p1", S, None, P, "slot_missed", NA),
        ("no_cr", "hv-1", ["hv-1"], "p3", S, None, P, "no_cr", NA),
        ("exhausted", "hv-1", ["hv-1"], "p2", S, None, P, "no_cr", NA),
        ("payg", "hv-1", ["hv-1"], "p1", "legacy.tiny", None, P, "payg", NA),
        ("skipped", "hv-1", ["hv-1"], "p1", S, True, P, "skipped", NA),
        ("nh_no_cr", None, ["hv-1", "hv-2"], "p3", S, None, N, "no_cr", NA),
        ("nh_cr_exhausted", None, ["hv-1"], "p2", S, None, N, "cr_exhausted", NA),
        ("nh_slot_exhausted", None, ["hv-3", "hv-4"], "p1", S, None, N, "slot_exhausted", NA),
        ("nh_slot_blocked", None, ["hv-2", "hv-3"], "p1", "m1.large", None, N, "slot_blocked", NA),
    ]
    ce = b'{"specversion":"1.0","source":"s",'
    poison = [
        (b"k1", b"definitely not json", [], "not_json"),
        (b"k2", bytes(range(256)) * 3, [], "not_json"),
        (b"k3", ce + b'"id":"a","type":"other.type","data":{}}', [], "unknown_type"),
        (b"k4", ce + b'"id":"b","type":"cortex.nova.scheduling_outcome.v1"}', [], "invalid_event"),
        (b"k5", b"{" + b" " * 3000 + b"}", [], "oversized"),
    ]
    records: list[Any] = []
    expected: dict[str, tuple[str, str, str]] = {}
    names: dict[str, str] = {}
    poison_iter = iter(poison)
    for i, (name, target, hosts, project, flavor, skip, *expect) in enumerate(cases):
        vm, decision, request = e2e.outcome(
            target, hosts, project=project, flavor=flavor, skip=skip
        )
        records.append(e2e.good_record(vm, decision, request, binary=i % 3 == 2))
        expected[vm] = (expect[0], expect[1], expect[2])
        names[vm] = name
        bad = next(poison_iter, None)
        if bad is not None:  # poison between good events, on the same partition key space
            records.append(bad[:3])
    cfg = e2e.config(devstack, topics, CRS_K8S_READ_MODE=read_mode, CRS_MAX_EVENT_BYTES="2048")
    async with e2e.running(cfg) as runtime:
        await e2e.publish(devstack.kafka_bootstrap, topics["input"], records)
        await wait_processed(runtime, len(records))
        metrics = await scrape(runtime)

    outputs = await e2e.read_all(
        devstack.kafka_bootstrap, topics["output"], len(cases), partitions=2
    )
    got = {e2e.data_of(r)["instance_uuid"]: e2e.data_of(r) for r in outputs}
    assert len(outputs) == len(cases)
    for vm, (kind, cr_slot, allocation) in expected.items():
        d = got[vm]
        assert (d["kind"], d["cr_slot"], d["allocation"]) == (kind, cr_slot, allocation), names[vm]
        assert d["input"]["topic"] == topics["input"]
    used = next(vm for vm, n in names.items() if n == "slot_used")
    assert got[used]["reservation"] == "slot-p1-hv1"
    assert got[used]["vm_memory_bytes"] == 4 * e2e.GiB
    payg = next(vm for vm, n in names.items() if n == "payg")
    assert got[payg]["flavor_group"] is None

    dead = await e2e.read_all(devstack.kafka_bootstrap, topics["dlq"], len(poison))
    assert len(dead) == len(poison)
    by_key = {r.key: r for r in dead}
    for key, value, _, code in poison:
        headers = dict(by_key[key].headers)
        assert headers["crs.error"].decode() == code
        assert by_key[key].value == value  # the original bytes, unchanged
        assert headers["crs.source.topic"].decode() == topics["input"]

    slot = await f.get(clean_k8s, "reservations", "slot-p1-hv1")
    allocations = slot["spec"]["committedResourceReservation"]["allocations"]
    assert list(allocations) == [used]
    assert allocations[used]["resources"] == {"memory": "4Gi", "cpu": "2"}

    m = "cortex_nova_placement_total"
    assert sample(metrics, m, flavor_group="g1", intent="resize", cr_slot="slot_used") == 1
    assert sample(metrics, m, flavor_group="g1", intent="resize", cr_slot="slot_missed") == 1
    assert sample(metrics, m, flavor_group="g1", intent="resize", cr_slot="no_cr") == 2
    n = "cortex_nova_no_host_found_total"
    for cr_slot in ("no_cr", "cr_exhausted", "slot_exhausted", "slot_blocked"):
        assert sample(metrics, n, cr_slot=cr_slot, flavor_group="g1", intent="resize") == 1, cr_slot
    assert sample(metrics, "crs_events_total", kind="placement", cr_slot="payg") == 1
    for _, _, _, code in poison:
        assert sample(metrics, "crs_dead_letters_total", code=code) >= 1


async def test_missing_knowledge_counts_error(
    devstack: DevStack, clean_k8s: Any, topics: dict[str, str]
) -> None:
    await e2e.seed_region(clean_k8s, knowledge=False)
    vm, decision, request = e2e.outcome("hv-1", ["hv-1"])
    cfg = e2e.config(devstack, topics)
    async with e2e.running(cfg) as runtime:
        await e2e.publish(
            devstack.kafka_bootstrap, topics["input"], [e2e.good_record(vm, decision, request)]
        )
        await wait_processed(runtime, 1)
        metrics = await scrape(runtime)
    (out,) = await e2e.read_all(devstack.kafka_bootstrap, topics["output"], 1, partitions=2)
    d = e2e.data_of(out)
    assert (d["cr_slot"], d["flavor_group"], d["allocation"]) == (
        "error",
        "unknown",
        "not_applicable",
    )
    assert (
        sample(
            metrics,
            "cortex_nova_placement_total",
            flavor_group="unknown",
            intent="resize",
            cr_slot="error",
        )
        == 1
    )
    slot = await f.get(clean_k8s, "reservations", "slot-p1-hv1")
    assert "allocations" not in slot["spec"]["committedResourceReservation"]


async def test_probes_report_readiness(
    devstack: DevStack, clean_k8s: Any, topics: dict[str, str]
) -> None:
    await e2e.seed_region(clean_k8s)
    cfg = e2e.config(devstack, topics)
    async with e2e.running(cfg) as runtime:
        assert runtime.http is not None
        base = f"http://127.0.0.1:{runtime.http.port}"
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base}/healthz") as resp:
                assert resp.status == 200
            deadline = time.monotonic() + 30
            while True:
                async with session.get(f"{base}/readyz") as resp:
                    body = await resp.json()
                    if resp.status == 200:
                        break
                assert time.monotonic() < deadline, body
                await asyncio.sleep(0.2)
        assert body["ok"] is True


async def test_commits_are_triggered_by_count_and_paced_by_the_interval(
    devstack: DevStack, clean_k8s: Any, new_topic: Any, tmp_path: Path
) -> None:
    """CRS_COMMIT_BURST, CRS_COMMIT_MAX_RECORDS and CRS_COMMIT_INTERVAL_MS on the real
    stack (one partition, the API server behind a proxy that can hold a PATCH): the first
    output of a quiet partition is committed at once (its saved commit), five decided
    records at once by count, a lone record with nothing else in progress at once
    although no token is left; while a placement's PATCH is held (the partition under
    load) a decided record waits for the interval (60 s here), and when the PATCH lands
    both are committed."""
    await e2e.seed_region(clean_k8s)
    topics = await e2e.new_topics(new_topic, 1)
    boot = devstack.kafka_bootstrap
    upstream = int(devstack.apiserver.rsplit(":", 1)[1])
    async with HoldProxy(upstream, devstack.run_dir / "pki") as proxy:
        cfg = e2e.config(
            devstack,
            topics,
            KUBECONFIG=str(proxy.kubeconfig(tmp_path / "held.kubeconfig")),
            CRS_K8S_TIMEOUT_S="600",  # the held PATCH must not time out and be re-sent
            CRS_COMMIT_INTERVAL_MS="60000",
            CRS_COMMIT_BURST="1",
            CRS_COMMIT_MAX_RECORDS="5",
        )

        def events(n: int) -> list[Any]:
            return [e2e.good_record(*e2e.outcome(None, ["hv-3"])) for _ in range(n)]

        async with e2e.running(cfg) as runtime:

            async def decided(n: int) -> None:
                # The histogram is observed when an event is decided.
                deadline = time.monotonic() + 20
                metric = "crs_processing_seconds_count"
                while runtime.metrics.registry.get_sample_value(metric) != n:
                    assert time.monotonic() < deadline, f"{n} events never decided"
                    await asyncio.sleep(0.05)

            await e2e.publish(boot, topics["input"], events(1))
            assert len(await e2e.read_all(boot, topics["output"], 1, timeout_s=20)) == 1
            await e2e.publish(boot, topics["input"], events(5))
            assert len(await e2e.read_all(boot, topics["output"], 6, timeout_s=20)) == 6
            await e2e.publish(boot, topics["input"], events(1))  # no token, nothing else
            assert len(await e2e.read_all(boot, topics["output"], 7, timeout_s=20)) == 7

            proxy.armed = True
            placement = e2e.good_record(*e2e.outcome("hv-1", ["hv-1"]))
            await e2e.publish(boot, topics["input"], [placement])
            async with asyncio.timeout(30):
                await proxy.held_event.wait()
            await e2e.publish(boot, topics["input"], events(1))
            await decided(8)  # the lone record, decided while the placement is held
            # Decided, then held: a record in progress, no token, one record < 5.
            assert len(await e2e.read_all(boot, topics["output"], 9, timeout_s=3)) == 7
            assert (await proxy.release()).startswith("HTTP/1.1 200")
            outputs = await e2e.read_all(boot, topics["output"], 9, timeout_s=20)
            assert len(outputs) == 9  # the placement decided: nothing in progress


async def test_the_replicas_transactions_are_capped_across_its_partitions(
    devstack: DevStack, clean_k8s: Any, new_topic: Any
) -> None:
    """CRS_COMMIT_RATE_MAX on the real stack: records arriving one by one on two
    partitions, each of which would otherwise be committed at once in a transaction of
    its own (nothing else of its partition in progress), share the replica's slots: at
    most the burst (4) and one transaction per second of the run, every output once."""
    await e2e.seed_region(clean_k8s)
    topics = await e2e.new_topics(new_topic, 2)
    boot = devstack.kafka_bootstrap
    cfg = e2e.config(devstack, topics, CRS_COMMIT_RATE_MAX="1")
    records = [e2e.good_record(*e2e.outcome(None, ["hv-3"])) for _ in range(24)]
    async with e2e.running(cfg) as runtime:
        producer = AIOKafkaProducer(bootstrap_servers=boot, acks="all")
        await producer.start()
        try:
            started = time.monotonic()
            for i, (key, value, headers) in enumerate(records):
                sent = await producer.send(
                    topics["input"], value, key=key, headers=headers, partition=i % 2
                )
                await sent
                await asyncio.sleep(0.125)
        finally:
            await producer.stop()
        outputs = await e2e.read_all(boot, topics["output"], 24, partitions=2, timeout_s=30)
        elapsed = time.monotonic() - started
        commits = runtime.metrics.registry.get_sample_value("crs_commit_seconds_count")
    assert sorted(o.key for o in outputs) == sorted(key for key, _, _ in records)
    assert commits is not None
    # Uncapped, each record is a commit of its own (24); read_all's last drain and the
    # publishing's own time only widen the bound.
    assert commits <= 4 + elapsed + 1, (commits, elapsed)


async def test_one_record_in_flight_at_a_time_keeps_flowing(
    devstack: DevStack, clean_k8s: Any, new_topic: Any
) -> None:
    """CRS_MAX_IN_FLIGHT=1 processes one record at a time and keeps going: the partition's
    backpressure lifts when its record is committed (it used to wait for the keep-alive
    fetch: one record a minute)."""
    await e2e.seed_region(clean_k8s)
    topics = await e2e.new_topics(new_topic, 1)
    boot = devstack.kafka_bootstrap
    cfg = e2e.config(devstack, topics, CRS_MAX_IN_FLIGHT="1")
    async with e2e.running(cfg):
        records = [e2e.good_record(*e2e.outcome(None, ["hv-3"])) for _ in range(10)]
        await e2e.publish(boot, topics["input"], records)
        assert len(await e2e.read_all(boot, topics["output"], 10, timeout_s=30)) == 10


async def test_a_committed_offset_beyond_the_log_end_is_reset_without_losing_records(
    devstack: DevStack, clean_k8s: Any, new_topic: Any
) -> None:
    """The group's committed offset lies beyond the partition's end (the log was truncated
    by an unclean leader election, or the topic recreated while the group's offsets
    outlived it): aiokafka resets the fetch to the earliest offset. The records there
    are new to this log and must be processed, and the committed offset follow them;
    they used to be skipped as "already done" below the old watermark, silently, as was
    everything written after them up to the old offset."""
    await e2e.seed_region(clean_k8s)
    topics = await e2e.new_topics(new_topic, 1)
    boot = devstack.kafka_bootstrap
    cfg = e2e.config(devstack, topics)
    tp = TopicPartition(topics["input"], 0)
    # No auto-commit: on stop() it would commit its own position (0, the end of the then
    # empty topic) over the 1000 committed here, as it did once in a full run.
    setter = AIOKafkaConsumer(
        bootstrap_servers=boot, group_id=cfg.group_id, enable_auto_commit=False
    )
    await setter.start()
    try:
        setter.assign([tp])
        await setter.commit({tp: OffsetAndMetadata(1000, "")})
    finally:
        await setter.stop()
    records = [e2e.good_record(*e2e.outcome(None, ["hv-3"])) for _ in range(3)]
    await e2e.publish(boot, topics["input"], records)
    async with e2e.running(cfg) as runtime:
        assert len(await e2e.read_all(boot, topics["output"], 3, timeout_s=30)) == 3
        await e2e.publish(boot, topics["input"], records[:1])
        assert len(await e2e.read_all(boot, topics["output"], 4, timeout_s=30)) == 4
        deadline = time.monotonic() + 20
        while (found := await e2e.committed(boot, cfg.group_id, tp)) is None or found.offset != 4:
            assert time.monotonic() < deadline, f"committed {found}"
            await asyncio.sleep(0.2)
        resets = runtime.metrics.registry.get_sample_value(
            "crs_offset_resets_total", {"topic": tp.topic, "partition": "0"}
        )
        assert resets == 1


async def test_lag_is_zero_once_a_transactional_producers_input_is_processed(
    devstack: DevStack, clean_k8s: Any, new_topic: Any
) -> None:
    """An input topic written by a transactional producer (MirrorMaker 2 with exactly-once
    source support, a bridge using transactions) ends each transaction with a commit marker
    that takes an offset and is never handed out. Once every event is processed the lag
    must be 0, not 1 per partition for good (the critical CrsNoEventsProcessed alert
    reads lag > 0 with no events as a stuck consumer)."""
    await e2e.seed_region(clean_k8s)
    topics = await e2e.new_topics(new_topic, 1)
    boot = devstack.kafka_bootstrap
    cfg = e2e.config(devstack, topics)
    producer = AIOKafkaProducer(
        bootstrap_servers=boot, transactional_id=f"bridge-{topics['input']}"
    )
    await producer.start()
    try:
        async with e2e.running(cfg) as runtime:
            for _ in range(2):
                async with producer.transaction():
                    for _ in range(3):
                        key, value, headers = e2e.good_record(*e2e.outcome(None, ["hv-3"]))
                        await producer.send(topics["input"], value, key=key, headers=headers)
            assert len(await e2e.read_all(boot, topics["output"], 6, timeout_s=30)) == 6
            deadline = time.monotonic() + 20
            lag = -1.0
            while (
                lag := sample(
                    await scrape(runtime), "crs_consumer_lag", topic=topics["input"], partition="0"
                )
            ) != 0:
                assert time.monotonic() < deadline, f"lag {lag} with every event processed"
                await asyncio.sleep(0.2)
    finally:
        await producer.stop()


async def test_a_backlog_taken_over_fences_its_placements_slots_and_live_events_do_not(
    devstack: DevStack, clean_k8s: Any, new_topic: Any
) -> None:
    """Records below the end offset at a take-over may have been processed by the
    partition's previous owner, whose write the watch cache may not show yet or which may
    still be in flight: their placements fence the candidate slots before claiming one
    (a guarded PATCH each; tests/integration/test_takeover_fence.py shows why). Records
    that arrive later, which nobody else can have seen, are decided on the cache alone."""
    await e2e.seed_region(clean_k8s)
    topics = await e2e.new_topics(new_topic, 1)
    boot = devstack.kafka_bootstrap
    cfg = e2e.config(devstack, topics, CRS_K8S_READ_MODE="watch")
    placement = ["hv-1", ["hv-1", "hv-2"]]  # one candidate slot on hv-1: slot-p1-hv1
    backlog = [e2e.good_record(*e2e.outcome(*placement)) for _ in range(2)]  # type: ignore[arg-type]
    await e2e.publish(boot, topics["input"], backlog)
    patches = (
        "crs_k8s_requests_total",
        (("code", "200"), ("kind", "reservations"), ("verb", "patch")),
    )
    async with e2e.running(cfg) as runtime:
        assert runtime.http is not None
        outputs = await e2e.read_all(boot, topics["output"], 2, timeout_s=30)
        assert [e2e.data_of(r)["allocation"] for r in outputs] == ["written", "written"]
        # Per replayed placement: its fence of slot-p1-hv1, then its write.
        assert (await e2e.metrics_at(runtime.http.port)).get(patches, 0.0) == 4
        slot = await f.get(clean_k8s, "reservations", "slot-p1-hv1")
        assert set(slot["metadata"]["annotations"]) == {FENCE_ANNOTATION}
        live = [e2e.good_record(*e2e.outcome(*placement)) for _ in range(2)]  # type: ignore[arg-type]
        await e2e.publish(boot, topics["input"], live)
        outputs = await e2e.read_all(boot, topics["output"], 4, timeout_s=30)
        assert [e2e.data_of(r)["allocation"] for r in outputs[2:]] == ["written", "written"]
        assert (await e2e.metrics_at(runtime.http.port)).get(patches, 0.0) == 6  # writes only


async def test_a_late_outcome_is_stamped_with_its_placement_time_and_a_replay_writes_nothing(
    devstack: DevStack, clean_k8s: Any, topics: dict[str, str]
) -> None:
    # Cortex's reservation controller counts its 15-minute grace from an allocation's
    # creationTimestamp. An outcome processed two hours late (lag, catch-up, a new group)
    # gets the placement's time, so Cortex checks the VM at its next reconcile instead of
    # holding the slot's memory for it for a fresh grace period. A producer clock ahead
    # of ours is clamped to now.
    await e2e.seed_region(clean_k8s)
    now = datetime.now(UTC)
    placed = (now - timedelta(hours=2)).replace(microsecond=0)
    late, decision, request = e2e.outcome("hv-1", ["hv-1"])
    ahead, decision_ahead, request_ahead = e2e.outcome("hv-1", ["hv-1"])
    records = [
        e2e.good_record(late, decision, request, time=placed, event_id="late-1"),
        e2e.good_record(ahead, decision_ahead, request_ahead, time=now + timedelta(hours=1)),
        # The same outcome again (a redrive, a replay after a takeover): nothing is written.
        e2e.good_record(late, decision, request, time=placed, event_id="late-1"),
    ]
    async with e2e.running(e2e.config(devstack, topics)) as runtime:
        await e2e.publish(devstack.kafka_bootstrap, topics["input"], records)
        await wait_processed(runtime, len(records))
        done = datetime.now(UTC)
    outputs = await e2e.read_all(devstack.kafka_bootstrap, topics["output"], 3, partitions=2)
    statuses = sorted(
        (e2e.data_of(r)["instance_uuid"] == late, e2e.data_of(r)["allocation"]) for r in outputs
    )
    assert statuses == [(False, "written"), (True, "already_present"), (True, "written")]
    slot = await f.get(clean_k8s, "reservations", "slot-p1-hv1")
    allocations = slot["spec"]["committedResourceReservation"]["allocations"]
    assert set(allocations) == {late, ahead}
    assert allocations[late]["creationTimestamp"] == placed.strftime("%Y-%m-%dT%H:%M:%SZ")
    stamped = datetime.strptime(allocations[ahead]["creationTimestamp"], "%Y-%m-%dT%H:%M:%S%z")
    assert now.replace(microsecond=0) <= stamped <= done
