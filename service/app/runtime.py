"""Wiring and lifecycle: build the parts from a Config, run them, stop them cleanly.

Start order is the dependency order (metrics → Kubernetes → recorder → HTTP → Kafka) and
shutdown is its reverse, bounded by ``CRS_SHUTDOWN_TIMEOUT_S``: the consume loop finishes
the batch in hand and commits it, the consumer leaves the group (so its partitions move
at once instead of after a session timeout), then the rest closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time
from typing import Any

import structlog

from service.app.config import Config
from service.app.http import HealthChecks, HttpServer, LoopWatchdog
from service.app.kafka_access import ensure_access as ensure_kafka_access
from service.crs import Recorder
from service.k8s import K8sMetrics, KubeClient, ListClusterState
from service.k8s.cache import WatchClusterState
from service.stream.consumer import StreamService, StreamSettings
from service.stream.metrics import StreamMetrics
from service.stream.processor import Processor

__all__ = ["Runtime", "run_service"]

log = structlog.get_logger(__name__)

# A consume loop that has not turned for this long is wedged (per-poll work is bounded
# by the partition budget plus one Kubernetes timeout).
_LOOP_STALE_S = 180.0


class Runtime:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = StreamMetrics()
        self.k8s_metrics = K8sMetrics(self.metrics.registry)
        self.client: KubeClient | None = None
        self.state: ListClusterState | WatchClusterState | None = None
        self.stream: StreamService | None = None
        self.http: HttpServer | None = None
        self.watchdog = LoopWatchdog()
        self._tasks: list[asyncio.Task[Any]] = []
        self._k8s_ok: tuple[float, bool, str] = (0.0, False, "not checked yet")

    async def start(self) -> None:
        c = self.config
        await ensure_kafka_access(c)  # a missing ACL fails the start, named, not the loop
        self.client = await KubeClient.create(
            c.kubeconfig, request_timeout_s=c.k8s_timeout_s, metrics=self.k8s_metrics
        )
        self.state = await self._make_state()
        recorder = Recorder(
            self.state,
            placement_counter=self.metrics.placement,
            no_host_found_counter=self.metrics.no_host_found,
        )
        processor = Processor(
            recorder,
            self.metrics,
            output_topic=c.output_topic,
            dlq_topic=c.dlq_topic,
            max_event_bytes=c.max_event_bytes,
            max_attempts=c.max_attempts,
        )
        settings = StreamSettings(
            input_topic=c.input_topic,
            group_id=c.group_id,
            exactly_once=c.exactly_once,
            transactional_id=c.effective_transactional_id(socket.gethostname()),
            max_batch=c.max_batch,
            retry_backoff_s=c.retry_backoff_s,
            retry_backoff_max_s=c.retry_backoff_max_s,
            client_args=c.kafka_client_args(),
        )
        self.stream = StreamService(settings, processor, self.metrics)
        self.http = HttpServer(
            self.metrics.registry,
            HealthChecks(alive=self._alive, ready=self._ready),
            c.http_host,
            c.http_port,
        )
        await self.http.start()
        self._tasks.append(asyncio.create_task(self.watchdog.run(), name="watchdog"))
        await self.stream.start()
        log.info("service_started", http_port=self.http.port, config=c.redacted())

    async def _make_state(self) -> ListClusterState | WatchClusterState:
        assert self.client is not None
        if self.config.k8s_read_mode == "watch":
            state = WatchClusterState(self.client)
            await state.start()
            return state
        return ListClusterState(self.client)

    async def run(self) -> None:
        assert self.stream is not None
        await self.stream.run()

    def request_stop(self) -> None:
        if self.stream is not None:
            self.stream.request_stop()

    async def stop(self) -> None:
        if self.stream is not None:
            await self.stream.close()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if isinstance(self.state, WatchClusterState):
            await self.state.stop()
        if self.client is not None:
            await self.client.close()
        if self.http is not None:
            await self.http.stop()

    # ------------------------------------------------------------------ probes

    def _alive(self) -> tuple[bool, str]:
        stalled = self.watchdog.stalled_for()
        if stalled > 10:
            return False, f"event loop stalled for {stalled:.1f}s"
        if self.stream is not None and self.stream.started:
            idle = time.monotonic() - self.stream.last_loop
            if idle > _LOOP_STALE_S:
                return False, f"consume loop has not turned for {idle:.0f}s"
        return True, "ok"

    async def _ready(self) -> tuple[bool, str]:
        if self.stream is None or not self.stream.started:
            return False, "consumer not started"
        if isinstance(self.state, WatchClusterState):
            ok, detail = self.state.ready()
            if not ok:
                return False, detail
        else:
            ok, detail = await self._k8s_reachable()
            if not ok:
                return False, detail
        parts = len(self.stream.assignment)
        return True, f"{parts} partitions assigned" if parts else "waiting for assignment"

    async def _k8s_reachable(self) -> tuple[bool, str]:
        checked, ok, detail = self._k8s_ok
        if time.monotonic() - checked < 5:
            return ok, detail
        assert self.client is not None
        try:
            await self.client.get_knowledge()
            ok, detail = True, "ok"
        except Exception as exc:  # any failure means not ready; the detail says which
            ok, detail = False, f"kubernetes unreachable: {type(exc).__name__}: {exc}"
        self._k8s_ok = (time.monotonic(), ok, detail)
        return ok, detail


async def run_service(config: Config) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code."""
    runtime = Runtime(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await runtime.start()
    except Exception as exc:
        log.error("startup_failed", error=f"{type(exc).__name__}: {exc}")
        await asyncio.wait_for(runtime.stop(), config.shutdown_timeout_s)
        return 1
    run_task = asyncio.create_task(runtime.run(), name="consume-loop")
    stop_task = asyncio.create_task(stop.wait(), name="stop-signal")
    done, _ = await asyncio.wait({run_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if run_task in done and run_task.exception() is not None:
        log.error("consume_loop_failed", error=repr(run_task.exception()))
        code = 1
    log.info("shutting_down")
    runtime.request_stop()
    deadline = config.shutdown_timeout_s
    started = time.monotonic()
    # Most of the budget goes to finishing the batch in hand (the loop stops taking new
    # records at once and commits what is done); the rest is kept for closing the
    # clients, which leaves the group and aborts any transaction still open.
    finish_budget = deadline * 0.7
    try:
        await asyncio.wait_for(asyncio.shield(run_task), finish_budget)
    except TimeoutError:
        log.warning("shutdown_abandoning_in_flight_work")
        run_task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(run_task, 2.0)
    except Exception:  # already logged above
        pass
    stop_task.cancel()
    remaining = max(1.0, deadline - (time.monotonic() - started))
    try:
        await asyncio.wait_for(runtime.stop(), remaining)
    except TimeoutError:
        log.warning("shutdown_timed_out")
    log.info("stopped", exit_code=code)
    return code
