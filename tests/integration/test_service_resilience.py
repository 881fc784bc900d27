"""Nothing lost, nothing twice: crashes, restarts, rebalances and a Kubernetes outage.

The service runs as a real process (``python -m service run``) where the test kills it,
and in-process where the test needs its counters. Exactly-once is verified the way
KAFKA-PITFALLS.md advises: with a ``read_committed`` reader and a SIGKILL in the middle,
not by trusting the client library.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import TopicPartition

from service.app.runtime import Runtime
from tests import e2e
from tests import factories as f
from tests.conftest import REPO, DevStack

pytestmark = pytest.mark.integration

PARTITIONS = 4


async def seed_capacity(api: Any, hosts: int = 16) -> list[str]:
    """p1 with room for 16 VMs of 4 GiB on every host (two 32 GiB slots per host)."""
    names = [f"hv-{i}" for i in range(hosts)]
    for name in names:
        await f.create(api, f.hypervisor(name, memory="512Gi"))
        for s in range(2):
            await f.create(api, f.reservation(f"slot-{name}-{s}", host=name, memory="32Gi"))
    await f.create(api, f.knowledge([f.flavor_group("g1", [f.flavor("m1.small", 4096, 2)])]))
    await f.create(api, f.committed_resource("cr-p1", project="p1", amount="4Ti", used="0"))
    return names


def placements(hosts: list[str], n: int) -> tuple[list[Any], set[str]]:
    records, vms = [], set()
    for i in range(n):
        target = hosts[i % len(hosts)]
        vm, decision, request = e2e.outcome(target, [target, hosts[(i + 1) % len(hosts)]])
        records.append(e2e.good_record(vm, decision, request))
        vms.add(vm)
    return records, vms


async def count_committed(bootstrap: str, topic: str) -> int:
    """Committed (visible to read_committed) records in ``topic``: the LSO per partition."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed")
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)  # read_committed: last stable offsets
        begins = await consumer.beginning_offsets(tps)
        # Offsets include transaction markers, so this over-counts; it only paces the test.
        return sum(ends[tp] - begins[tp] for tp in tps)
    finally:
        await consumer.stop()


async def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def allocations_by_vm(api: Any) -> dict[str, list[str]]:
    from kubernetes_asyncio import client

    co = client.CustomObjectsApi(api)
    listed = await co.list_cluster_custom_object(*f.RES)
    where: dict[str, list[str]] = collections.defaultdict(list)
    for item in listed["items"]:
        crr = item["spec"].get("committedResourceReservation") or {}
        for vm in crr.get("allocations") or {}:
            where[vm].append(item["metadata"]["name"])
    return where


def check_exactly_once(outputs: list[Any], vms: set[str], where: dict[str, list[str]]) -> None:
    datas = [e2e.data_of(r) for r in outputs]
    keys = collections.Counter((d["input"]["partition"], d["input"]["offset"]) for d in datas)
    duplicates = [k for k, c in keys.items() if c > 1]
    assert not duplicates, f"input records classified twice: {duplicates[:5]}"
    assert {d["instance_uuid"] for d in datas} == vms
    assert all(d["cr_slot"] == "slot_used" for d in datas)
    placed = {
        d["instance_uuid"] for d in datas if d["allocation"] in {"written", "already_present"}
    }
    assert placed == vms, "every VM fits: each must end in a slot"
    assert set(where) == vms
    twice = {vm: slots for vm, slots in where.items() if len(slots) > 1}
    assert not twice, f"VMs written into more than one slot: {twice}"


async def service_topics(new_topic: Any) -> dict[str, str]:
    return await e2e.new_topics(new_topic, PARTITIONS)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 20) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout=timeout)


async def test_sigkill_mid_stream_then_restart_is_exactly_once(
    devstack: DevStack, clean_k8s: Any, new_topic: Any, tmp_path: Path
) -> None:
    hosts = await seed_capacity(clean_k8s)
    topics = await service_topics(new_topic)
    records, vms = placements(hosts, 240)
    await e2e.publish(devstack.kafka_bootstrap, topics["input"], records)
    cfg = e2e.config(devstack, topics, CRS_MAX_BATCH="8", CRS_SHUTDOWN_TIMEOUT_S="15")
    log = str(tmp_path / "service.log")

    first = e2e.spawn(cfg, log)
    try:

        async def some_committed() -> bool:
            assert first.poll() is None, Path(log).read_text()[-3000:]
            return await count_committed(devstack.kafka_bootstrap, topics["output"]) >= 40

        await wait_for(some_committed, 60, "the first outputs")
    finally:
        first.kill()  # SIGKILL: no commit, no leave-group, a transaction possibly open
        first.wait(10)
    done_before = await count_committed(devstack.kafka_bootstrap, topics["output"])
    assert done_before < 2 * len(records), "killed after the stream was fully processed"

    second = e2e.spawn(cfg, log)
    try:
        outputs = await e2e.read_all(
            devstack.kafka_bootstrap,
            topics["output"],
            len(records),
            partitions=PARTITIONS,
            timeout_s=120,
        )
        assert len(outputs) == len(records), Path(log).read_text()[-3000:]
    finally:
        code = stop(second)
    assert code == 0, Path(log).read_text()[-3000:]
    check_exactly_once(outputs, vms, await allocations_by_vm(clean_k8s))
    dead = await e2e.read_all(devstack.kafka_bootstrap, topics["dlq"], 0, timeout_s=2)
    assert dead == []

    # The graceful stop committed everything: the group has no lag left.
    per_partition = collections.Counter(d["input"]["partition"] for d in map(e2e.data_of, outputs))
    committed = await e2e.committed_offsets(devstack.kafka_bootstrap, cfg.group_id, topics["input"])
    for p in range(PARTITIONS):
        assert committed.get(p) == per_partition[p], f"partition {p}: committed {committed.get(p)}"


async def test_rebalance_hands_partitions_over_without_loss_or_duplicates(
    devstack: DevStack, clean_k8s: Any, new_topic: Any, tmp_path: Path
) -> None:
    hosts = await seed_capacity(clean_k8s)
    topics = await service_topics(new_topic)
    records, vms = placements(hosts, 200)
    # Both replicas share the transactional-id prefix (the group id): the ids are bound
    # to input partitions, so whoever takes a partition over fences its previous owner.
    cfg_a = e2e.config(devstack, topics, CRS_MAX_BATCH="5")
    cfg_b = e2e.config(devstack, topics, CRS_MAX_BATCH="5")
    log = str(tmp_path / "service.log")
    a = e2e.spawn(cfg_a, log)
    b = e2e.spawn(cfg_b, log)
    try:
        await e2e.publish(devstack.kafka_bootstrap, topics["input"], records)

        async def partway() -> bool:
            return await count_committed(devstack.kafka_bootstrap, topics["output"]) >= 40

        await wait_for(partway, 60, "the first outputs")
        assert stop(a) == 0, Path(log).read_text()[-3000:]  # its partitions move to b
        outputs = await e2e.read_all(
            devstack.kafka_bootstrap,
            topics["output"],
            len(records),
            partitions=PARTITIONS,
            timeout_s=120,
        )
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                stop(proc)
    assert len(outputs) == len(records), Path(log).read_text()[-3000:]
    check_exactly_once(outputs, vms, await allocations_by_vm(clean_k8s))


async def test_api_server_outage_mid_stream_loses_nothing(
    devstack: DevStack, clean_k8s: Any, new_topic: Any
) -> None:
    hosts = await seed_capacity(clean_k8s, hosts=4)  # 40 VMs, room for 64
    topics = await service_topics(new_topic)
    before, vms_before = placements(hosts, 20)
    during, vms_during = placements(hosts, 20)
    cfg = e2e.config(
        devstack,
        topics,
        CRS_MAX_ATTEMPTS="1000",
        CRS_RETRY_BACKOFF_S="0.2",
        CRS_RETRY_BACKOFF_MAX_S="1",
        CRS_K8S_TIMEOUT_S="2",
    )
    runtime = Runtime(cfg)
    await runtime.start()
    task = asyncio.create_task(runtime.run())
    pid_file = devstack.run_dir / "kube-apiserver.pid"
    try:
        await e2e.publish(devstack.kafka_bootstrap, topics["input"], before)

        async def first_half() -> bool:
            assert runtime.stream is not None
            return runtime.stream.processed >= len(before)

        await wait_for(first_half, 60, "the events before the outage")
        pid = int(pid_file.read_text())
        # A crash, not a graceful stop: a terminating API server keeps serving open
        # watches for up to a minute, which is not the outage this test is about.
        os.kill(pid, signal.SIGKILL)
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            await asyncio.sleep(0.1)
        await e2e.publish(devstack.kafka_bootstrap, topics["input"], during)

        async def retried() -> bool:  # the placements were tried, and could not be written
            return bool(runtime.metrics.retries.labels("k8s_unavailable")._value.get() >= 2)

        await wait_for(retried, 60, "the service to retry the events during the outage")
        assert runtime.stream is not None
        assert runtime.stream.processed < len(before) + len(during)
    finally:
        up = await asyncio.create_subprocess_exec(
            str(REPO / "devstack" / "up"), stderr=asyncio.subprocess.PIPE
        )
        _, err = await up.communicate()
        assert up.returncode == 0, err.decode()

    try:

        async def all_done() -> bool:
            assert runtime.stream is not None
            return runtime.stream.processed >= len(before) + len(during)

        await wait_for(all_done, 120, "processing to resume after the outage")
    finally:
        runtime.request_stop()
        await asyncio.wait_for(task, 30)
        await runtime.stop()
    outputs = await e2e.read_all(
        devstack.kafka_bootstrap, topics["output"], 40, partitions=PARTITIONS, timeout_s=60
    )
    assert len(outputs) == 40
    check_exactly_once(outputs, vms_before | vms_during, await allocations_by_vm(clean_k8s))
    dead = await e2e.read_all(devstack.kafka_bootstrap, topics["dlq"], 0, timeout_s=2)
    assert dead == []


async def test_output_refused_as_too_large_becomes_stub_dead_letters_not_a_replay_loop(
    devstack: DevStack, clean_k8s: Any, new_topic: Any
) -> None:
    """The output topic refuses the records (too large for it). That is permanent, so it
    is not retried as if transient (the first engine replayed such a batch forever): each
    refused output is replaced by a stub dead letter naming its input, and every input
    ends as exactly one record across output and dead-letter topic."""
    from aiokafka.admin import NewTopic

    hosts = await seed_capacity(clean_k8s, hosts=4)
    topics = {"input": await new_topic("in", PARTITIONS), "dlq": await new_topic("dlq", 1)}
    topics["output"] = f"out-small-{topics['input']}"
    admin = AIOKafkaAdminClient(bootstrap_servers=devstack.kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [NewTopic(topics["output"], PARTITIONS, 1, topic_configs={"max.message.bytes": "200"})]
        )
        records, _vms = placements(hosts, 12)
        cfg = e2e.config(devstack, topics, CRS_RETRY_BACKOFF_S="0.1", CRS_RETRY_BACKOFF_MAX_S="0.4")
        runtime = Runtime(cfg)
        await runtime.start()
        task = asyncio.create_task(runtime.run())
        try:
            await e2e.publish(devstack.kafka_bootstrap, topics["input"], records)

            async def all_done() -> bool:
                assert runtime.stream is not None
                return runtime.stream.processed >= len(records)

            await wait_for(all_done, 60, "every input to end somewhere")
            failures = runtime.metrics.commit_failures.labels("record_too_large")._value.get()
            assert failures >= 1
            rejected = runtime.metrics.dead_letters.labels("output_rejected")._value.get()
            assert rejected == len(records)  # each stub counted once, at its commit
        finally:
            runtime.request_stop()
            await asyncio.wait_for(task, 30)
            await runtime.stop()
        stubs = await e2e.read_all(devstack.kafka_bootstrap, topics["dlq"], len(records))
        assert len(stubs) == len(records)
        sources = collections.Counter()
        for stub in stubs:
            headers = dict(stub.headers)
            assert headers["crs.stub"] == b"true"
            assert headers["crs.error"] == b"output_rejected"
            assert stub.value is None
            sources[(headers["crs.source.partition"], headers["crs.source.offset"])] += 1
        assert len(sources) == len(records)
        assert max(sources.values()) == 1
        # Nothing reached the output topic (read_committed: the refused transactions were
        # aborted), so no input has both an output and a stub.
        assert not await e2e.read_all(
            devstack.kafka_bootstrap, topics["output"], 1, partitions=PARTITIONS, timeout_s=2
        )
    finally:
        await admin.delete_topics([topics["output"]])
        await admin.close()


async def test_partitions_progress_concurrently_within_the_in_flight_bound(
    devstack: DevStack, clean_k8s: Any, new_topic: Any
) -> None:
    """Every partition with a backlog has work in flight at once (no partition waits for
    another), and a partition holds at most CRS_MAX_IN_FLIGHT records (plus the one
    fetch that crossed the bound) before it is paused."""
    hosts = await seed_capacity(clean_k8s)
    topics = await service_topics(new_topic)
    records, _ = placements(hosts, 160)
    await e2e.publish(devstack.kafka_bootstrap, topics["input"], records)
    cfg = e2e.config(devstack, topics, CRS_MAX_BATCH="10", CRS_MAX_IN_FLIGHT="10")
    runtime = Runtime(cfg)
    await runtime.start()
    assert runtime.stream is not None
    stream = runtime.stream
    widths: list[int] = []
    peaks: list[int] = []
    original = stream._feed

    def recording(part: Any, batch: Any) -> None:
        original(part, batch)
        peaks.append(part.ledger.in_flight)
        widths.append(sum(1 for p in stream._parts.values() if p.ledger.in_flight))

    stream._feed = recording  # type: ignore[method-assign]
    task = asyncio.create_task(runtime.run())
    try:

        async def all_done() -> bool:
            return stream.processed >= len(records)

        await wait_for(all_done, 90, "the backlog to drain")
    finally:
        runtime.request_stop()
        await asyncio.wait_for(task, 30)
        await runtime.stop()
    assert max(widths) >= PARTITIONS - 1, widths
    assert max(peaks) <= 10 + 10, peaks


async def test_a_stub_refused_too_stalls_its_partition_until_the_topic_is_fixed(
    devstack: DevStack, clean_k8s: Any, new_topic: Any
) -> None:
    """Output and dead-letter topics both too small even for a stub (a broken topic
    configuration): the partition is reported stalled with the cause, retried at the
    back-off (not a replay loop, not a silent drop, the process stays up), and once the
    dead-letter topic is fixed every input ends as exactly one stub."""
    from aiokafka.admin import NewTopic
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    hosts = await seed_capacity(clean_k8s, hosts=4)
    topics = {"input": await new_topic("in", 1)}
    topics["output"] = f"out-small-{topics['input']}"
    topics["dlq"] = f"dlq-small-{topics['input']}"
    admin = AIOKafkaAdminClient(bootstrap_servers=devstack.kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [
                NewTopic(topics["output"], 1, 1, topic_configs={"max.message.bytes": "200"}),
                NewTopic(topics["dlq"], 1, 1, topic_configs={"max.message.bytes": "100"}),
            ]
        )
        records, _vms = placements(hosts, 3)
        cfg = e2e.config(devstack, topics, CRS_RETRY_BACKOFF_S="0.1", CRS_RETRY_BACKOFF_MAX_S="0.4")
        async with e2e.running(cfg) as runtime:
            await e2e.publish(devstack.kafka_bootstrap, topics["input"], records)
            stream = runtime.stream
            assert stream is not None

            async def stalled() -> bool:
                return bool(stream.stalled())

            await wait_for(stalled, 60, "the partition to be reported stalled")
            await asyncio.sleep(2.0)
            ready, why = await runtime._ready()
            assert not ready
            assert "stalled" in why
            assert "TooLarge" in why
            failures = runtime.metrics.commit_failures
            # Each output refused once, then stubbed: one failure per commit that held
            # refused outputs (records decided apart are committed apart), never more.
            refused = failures.labels("record_too_large")._value.get()
            assert 1 <= refused <= len(records)
            # Retried at the back-off cap (0.4 s), not in a loop: ~5 tries in those 2 s.
            assert failures.labels("transient")._value.get() <= 20
            assert stream.processed == 0
            await admin.alter_configs(
                [
                    ConfigResource(
                        ConfigResourceType.TOPIC, topics["dlq"], {"max.message.bytes": "1048576"}
                    )
                ]
            )

            async def recovered() -> bool:
                return stream.processed >= len(records) and not stream.stalled()

            await wait_for(recovered, 60, "the stubs to be committed after the fix")
            assert (await runtime._ready())[0]
        stubs = await e2e.read_all(devstack.kafka_bootstrap, topics["dlq"], len(records))
        sources = collections.Counter(int(dict(s.headers)["crs.source.offset"]) for s in stubs)
        assert sources == collections.Counter(range(len(records)))
        assert all(dict(s.headers)["crs.stub"] == b"true" for s in stubs)
    finally:
        await admin.delete_topics([topics["output"], topics["dlq"]])
        await admin.close()
