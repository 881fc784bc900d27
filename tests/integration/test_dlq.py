"""`crs-consumer dlq list | redrive` on the real broker, with the service as it runs.

An event is dead-lettered as ``retries_exhausted`` while the API server is unreachable,
listed, redriven after the "outage", and classified exactly once (one classification,
the VM in one slot). A record already redriven ``--max-redrives`` times is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml

from service.app.config import Config
from tests import e2e
from tests.conftest import REPO, DevStack
from tests.integration.test_service_resilience import allocations_by_vm

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture
async def topics(new_topic: Any) -> dict[str, str]:
    return {
        "input": await new_topic("in", 1),
        "output": await new_topic("out", 1),
        "dlq": await new_topic("dlq", 1),
    }


def cli(cfg: Config, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **cfg.to_env()}
    return subprocess.run(
        [sys.executable, "-m", "service", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def unreachable_kubeconfig(devstack: DevStack, tmp_path: Path) -> str:
    """The dev stack's kubeconfig, pointed at a port nothing listens on."""
    config = yaml.safe_load(Path(devstack.kubeconfig).read_text())
    for cluster in config["clusters"]:
        cluster["cluster"]["server"] = "https://127.0.0.1:9"
    path = tmp_path / "kubeconfig-unreachable"
    path.write_text(yaml.safe_dump(config))
    return str(path)


async def one_event_and_an_outage(
    devstack: DevStack, clean_k8s: Any, topics: dict[str, str], tmp_path: Path
) -> tuple[str, Config]:
    """One slot_used placement on the input, and the settings of a service that cannot
    reach the API server and dead-letters it (retries_exhausted) after two attempts."""
    await e2e.seed_region(clean_k8s)
    vm, decision, request = e2e.outcome("hv-1", ["hv-1", "hv-2"])
    await e2e.publish(
        devstack.kafka_bootstrap, topics["input"], [e2e.good_record(vm, decision, request)]
    )
    outage = e2e.config(
        devstack,
        topics,
        KUBECONFIG=unreachable_kubeconfig(devstack, tmp_path),
        CRS_K8S_READ_MODE="list",
        CRS_K8S_TIMEOUT_S="1",
        CRS_MAX_ATTEMPTS="2",
    )
    return vm, outage


async def test_dead_lettered_during_an_outage_redriven_and_classified_once(
    devstack: DevStack, clean_k8s: Any, topics: dict[str, str], tmp_path: Path
) -> None:
    vm, outage = await one_event_and_an_outage(devstack, clean_k8s, topics, tmp_path)
    async with e2e.running(outage):
        dead = await e2e.read_all(devstack.kafka_bootstrap, topics["dlq"], 1, timeout_s=60)
    assert [dict(r.headers)["crs.error"] for r in dead] == [b"retries_exhausted"]

    listed = cli(outage, "dlq", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    summary = json.loads(listed.stdout)
    assert summary["matching"] == 1
    entry = summary["codes"]["retries_exhausted"]
    assert entry["count"] == 1
    assert entry["offsets"] == {"0": {"from": dead[0].offset, "to": dead[0].offset}}
    assert "Cannot connect to host 127.0.0.1:9" in entry["sample_reasons"][0]
    assert entry["first"] == entry["last"]

    dry = cli(outage, "dlq", "redrive", "--code", "retries_exhausted", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would redrive 1," in dry.stdout
    other = cli(outage, "dlq", "redrive", "--code", "not_json")
    assert "redriven 0," in other.stdout or "would redrive 0," in other.stdout
    inputs = await e2e.read_all(devstack.kafka_bootstrap, topics["input"], 2, timeout_s=3)
    assert len(inputs) == 1, "a dry run or a non-matching filter published something"

    done = cli(outage, "dlq", "redrive", "--code", "retries_exhausted")
    assert done.returncode == 0, done.stderr
    assert "redriven 1, refused 0" in done.stdout
    inputs = await e2e.read_all(devstack.kafka_bootstrap, topics["input"], 2, timeout_s=30)
    assert len(inputs) == 2
    redriven = inputs[1]
    assert (redriven.key, redriven.value) == (inputs[0].key, inputs[0].value)
    headers = dict(redriven.headers)
    assert headers["crs.redrive.count"] == b"1"
    assert not [k for k in headers if k.startswith("crs.") and k != "crs.redrive.count"]
    assert [h for h in redriven.headers if not h[0].startswith("crs.")] == list(inputs[0].headers)

    # The "outage" is over: the same group resumes after the dead-lettered offset and
    # sees only the redriven copy.
    fixed = e2e.config(devstack, topics)
    async with e2e.running(fixed):
        await e2e.read_all(devstack.kafka_bootstrap, topics["output"], 1, timeout_s=60)
        # A later event on the (one-partition) input, classified: everything before it
        # had its chance to come out, a duplicate of the redriven one included.
        later, decision, request = e2e.outcome(None, ["hv-2"])
        await e2e.publish(
            devstack.kafka_bootstrap, topics["input"], [e2e.good_record(later, decision, request)]
        )
        outputs = await e2e.read_all(devstack.kafka_bootstrap, topics["output"], 2, timeout_s=60)
    assert [e2e.data_of(r)["instance_uuid"] for r in outputs] == [vm, later]
    assert e2e.data_of(outputs[0])["cr_slot"] == "slot_used"
    assert (await allocations_by_vm(clean_k8s))[vm] == ["slot-p1-hv1"]
    dlq_after = await e2e.read_all(devstack.kafka_bootstrap, topics["dlq"], 2, timeout_s=3)
    assert len(dlq_after) == 1


async def test_a_record_redriven_too_often_is_refused(
    devstack: DevStack, topics: dict[str, str]
) -> None:
    loop_headers = [
        ("crs.error", b"retries_exhausted"),
        ("crs.reason", b"UnavailableError: timed out"),
        ("crs.redrive.count", b"3"),
    ]
    fresh_headers = [("crs.error", b"retries_exhausted"), ("crs.reason", b"timed out")]
    # A stub dead letter (the full one was refused by the topic): no value to send back.
    stub_headers = [("crs.error", b"output_rejected"), ("crs.stub", b"true")]
    await e2e.publish(
        devstack.kafka_bootstrap,
        topics["dlq"],
        [(b"vm-a", b"{}", loop_headers), (b"vm-b", b"{}", fresh_headers)],
    )
    await e2e.publish(devstack.kafka_bootstrap, topics["dlq"], [(b"vm-c", None, stub_headers)])
    # Dead letters that are not the input as it was (found by review): a key cut short
    # lands on another partition, out of its key's order; headers cut or left out change
    # what the service decides (a cut ce_id, a new output id); another topic's record
    # does not belong in this input.
    cut = [
        (b"vm-d", b"{}", [*fresh_headers, ("crs.key.truncated", b"9000")]),
        (b"vm-e", b"{}", [*fresh_headers, ("crs.headers.truncated", b"1")]),
        (b"vm-f", b"{}", [*fresh_headers, ("crs.headers.omitted", b"2")]),
        (b"vm-g", b"{}", [*fresh_headers, ("crs.source.topic", b"elsewhere")]),
    ]
    await e2e.publish(devstack.kafka_bootstrap, topics["dlq"], cut)
    cfg = e2e.config(devstack, topics)
    out = cli(cfg, "dlq", "redrive", "--max-redrives", "3")
    assert out.returncode == 0, out.stderr
    assert "refused p0:0 (retries_exhausted): redriven 3 times" in out.stdout
    assert "refused p0:2 (output_rejected): a stub without the value" in out.stdout
    assert "refused p0:3 (retries_exhausted): key cut short" in out.stdout
    assert "refused p0:4 (retries_exhausted): headers cut short or left out" in out.stdout
    assert "refused p0:5 (retries_exhausted): headers cut short or left out" in out.stdout
    assert "refused p0:6 (retries_exhausted): from another topic (elsewhere)" in out.stdout
    assert "redriven 1, refused 6" in out.stdout
    inputs = await e2e.read_all(devstack.kafka_bootstrap, topics["input"], 1, timeout_s=20)
    assert [(r.key, dict(r.headers)["crs.redrive.count"]) for r in inputs] == [(b"vm-b", b"1")]


async def test_a_redrive_repeated_while_the_event_keeps_failing_sends_it_once_per_run(
    devstack: DevStack, clean_k8s: Any, topics: dict[str, str], tmp_path: Path
) -> None:
    """Each run used to send every dead letter of the event again, the original and each
    copy that came back, so the copies doubled with each run of a fix that did not work
    (found by review: 176 dead letters after 10 runs at --max-redrives 3). Only the
    latest dead letter of an event is redriven now; the earlier ones are superseded by
    it."""
    _, outage = await one_event_and_an_outage(devstack, clean_k8s, topics, tmp_path)
    runs = 3
    async with e2e.running(outage):
        await e2e.read_all(devstack.kafka_bootstrap, topics["dlq"], 1, timeout_s=60)
        for run in range(1, runs + 1):
            done = cli(outage, "dlq", "redrive", "--code", "retries_exhausted")
            assert done.returncode == 0, done.stderr
            assert "redriven 1," in done.stdout, done.stdout
            assert f"refused {run - 1}" in done.stdout, done.stdout
            # The copy fails again (the "fix" did not work) and is dead-lettered again.
            await e2e.read_all(devstack.kafka_bootstrap, topics["dlq"], run + 1, timeout_s=60)
    inputs = await e2e.read_all(devstack.kafka_bootstrap, topics["input"], 2 * runs, timeout_s=3)
    assert len(inputs) == 1 + runs, [dict(r.headers) for r in inputs]
    counts = [dict(r.headers).get("crs.redrive.count") for r in inputs]
    assert counts == [None, b"1", b"2", b"3"]
    dead = await e2e.read_all(devstack.kafka_bootstrap, topics["dlq"], 2 * runs, timeout_s=3)
    assert len(dead) == 1 + runs


async def test_a_redrive_that_did_not_read_the_whole_topic_says_so_and_fails(
    devstack: DevStack, topics: dict[str, str]
) -> None:
    """--max-records cut the read short and the redrive still reported success (exit 0),
    so a rerun met the same first records and never the rest (found by review)."""
    headers = [("crs.error", b"retries_exhausted"), ("crs.reason", b"timed out")]
    await e2e.publish(
        devstack.kafka_bootstrap,
        topics["dlq"],
        [(f"vm-{i}".encode(), b"{}", headers) for i in range(5)],
    )
    cfg = e2e.config(devstack, topics)
    # Nothing is sent either: a later dead letter of a selected input may lie beyond.
    out = cli(cfg, "dlq", "redrive", "--max-records", "2")
    assert out.returncode == 3, (out.stdout, out.stderr)
    assert "would redrive 2," in out.stdout
    assert "incomplete, nothing sent: stopped after --max-records 2" in out.stdout
    assert not await e2e.read_all(devstack.kafka_bootstrap, topics["input"], 1, timeout_s=3)
    whole = cli(cfg, "dlq", "redrive", "--dry-run")
    assert whole.returncode == 0, (whole.stdout, whole.stderr)
    assert "would redrive 5," in whole.stdout


async def test_a_redrive_that_fails_half_way_sends_nothing(
    devstack: DevStack, topics: dict[str, str]
) -> None:
    """One record the input topic refuses (too large for it), one it accepts, on two
    partitions: the accepted one was sent and the run failed, so a rerun after the fix
    sent it twice. Now the run is one transaction: aborted, nothing visible to the
    service's read_committed consumer."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from service.stream.partitioner import partition_for_key

    admin = AIOKafkaAdminClient(bootstrap_servers=devstack.kafka_bootstrap)
    await admin.start()
    small_input = f"in-small-{os.urandom(5).hex()}"
    try:
        limit = {"max.message.bytes": "100000"}
        await admin.create_topics([NewTopic(small_input, 2, 1, topic_configs=limit)])
        keys = [f"vm-{i}".encode() for i in range(50)]
        fits = next(k for k in keys if partition_for_key(k, [0, 1], [0, 1]) == 0)
        too_big = next(k for k in keys if partition_for_key(k, [0, 1], [0, 1]) == 1)
        headers = [("crs.error", b"retries_exhausted"), ("crs.reason", b"timed out")]
        await e2e.publish(
            devstack.kafka_bootstrap,
            topics["dlq"],
            [(fits, b"{}", headers), (too_big, b"x" * 200_000, headers)],
        )
        cfg = e2e.config(devstack, {**topics, "input": small_input})
        out = cli(cfg, "dlq", "redrive")
        assert out.returncode == 1, (out.stdout, out.stderr)
        assert "FAILED" in out.stderr
        sent = await e2e.read_all(devstack.kafka_bootstrap, small_input, 1, timeout_s=5)
        assert not sent, [r.key for r in sent]
    finally:
        with contextlib.suppress(Exception):
            await admin.delete_topics([small_input])
        await admin.close()


async def test_a_killed_redrives_open_transaction_is_shown_and_ended_by_a_rerun(
    devstack: DevStack, clean_k8s: Any, topics: dict[str, str]
) -> None:
    """A redrive killed while sending (SIGKILL, an evicted Job) leaves its transaction
    open on the input for up to its 15-minute timeout: every event behind it waits, and
    the lag, measured to the last stable offset, reads 0 (found by review). The service
    shows how long the stable offset has been stuck (crs_input_stable_offset_stuck_seconds,
    alert CrsInputTransactionOpen), and running the redrive again ends it: its
    InitProducerId aborts the open transaction even when it has nothing to send."""
    from aiokafka import AIOKafkaProducer

    from service.app.dlq import redrive_transactional_id

    await e2e.seed_region(clean_k8s)
    boot = devstack.kafka_bootstrap
    cfg = e2e.config(devstack, topics)
    killed = AIOKafkaProducer(
        bootstrap_servers=boot,
        transactional_id=redrive_transactional_id(cfg),
        transaction_timeout_ms=900_000,
    )
    await killed.start()
    async with e2e.running(cfg) as runtime:
        assert runtime.http is not None
        await killed.begin_transaction()
        vm, decision, request = e2e.outcome(None, ["hv-3"])
        key, value, headers = e2e.good_record(vm, decision, request)
        await (await killed.send(topics["input"], value, key=key, headers=headers))
        # Killed: its connections gone, the transaction left open on the broker.
        await killed.client.close()
        await e2e.publish(boot, topics["input"], [e2e.good_record(*e2e.outcome(None, ["hv-3"]))])
        series = (
            "crs_input_stable_offset_stuck_seconds",
            (("partition", "0"), ("topic", topics["input"])),
        )
        deadline = asyncio.get_running_loop().time() + 30
        while (await e2e.metrics_at(runtime.http.port)).get(series, 0.0) < 3.0:
            assert asyncio.get_running_loop().time() < deadline, "the open transaction not shown"
            await asyncio.sleep(0.5)
        # Stuck for 3 s with nothing left to read (lag 0 against the stable offset): the
        # event behind the open transaction had its chance, and was not read.
        lag = ("crs_consumer_lag", (("partition", "0"), ("topic", topics["input"])))
        assert (await e2e.metrics_at(runtime.http.port)).get(lag) == 0.0
        assert not await e2e.read_all(boot, topics["output"], 1, timeout_s=1)
        # Nothing in the dead-letter topic: the rerun has nothing to send, and ends it.
        out = await asyncio.to_thread(cli, cfg, "dlq", "redrive")
        assert out.returncode == 0, (out.stdout, out.stderr)
        assert "redriven 0," in out.stdout
        # The aborted record is never read; the event behind it is, promptly.
        assert len(await e2e.read_all(boot, topics["output"], 1, timeout_s=20)) == 1
        deadline = asyncio.get_running_loop().time() + 20
        while (await e2e.metrics_at(runtime.http.port)).get(series, 0.0) != 0.0:
            assert asyncio.get_running_loop().time() < deadline, "still shown as stuck"
            await asyncio.sleep(0.5)


# `crs-consumer dlq redrive` with SIGTERM sent to itself once its commit is on its way.
_SIGNAL_WHILE_COMMITTING = """
import asyncio, os, signal, sys
from aiokafka import AIOKafkaProducer
original = AIOKafkaProducer.commit_transaction
async def commit(self):
    asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)
    await original(self)
AIOKafkaProducer.commit_transaction = commit
from service.app.cli import main
sys.exit(main(["dlq", "redrive"]))
"""


async def test_a_redrive_signalled_while_committing_says_that_it_sent(
    devstack: DevStack, topics: dict[str, str]
) -> None:
    """A SIGTERM (a pod deleted, a terminal closed) that came while the commit was on its
    way: aiokafka goes on with the EndTxn under a shield, and the tool said "nothing was
    sent (its transaction was aborted)" while the broker committed the copies; a rerun
    sent them twice (found by review). Now the tool waits for the commit and says so."""
    import signal

    headers = [("crs.error", b"retries_exhausted"), ("crs.reason", b"timed out")]
    await e2e.publish(devstack.kafka_bootstrap, topics["dlq"], [(b"vm-1", b"{}", headers)])
    cfg = e2e.config(devstack, topics)
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", _SIGNAL_WHILE_COMMITTING],
        cwd=REPO,
        env={**os.environ, **cfg.to_env()},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 128 + signal.SIGTERM, (out.stdout, out.stderr)
    assert "redriven 1, refused 0" in out.stdout, (out.stdout, out.stderr)
    sent = await e2e.read_all(devstack.kafka_bootstrap, topics["input"], 1, timeout_s=10)
    assert [r.key for r in sent] == [b"vm-1"]
