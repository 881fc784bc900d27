"""Start-up of the real process against the real servers: a stop signal while it is still
starting, and a setting that no retry fixes.

Start-up waits on Kafka (the ACL pre-flight, the consumer's bootstrap), each request up to
its client timeout; a broker that accepts connections and never answers (a half-open
network, a broker stuck in recovery) holds it there for tens of seconds. Kubernetes sends
SIGTERM and SIGKILLs after terminationGracePeriodSeconds: the signal must end the start-up
at once, not after it.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from pathlib import Path

import aiohttp
import pytest

from tests import e2e
from tests.conftest import DevStack

pytestmark = pytest.mark.integration


async def test_sigterm_during_a_start_up_stuck_on_kafka_ends_it_at_once(
    devstack: DevStack, tmp_path: Path
) -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepts (the kernel does), never answers
    port = silent.getsockname()[1]
    topics = {"input": "never-in", "output": "never-out", "dlq": "never-dlq"}
    http_port = e2e.free_port()
    cfg = e2e.config(
        devstack,
        topics,
        KAFKA_BOOTSTRAP_SERVERS=f"127.0.0.1:{port}",
        CRS_HTTP_PORT=str(http_port),
    )
    log = tmp_path / "service.log"
    held: list[socket.socket] = []
    try:
        with e2e.spawned(cfg, str(log)) as proc:
            # The probes answer once the signal handlers are in place and before Kafka is
            # first asked (a fixed sleep could signal an interpreter still importing).
            deadline = time.monotonic() + 60
            while (await e2e.http_get(http_port, "/healthz"))[0] != 200:
                assert proc.poll() is None, log.read_text()[-2000:]
                assert time.monotonic() < deadline, log.read_text()[-2000:]
                await asyncio.sleep(0.1)
            # Well into the start-up: its connection to the silent broker is waiting to be
            # accepted (and, accepted, is never answered).
            silent.setblocking(False)
            loop = asyncio.get_running_loop()
            asking, _ = await asyncio.wait_for(loop.sock_accept(silent), 30)
            held.append(asking)
            assert proc.poll() is None, log.read_text()[-2000:]
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 30)
            took = time.monotonic() - sent
    finally:
        for conn in held:
            conn.close()
        silent.close()
    text = log.read_text()
    assert code == 0, text[-2000:]
    assert took < 3.0, f"exit {took:.1f}s after SIGTERM\n{text[-2000:]}"
    assert "startup_abandoned" in text


async def test_an_http_address_not_on_this_host_exits_at_once_as_configuration(
    devstack: DevStack, tmp_path: Path
) -> None:
    # Start-up retries OSErrors (a server briefly away): this one no retry fixes.
    topics = {"input": "never-in", "output": "never-out", "dlq": "never-dlq"}
    cfg = e2e.config(devstack, topics, CRS_HTTP_HOST="192.0.2.1")
    log = tmp_path / "service.log"
    with e2e.spawned(cfg, str(log)) as proc:
        code = await asyncio.to_thread(proc.wait, 60)
    text = log.read_text()
    assert code == 2, text[-2000:]  # a configuration error, as documented
    assert "startup_failed" in text
    assert "CRS_HTTP_HOST='192.0.2.1'" in text
    assert "startup_retrying" not in text


async def test_probes_answer_while_the_start_up_is_retried(
    devstack: DevStack, tmp_path: Path
) -> None:
    # Kafka refusing connections at start-up is retried with back-off. Meanwhile /healthz
    # must answer 200 (the kubelet restarts a pod whose liveness probe is refused) and
    # /readyz 503 saying why.
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    kafka_port = closed.getsockname()[1]
    closed.close()  # nothing listens there: connection refused
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    http_port = probe.getsockname()[1]
    probe.close()
    topics = {"input": "never-in", "output": "never-out", "dlq": "never-dlq"}
    cfg = e2e.config(
        devstack,
        topics,
        KAFKA_BOOTSTRAP_SERVERS=f"127.0.0.1:{kafka_port}",
        CRS_HTTP_PORT=str(http_port),
        CRS_RETRY_BACKOFF_S="3",
        CRS_RETRY_BACKOFF_MAX_S="5",
    )
    log = tmp_path / "service.log"
    base = f"http://127.0.0.1:{http_port}"
    alive: list[int | None] = []
    ready: list[tuple[int, str]] = []
    with e2e.spawned(cfg, str(log)) as proc:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    async with http.get(f"{base}/healthz") as resp:
                        alive.append(resp.status)
                    async with http.get(f"{base}/readyz") as resp:
                        ready.append((resp.status, (await resp.json())["detail"]))
                except aiohttp.ClientConnectionError:
                    alive.append(None)
                await asyncio.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 30)
    text = log.read_text()
    assert code == 0, text[-2000:]
    assert text.count("startup_retrying") >= 2, text[-2000:]
    assert len(alive) > 30
    # Up once the interpreter has started (a few seconds at most on a busy machine), then
    # answered on every probe through the retries.
    first = alive.index(200)
    assert first < 50, alive  # within 10 s of polling
    assert alive[first:] == [200] * len(alive[first:]), alive
    assert all(status == 503 for status, _ in ready)
    assert any("KafkaConnectionError" in detail for _, detail in ready), ready[-3:]
