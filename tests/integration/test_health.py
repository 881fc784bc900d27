"""Probes tell the truth about the dependencies, on the real dev stack.

The broker and the API server are frozen (SIGSTOP: connections stay open and silent,
the failure no client notices by itself): /readyz turns 503 within the configured bound
with the cause in its body, the dependency and readiness gauges follow, /healthz stays
200 (the process is fine), and everything recovers after SIGCONT. A topic created after
start is consumed within the metadata refresh period.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest_asyncio

from service.app.config import Config
from service.app.runtime import Runtime
from tests import e2e
from tests.conftest import DevStack

BOUND_S = 4.0


@pytest_asyncio.fixture
async def topics(new_topic: Any) -> dict[str, str]:
    return {
        "input": await new_topic("in", 1),
        "output": await new_topic("out", 1),
        "dlq": await new_topic("dlq", 1),
    }


@contextlib.contextmanager
def frozen(pid_file: Path) -> Iterator[None]:
    pid = int(pid_file.read_text())
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def probe(runtime: Runtime, path: str) -> tuple[int, dict[str, Any]]:
    assert runtime.http is not None
    url = f"http://127.0.0.1:{runtime.http.port}{path}"
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.json()


async def until_status(runtime: Runtime, status: int, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        code, body = await probe(runtime, "/readyz")
        if code == status:
            return body
        assert time.monotonic() < deadline, f"/readyz still {code}: {body}"
        await asyncio.sleep(0.25)


def gauge(runtime: Runtime, name: str, **labels: str) -> float:
    value = runtime.metrics.registry.get_sample_value(name, labels)
    assert value is not None, name
    return value


async def test_frozen_broker_makes_readiness_fail_with_the_cause(
    devstack: DevStack, clean_k8s: Any, topics: dict[str, str]
) -> None:
    await e2e.seed_region(clean_k8s)
    cfg = e2e.config(devstack, topics, CRS_READINESS_BOUND_S=str(BOUND_S))
    async with e2e.running(cfg) as runtime:
        await until_status(runtime, 200, 30)
        # Healthy and quiet past the bound, and the broker probed again after it (readiness
        # follows the probe): still ready.
        assert runtime.kafka_probe is not None
        await asyncio.sleep(BOUND_S + 1)
        probed = runtime.kafka_probe.probes
        deadline = time.monotonic() + 30
        while runtime.kafka_probe.probes < probed + 2:  # the first of them answered
            assert time.monotonic() < deadline, "the broker not probed after the bound"
            await asyncio.sleep(0.1)
        assert (await probe(runtime, "/readyz"))[0] == 200
        with frozen(devstack.run_dir / "kafka.pid"):
            started = time.monotonic()
            body = await until_status(runtime, 503, 20)
            took = time.monotonic() - started
            assert body["detail"].startswith("kafka unreachable for"), body
            assert took < BOUND_S + 6
            assert (await probe(runtime, "/healthz"))[0] == 200
            await asyncio.sleep(2.5)  # the health monitor's period
            assert gauge(runtime, "crs_ready") == 0
            assert gauge(runtime, "crs_dependency_up", dependency="kafka") == 0
        await until_status(runtime, 200, 30)
        await asyncio.sleep(2.5)
        assert gauge(runtime, "crs_ready") == 1
        assert gauge(runtime, "crs_dependency_up", dependency="kafka") == 1


async def test_frozen_api_server_makes_readiness_fail_within_the_bound(
    devstack: DevStack, clean_k8s: Any, topics: dict[str, str]
) -> None:
    await e2e.seed_region(clean_k8s)
    cfg = e2e.config(devstack, topics, CRS_READINESS_BOUND_S=str(BOUND_S))
    async with e2e.running(cfg) as runtime:
        await until_status(runtime, 200, 30)
        await asyncio.sleep(BOUND_S + 1)  # quiet kinds stay ready: renewals are activity
        assert (await probe(runtime, "/readyz"))[0] == 200
        assert gauge(runtime, "crs_dependency_up", dependency="kubernetes") == 1
        activity = gauge(runtime, "crs_watch_last_activity_timestamp_seconds", kind="reservations")
        assert time.time() - activity < BOUND_S
        with frozen(devstack.run_dir / "kube-apiserver.pid"):
            started = time.monotonic()
            body = await until_status(runtime, 503, 20)
            assert time.monotonic() - started < BOUND_S + 4
            assert "watch silent for" in body["detail"] or "watch down for" in body["detail"]
            assert (await probe(runtime, "/healthz"))[0] == 200
            await asyncio.sleep(2.5)
            assert gauge(runtime, "crs_dependency_up", dependency="kubernetes") == 0
            assert gauge(runtime, "crs_ready") == 0
        await until_status(runtime, 200, 60)


async def test_a_topic_created_after_start_is_consumed_within_the_refresh_period(
    devstack: DevStack, clean_k8s: Any, topics: dict[str, str], new_topic: Any
) -> None:
    """The input topic does not exist at start (no auto-creation by the consumer's own
    metadata requests matters here: the topic is created explicitly afterwards)."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import TopicAlreadyExistsError

    await e2e.seed_region(clean_k8s)
    late = f"late-{topics['input']}"
    cfg = e2e.config(devstack, {**topics, "input": late}, CRS_METADATA_MAX_AGE_S="3")
    assert cfg.kafka_consumer_args()["metadata_max_age_ms"] == 3000
    admin = AIOKafkaAdminClient(bootstrap_servers=devstack.kafka_bootstrap)
    await admin.start()
    try:
        async with e2e.running(cfg) as runtime:
            await asyncio.sleep(2)
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics([NewTopic(late, 3, 1)])
            vm, decision, request = e2e.outcome(None, ["hv-3"], project="p3")
            await e2e.publish(
                devstack.kafka_bootstrap, late, [e2e.good_record(vm, decision, request)]
            )
            published = time.monotonic()
            assert runtime.stream is not None
            while runtime.stream.processed < 1:
                assert time.monotonic() - published < 15, "the new topic was not consumed"
                await asyncio.sleep(0.2)
    finally:
        with contextlib.suppress(Exception):
            await admin.delete_topics([late])
        await admin.close()


def test_default_metadata_refresh_is_within_30_seconds() -> None:
    assert Config.load(env={}).kafka_consumer_args()["metadata_max_age_ms"] <= 30_000
