"""A real Prometheus (Debian's, installed by devstack/prometheus) scrapes the running
service on the dev stack with the shipped rules loaded; `promtool check metrics` finds
nothing to complain about in the exposition.

A poison record makes CrsDeadLetters go pending; freezing the API server makes
CrsNotReady go pending; every query of the shipped dashboard parses and returns data.
Prometheus listens on 127.0.0.1:$CRS_DEVSTACK_PROMETHEUS_PORT (default: the Kafka port
minus 2, so parallel dev stacks do not collide) with 1 s scrape and rule intervals.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

from tests import e2e
from tests.conftest import DevStack
from tests.prometheus import MONITORING, prometheus_bin_dir

pytestmark = [pytest.mark.integration, pytest.mark.promtool]

JOB = "crs-consumer"


def prometheus_port() -> int:
    kafka = int(os.environ.get("CRS_DEVSTACK_KAFKA_PORT", "19092"))
    return int(os.environ.get("CRS_DEVSTACK_PROMETHEUS_PORT", str(kafka - 2)))


@pytest_asyncio.fixture
async def topics(new_topic: Any) -> dict[str, str]:
    return {
        "input": await new_topic("in", 1),
        "output": await new_topic("out", 1),
        "dlq": await new_topic("dlq", 1),
    }


@contextlib.contextmanager
def prometheus(tmp_path: Path, target_port: int) -> Iterator[str]:
    port = prometheus_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(MONITORING / "rules.yaml")],
        "scrape_configs": [
            {"job_name": JOB, "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}
        ],
    }
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            str(prometheus_bin_dir() / "prometheus"),
            f"--config.file={config_file}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


async def api(session: aiohttp.ClientSession, base: str, path: str, **params: str) -> Any:
    async with session.get(f"{base}{path}", params=params) as resp:
        body = await resp.json()
    assert body["status"] == "success", body
    return body["data"]


async def until(what: str, timeout_s: float, check: Any) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(aiohttp.ClientError):
            result = await check()
            if result:
                return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.5)


def dashboard_queries() -> list[str]:
    dash = json.loads((MONITORING / "dashboard.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


async def test_alerts_go_pending_and_dashboard_queries_return_data(
    devstack: DevStack, clean_k8s: Any, topics: dict[str, str], tmp_path: Path
) -> None:
    await e2e.seed_region(clean_k8s)
    cfg = e2e.config(devstack, topics, CRS_READINESS_BOUND_S="4")
    vm1, d1, r1 = e2e.outcome("hv-1", ["hv-1", "hv-2"])  # slot_used: a slot write
    vm2, d2, r2 = e2e.outcome(None, ["hv-3"], project="p3")  # no_host_found
    async with e2e.running(cfg) as runtime:
        assert runtime.http is not None
        assert runtime.http.port
        with prometheus(tmp_path, runtime.http.port) as base:
            async with aiohttp.ClientSession() as session:

                async def target_up() -> bool:
                    data = await api(session, base, "/api/v1/query", query=f'up{{job="{JOB}"}}')
                    return bool(data["result"]) and data["result"][0]["value"][1] == "1"

                await until("Prometheus to scrape the service", 30, target_up)
                url = f"http://127.0.0.1:{runtime.http.port}/metrics"
                async with session.get(url) as resp:
                    exposition = await resp.text()
                lint = await asyncio.create_subprocess_exec(
                    str(prometheus_bin_dir() / "promtool"),
                    "check",
                    "metrics",
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
                out, _ = await lint.communicate(exposition.encode())
                assert lint.returncode == 0, out.decode()
                await e2e.publish(
                    devstack.kafka_bootstrap,
                    topics["input"],
                    [
                        e2e.good_record(vm1, d1, r1),
                        e2e.good_record(vm2, d2, r2),
                        (b"poison", b"\x00not json", []),
                    ],
                )

                async def alert(name: str) -> dict[str, Any] | None:
                    data = await api(session, base, "/api/v1/alerts")
                    found = [a for a in data["alerts"] if a["labels"]["alertname"] == name]
                    return found[0] if found else None

                dead = await until("CrsDeadLetters", 30, lambda: alert("CrsDeadLetters"))
                assert dead["state"] == "pending"
                assert dead["labels"]["code"] == "not_json"
                assert await alert("CrsNotReady") is None

                # Every dashboard query, as Grafana would send it for one job.
                for expr in dashboard_queries():
                    query = expr.replace("$job", JOB).replace("$__rate_interval", "1m")

                    async def has_data(q: str = query) -> bool:
                        data = await api(session, base, "/api/v1/query", query=q)
                        return bool(data["result"])

                    await until(f"data for {query}", 20, has_data)

                pid = int((devstack.run_dir / "kube-apiserver.pid").read_text())
                os.kill(pid, signal.SIGSTOP)
                try:
                    not_ready = await until("CrsNotReady", 30, lambda: alert("CrsNotReady"))
                finally:
                    os.kill(pid, signal.SIGCONT)
                assert not_ready["state"] == "pending"
                assert not_ready["annotations"]["runbook_url"] == "docs/runbooks.md#crsnotready"
