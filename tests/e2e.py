"""Helpers for end-to-end tests: a region in the API server, outcomes on Kafka, the
service in-process or as a real process, and readers of what it produced."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from service.app.config import Config
from service.app.runtime import Runtime
from service.stream.codec import encode_input
from service.stream.committed import fetch_committed
from tests import factories as f
from tests import nova
from tests.conftest import REPO, DevStack

GiB = 1024**3


async def seed_region(api: Any, *, knowledge: bool = True) -> None:
    """Four hosts, one flavor group, CRs for three projects, slots on hv-1 and hv-2.

    p1: active, room left (slots 16Gi on hv-1, 8Gi on hv-2); p2: active but exhausted;
    p3: no commitment at all.
    """
    for name in ("hv-1", "hv-2", "hv-3", "hv-4"):
        await f.create(api, f.hypervisor(name, memory="256Gi"))
    if knowledge:
        await f.create(
            api,
            f.knowledge(
                [
                    f.flavor_group(
                        "g1", [f.flavor("m1.small", 4096, 2), f.flavor("m1.large", 8192, 4)]
                    )
                ]
            ),
        )
    await f.create(api, f.committed_resource("cr-p1", project="p1", amount="256Gi", used="0"))
    await f.create(api, f.committed_resource("cr-p2", project="p2", amount="8Gi", used="8Gi"))
    await f.create(api, f.reservation("slot-p1-hv1", host="hv-1", project="p1", memory="16Gi"))
    await f.create(api, f.reservation("slot-p1-hv2", host="hv-2", project="p1", memory="8Gi"))


def outcome(
    target: str | None,
    hosts: Sequence[str],
    *,
    project: str = "p1",
    flavor: str = "m1.small",
    skip: bool | None = None,
    vm: str | None = None,
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    vm = vm or str(uuid.uuid4())
    request = nova.request(
        vm,
        project_id=project,
        flavor_name=flavor,
        hosts=hosts,
        hints={"_nova_check_type": "resize"},
        skip_cr_tracking=skip,
    )
    ordered = list(hosts) if target else []
    return vm, nova.decision_dict(target, ordered), request


async def publish(
    bootstrap: str, topic: str, records: Sequence[tuple[bytes | None, bytes | None, list[Any]]]
) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        futures = [
            await producer.send(topic, value, key=key, headers=headers)
            for key, value, headers in records
        ]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


def good_record(vm: str, decision: dict[str, Any], request: dict[str, Any], **kw: Any) -> Any:
    value, headers = encode_input(decision, request, **kw)
    return (vm.encode(), value, headers)


async def read_all(
    bootstrap: str,
    topic: str,
    expected: int,
    *,
    partitions: int = 1,
    timeout_s: float = 60,
    isolation_level: str = "read_committed",
) -> list[ConsumerRecord]:
    """Every committed record of ``topic`` (read_committed; read_uncommitted: those of
    open and aborted transactions too), waiting for ``expected``."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        isolation_level=isolation_level,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        out: list[ConsumerRecord] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=300)
            for records in batch.values():
                out.extend(records)
            if len(out) >= expected:
                # Drain a little longer: more than expected would be a duplicate.
                extra = await consumer.getmany(timeout_ms=500)
                for records in extra.values():
                    out.extend(records)
                break
        return out
    finally:
        await consumer.stop()


@contextlib.asynccontextmanager
async def _group_client(bootstrap: str, group: str) -> AsyncIterator[AIOKafkaConsumer]:
    """A consumer of ``group`` that never joins it: its coordinator answers OffsetFetch."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        yield consumer
    finally:
        await consumer.stop()


async def committed(bootstrap: str, group: str, tp: TopicPartition) -> OffsetAndMetadata | None:
    """The group's committed offset (and metadata) of ``tp``, as the broker has it; None
    only if the group never committed it. Read as the service reads it
    (service.stream.committed): an error raises, where aiokafka's consumer and admin
    client return nothing at all for a group-level error (a coordinator loading)."""
    async with _group_client(bootstrap, group) as consumer:
        return await fetch_committed(consumer._coordinator, tp)


async def committed_offsets(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    """The group's committed offsets of ``topic``'s partitions (those it committed), read
    as ``committed`` reads one."""
    async with _group_client(bootstrap, group) as consumer:
        found = {}
        for p in sorted(await consumer._client._wait_on_metadata(topic)):
            offset = await fetch_committed(consumer._coordinator, TopicPartition(topic, p))
            if offset is not None:
                found[p] = offset.offset
        return found


def data_of(record: ConsumerRecord) -> dict[str, Any]:
    event: dict[str, Any] = msgspec.json.decode(record.value)
    return event["data"]  # type: ignore[no-any-return]


def config(devstack: DevStack, topics: dict[str, str], **settings: str) -> Config:
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": devstack.kafka_bootstrap,
        "KUBECONFIG": devstack.kubeconfig,
        "CRS_INPUT_TOPIC": topics["input"],
        "CRS_OUTPUT_TOPIC": topics["output"],
        "CRS_DLQ_TOPIC": topics["dlq"],
        "CRS_GROUP_ID": f"g-{topics['input']}",
        "CRS_HTTP_PORT": "0",
        "CRS_RETRY_BACKOFF_S": "0.1",
        "CRS_RETRY_BACKOFF_MAX_S": "0.5",
        **settings,
    }
    return Config.load(env=env)


def spawn(
    cfg: Config,
    log_path: str,
    argv: Sequence[str] = ("-m", "service", "run"),
    extra_env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """The service as a real process (``python -m service run``, or the interpreter with
    ``argv``: a wrapper around it), configured by env (``extra_env``: the wrapper's)."""
    env = {**os.environ, **cfg.to_env(), **(extra_env or {})}
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, *argv],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


@contextlib.contextmanager
def spawned(cfg: Config, log_path: str, **kw: Any) -> Iterator[subprocess.Popen[bytes]]:
    """:func:`spawn`, killed on exit if it is still running (a test that failed early)."""
    proc = spawn(cfg, log_path, **kw)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextlib.asynccontextmanager
async def running(cfg: Config) -> AsyncIterator[Runtime]:
    """The service in this process (started, its loop running), stopped again on exit."""
    runtime = Runtime(cfg)
    await runtime.start()
    task = asyncio.create_task(runtime.run())
    try:
        yield runtime
    finally:
        await _shut_down(runtime, task)


SHUTDOWN_S = 30.0


async def _shut_down(runtime: Runtime, task: asyncio.Task[None]) -> None:
    """Stop the service and fail the test if its run task crashed or did not end within
    SHUTDOWN_S of the stop request (a hang at shutdown is a bug a replica would show as a
    SIGKILL after its grace period); the runtime is stopped in every case."""
    runtime.request_stop()
    done, _ = await asyncio.wait({task}, timeout=SHUTDOWN_S)
    if not done:
        task.cancel()
        await asyncio.wait({task})
    await runtime.stop()
    if not done:
        raise AssertionError(f"the service's run task did not end within {SHUTDOWN_S} s of stop")
    if task.cancelled():
        raise AssertionError("the service's run task was cancelled instead of ending")
    if (error := task.exception()) is not None:
        raise AssertionError(f"the service's run task crashed: {error!r}") from error


async def new_topics(new_topic: Any, partitions: int) -> dict[str, str]:
    """Fresh input and output topics of ``partitions`` partitions and a dead-letter topic
    of one (``new_topic``: the fixture of that name)."""
    return {
        "input": await new_topic("in", partitions),
        "output": await new_topic("out", partitions),
        "dlq": await new_topic("dlq", 1),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def http_get(port: int, path: str, timeout_s: float = 2.0) -> tuple[int | None, str]:
    """Status and body of the service's ``path`` on ``port``; (None, "") when it does
    not answer in ``timeout_s`` (a probe on a busy host)."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http,
            http.get(f"http://127.0.0.1:{port}{path}") as resp,
        ):
            return resp.status, await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return None, ""


async def metrics_at(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the service's /metrics on ``port``: (name, sorted labels) -> value."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/metrics") as resp,
    ):
        assert resp.status == 200
        text = await resp.text()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


async def counter_sums(port: int, *names: str) -> dict[str, float]:
    """Each counter's total over its label sets, from the replica's /metrics."""
    sums = dict.fromkeys(names, 0.0)
    for (name, _labels), value in (await metrics_at(port)).items():
        if name in sums:
            sums[name] += value
    return sums


def log_events(path: Path, event: str) -> list[dict[str, Any]]:
    """The JSON log lines of ``event`` in a service's log, in order (aiokafka's plain
    lines are skipped)."""
    needle = f'"event":"{event}"'
    return [
        json.loads(line)
        for line in path.read_text(errors="replace").splitlines()
        if needle in line and line.startswith("{")
    ]


def audit(
    kubeconfig: str, *args: str, grace_s: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``crs-consumer audit`` as an operator runs it, against ``kubeconfig``; ``grace_s``:
    ``CRS_INVARIANT_GRACE_S`` (None: the default, 900 s, whatever this process has)."""
    env = {**os.environ, "KUBECONFIG": kubeconfig}
    env.pop("CRS_INVARIANT_GRACE_S", None)
    if grace_s is not None:
        env["CRS_INVARIANT_GRACE_S"] = grace_s
    return subprocess.run(
        [sys.executable, "-m", "service", "audit", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
