"""Wiring and lifecycle: build the parts from a Config, run them, stop them cleanly.

Start order: the HTTP server and health monitor first (probes answer during the rest),
then the dependency order (Kafka access → Kubernetes → recorder → Kafka), and shutdown is
its reverse, bounded by ``CRS_SHUTDOWN_TIMEOUT_S``: the consume loop finishes
the batch in hand and commits it, the consumer leaves the group (so its partitions move
at once instead of after a session timeout), then the rest closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import hashlib
import os
import random
import signal
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypedDict

import aiohttp
import structlog

from service import backoff
from service.app.audit import watch_invariants
from service.app.config import Config, ConfigError
from service.app.http import HealthChecks, HttpServer, LoopWatchdog
from service.app.kafka_access import KafkaAccessDenied
from service.app.kafka_access import ensure_access as ensure_kafka_access
from service.app.rotation import Reloaded, SecretFiles, SecretMetrics, new_secret_metrics
from service.crs import Recorder
from service.crs.invariants import KINDS
from service.crs.ports import ApiError
from service.k8s import K8sMetrics, KubeClient, ListClusterState
from service.k8s.cache import WatchClusterState
from service.stream import errors as kafka_error_kinds
from service.stream.codec import clip
from service.stream.engine import KafkaClientEnded, StreamService, StreamSettings
from service.stream.kafka_probe import KafkaProbe
from service.stream.metrics import StreamMetrics
from service.stream.processor import Processor

__all__ = ["Runtime", "recorder_options", "run_service", "watch_options"]

log = structlog.get_logger(__name__)

# How often the frozen heap is unfrozen, collected and frozen again (see _heap_keeper).
HEAP_REFREEZE_S = 600.0
# Liveness during a rebalance (see Runtime._waiting_out_kafka): aiokafka's default
# request timeout, which the service does not change; and how much of the loop's idle
# time may be its own work before the getmany() it waits in (a fetch linger, a turn).
_AIOKAFKA_REQUEST_TIMEOUT_S = 40.0
_GROUP_WAIT_SLACK_S = 5.0


# ---------------------------------------------------------------------- config -> parts
# Each part's options from the Config, as plain functions. The option dicts are typed,
# so mypy checks them against the constructors' signatures at the ``**`` call.


class RecorderOptions(TypedDict):
    conflict_timeout_s: float
    max_conflict_retries: int | None
    backoff_s: float
    backoff_max_s: float


class ClientOptions(TypedDict):
    request_timeout_s: float
    max_writes: int


class WatchOptions(TypedDict):
    page_size: int
    watch_timeout_s: float
    idle_timeout_s: float
    silence_bound_s: float
    stale_after_s: float
    backoff_base_s: float
    backoff_max_s: float
    invariant_grace_s: float


def recorder_options(c: Config) -> RecorderOptions:
    """Keyword arguments of :class:`Recorder` (after the state and counters)."""
    return {
        "conflict_timeout_s": c.conflict_timeout_s,
        "max_conflict_retries": c.conflict_retries,
        "backoff_s": c.conflict_backoff_s,
        "backoff_max_s": c.conflict_backoff_max_s,
    }


def client_options(c: Config) -> ClientOptions:
    """Keyword arguments of :meth:`KubeClient.create` (after the kubeconfig)."""
    return {"request_timeout_s": c.k8s_timeout_s, "max_writes": c.k8s_max_writes}


def watch_options(c: Config) -> WatchOptions:
    """Keyword arguments of :class:`WatchClusterState` (after the client)."""
    bound = c.readiness_bound_s
    return {
        "page_size": c.k8s_page_size,
        # Renewals inside the readiness bound: a renewal is a sign of life, so a
        # healthy watch on a quiet kind never looks silent.
        "watch_timeout_s": c.effective_watch_timeout_s,
        "idle_timeout_s": bound,
        "silence_bound_s": bound,
        "stale_after_s": c.watch_stale_after_s,
        "backoff_base_s": c.watch_backoff_s,
        "backoff_max_s": c.watch_backoff_max_s,
        "invariant_grace_s": c.invariant_grace_s,
    }


def kube_settings(c: Config) -> tuple[object, ...]:
    """What the Kubernetes client and the cluster state are built from: parts kept
    across a restart of the Kafka clients are reused only while it is unchanged (the
    configuration is read again for each attempt). The kubeconfig's content is part of
    it: a client certificate or token written into it and rotated needs a new client.
    Files it only names (client-certificate, tokenFile) are not compared; in-cluster,
    the client re-reads the rotated service-account token itself. Unreadable: a value
    that never compares equal, so the next start builds afresh and says why."""
    content: object = None
    if c.kubeconfig is not None:
        digest = hashlib.sha256()
        try:
            # KUBECONFIG may list several files, as for kubectl (the client merges them).
            for path in filter(None, c.kubeconfig.split(os.pathsep)):
                with open(path, "rb") as f:
                    digest.update(hashlib.sha256(f.read()).digest())
            content = digest.hexdigest()
        except OSError:
            content = object()
    return (
        c.kubeconfig,
        content,
        client_options(c),
        c.k8s_read_mode,
        watch_options(c),
    )


@dataclasses.dataclass(frozen=True)
class _Front:
    """What one attempt hands the next (see :meth:`Runtime.handover`): the HTTP server,
    the loop watchdog (with its task) and the metrics it serves, always, so probes
    answer throughout and counters go on counting; and the Kubernetes client with the
    cluster state (the watch caches) when both were started, so that a restart of
    the Kafka side does not read the whole cluster again."""

    http: HttpServer
    watchdog: LoopWatchdog
    watchdog_task: asyncio.Task[None]
    metrics: StreamMetrics
    k8s_metrics: K8sMetrics
    secrets: SecretMetrics
    kube: tuple[KubeClient, ListClusterState | WatchClusterState, tuple[object, ...]] | None


class Runtime:
    def __init__(self, config: Config, *, front: _Front | None = None) -> None:
        """``front``: what a previous attempt handed over (see :meth:`handover`),
        taken over (and closed by this one's :meth:`stop`)."""
        self.config = config
        self.client: KubeClient | None = None
        self.state: ListClusterState | WatchClusterState | None = None
        # What the client and state were built from (see kube_settings).
        self._kube_settings: tuple[object, ...] | None = None
        self.stream: StreamService | None = None
        self.http: HttpServer | None = None
        self.watchdog = LoopWatchdog()
        self._watchdog_task: asyncio.Task[None] | None = None
        self.start_error: str | None = None  # the last failed attempt's, for /readyz
        if front is None:
            self.metrics = StreamMetrics()
            self.k8s_metrics = K8sMetrics(self.metrics.registry)
            if config.k8s_read_mode == "watch":
                # Every kind at 0 from the first scrape on (the monitor sets them later).
                for kind in KINDS:
                    self.metrics.invariant_violations.labels(kind)
            self.secrets = new_secret_metrics(self.metrics.registry)
        else:
            self.metrics, self.k8s_metrics = front.metrics, front.k8s_metrics
            self.secrets = front.secrets
            self.http, self.watchdog, self._watchdog_task = (
                front.http,
                front.watchdog,
                front.watchdog_task,
            )
            if front.kube is not None:
                self.client, self.state, self._kube_settings = front.kube
            self.http.serve(
                self.metrics.registry, HealthChecks(alive=self._alive, ready=self._ready)
            )
        self._tasks: list[asyncio.Task[Any]] = []
        self._k8s_ok: tuple[float, bool, str] = (0.0, False, "not checked yet")
        self.kafka_probe: KafkaProbe | None = None

    async def start(self) -> None:
        c = self.config
        if self.http is None:
            # First, so the probes answer during the rest (a watch cache's first sync or a
            # Kafka that is still away can take long): alive, not ready.
            self.http = HttpServer(
                self.metrics.registry,
                HealthChecks(alive=self._alive, ready=self._ready),
                c.http_host,
                c.http_port,
            )
            await self.http.start()
            self._watchdog_task = asyncio.create_task(self.watchdog.run(), name="watchdog")
        # From the start of each attempt: the metrics outlive the attempts (see _Front),
        # and crs_ready and the watch caches' activity must keep following /readyz while
        # an attempt waits (for an ACL, a broker), or the alerts on them see a frozen past.
        self._tasks.append(asyncio.create_task(self._health_monitor(), name="health-monitor"))
        await ensure_kafka_access(c)  # a missing ACL fails the start, named, not the loop
        state = await self._start_kube()
        if isinstance(state, WatchClusterState):
            self._tasks.append(
                asyncio.create_task(
                    watch_invariants(state.invariants, self.metrics.invariant_violations),
                    name="invariant-monitor",
                )
            )
        recorder = Recorder(
            state,
            placement_counter=self.metrics.placement,
            no_host_found_counter=self.metrics.no_host_found,
            **recorder_options(c),
        )
        processor = Processor(
            recorder,
            self.metrics,
            output_topic=c.output_topic,
            dlq_topic=c.dlq_topic,
            max_event_bytes=c.max_event_bytes,
            max_attempts=c.max_attempts,
        )
        self.stream = StreamService(StreamSettings.from_config(c), processor, self.metrics)
        bound = c.readiness_bound_s
        # Probe often enough that a healthy cluster never looks older than the bound.
        self.kafka_probe = KafkaProbe(
            c.kafka_client_args(), interval_s=min(3.0, bound / 4), timeout_s=min(5.0, bound / 2)
        )
        self.kafka_probe.start()
        self._tasks.append(asyncio.create_task(self._heap_keeper(), name="heap-keeper"))
        await self.stream.start()
        self.start_error = None
        log.info("service_started", http_port=self.http.port, config=c.redacted())

    async def _start_kube(self) -> ListClusterState | WatchClusterState:
        """The Kubernetes client and cluster state: the ones handed over when they were
        built from the same settings, else new ones (the handed-over ones closed)."""
        settings = kube_settings(self.config)
        if self.client is not None and self.state is not None:
            if self._kube_settings == settings:
                log.info("kubernetes_side_kept")
                return self.state
            log.info("kubernetes_side_rebuilt", reason="kubernetes settings changed")
        # Each close failure is logged; it is no reason to fail (or end) this attempt.
        with contextlib.suppress(Exception):
            await self._stop_kube()
        self.client = await KubeClient.create(
            self.config.kubeconfig, metrics=self.k8s_metrics, **client_options(self.config)
        )
        self._kube_settings = settings
        self.state = await self._make_state()
        return self.state

    async def _stop_kube(self) -> None:
        client, state = self.client, self.state
        self.client = self.state = self._kube_settings = None
        async with contextlib.AsyncExitStack() as stack:
            if client is not None:
                stack.push_async_callback(_close, "kubernetes_client", client.close)
            if isinstance(state, WatchClusterState):
                stack.push_async_callback(_close, "watch_cache", state.stop)

    async def _make_state(self) -> ListClusterState | WatchClusterState:
        assert self.client is not None
        if self.config.k8s_read_mode == "watch":
            state = WatchClusterState(self.client, **watch_options(self.config))
            await state.start()
            return state
        return ListClusterState(self.client, page_size=self.config.k8s_page_size)

    async def run(self) -> None:
        assert self.stream is not None
        await self.stream.run()

    def request_stop(self) -> None:
        if self.stream is not None:
            self.stream.request_stop()

    def handover(self, error: str, config: Config | None = None) -> Runtime:
        """The next start-up attempt after this one failed with ``error`` (and was
        stopped with ``keep_front``): it takes over the HTTP server, the watchdog, the
        metrics and, if this one kept them running, the Kubernetes client and cluster
        state (``config``: the configuration read again, else this one's)."""
        front = None
        if self.http is not None and self._watchdog_task is not None:
            kube = None
            if self.client is not None and self.state is not None:
                assert self._kube_settings is not None
                kube = (self.client, self.state, self._kube_settings)
            front = _Front(
                self.http,
                self.watchdog,
                self._watchdog_task,
                self.metrics,
                self.k8s_metrics,
                self.secrets,
                kube,
            )
        successor = Runtime(config or self.config, front=front)
        successor.start_error = error
        return successor

    async def stop(self, *, keep_front: bool = False) -> None:
        """Close whatever was started, the consumer first, the HTTP server last
        (``keep_front``: not the HTTP server and the watchdog, nor the Kubernetes client
        and a cluster state that started, see :meth:`handover`; a client without a
        cluster state is closed).

        Every part gets its close call even when an earlier one raises (an exit stack);
        each failure is logged, and one of them is raised once all parts were closed.
        """
        if keep_front:
            # Not ready until the next attempt's health monitor says otherwise: the
            # metrics go on to it, and nothing updates them in between.
            self.metrics.ready.set(0)
        async with contextlib.AsyncExitStack() as stack:
            # Pushed in reverse: the stack unwinds last in, first out.
            if self.http is not None and not keep_front:
                stack.push_async_callback(_close, "http", self.http.stop)
            if self._watchdog_task is not None and not keep_front:
                task = self._watchdog_task
                stack.push_async_callback(_close, "watchdog", functools.partial(_cancel, task))
            if not keep_front or self.state is None:
                stack.push_async_callback(self._stop_kube)
            for task in self._tasks:
                stack.push_async_callback(_close, task.get_name(), functools.partial(_cancel, task))
            if self.kafka_probe is not None:
                stack.push_async_callback(_close, "kafka_probe", self.kafka_probe.stop)
            if self.stream is not None:
                stack.push_async_callback(_close, "stream", self.stream.close)

    # ------------------------------------------------------------------ probes

    def _alive(self) -> tuple[bool, str]:
        stalled = self.watchdog.stalled_for()
        if stalled > 10:
            return False, f"event loop stalled for {stalled:.1f}s"
        if self.stream is not None and self.stream.started:
            idle = time.monotonic() - self.stream.last_loop
            # Per-poll work is bounded by the partition budget plus one Kubernetes
            # timeout: a loop idle for longer than the bound is wedged.
            if idle > self.config.liveness_bound_s:
                if self._waiting_out_kafka(idle):
                    return True, f"waiting for the Kafka group for {idle:.0f}s (kafka away)"
                return False, f"consume loop has not turned for {idle:.0f}s"
        return True, "ok"

    def _waiting_out_kafka(self, idle: float) -> bool:
        """The loop is not wedged but waits in aiokafka's getmany() for a rebalance's
        assignment, which it does without limit once the rebalance has begun: through a
        whole broker outage. Outside a rebalance the loop keeps turning in an outage (its
        back-off); a restart would help neither. Exempt while (nearly) all the idle time
        is that wait and a Kafka probe failed lately: within a session timeout plus
        aiokafka's request timeout (40 s) after the broker answers again the group has
        settled or the member has rejoined."""
        probe = self.kafka_probe
        if probe is None or self.stream is None:
            return False
        waiting = self.stream.fetching_for()
        grace = self.config.session_timeout_ms / 1000 + _AIOKAFKA_REQUEST_TIMEOUT_S
        return waiting > 0 and idle - waiting < _GROUP_WAIT_SLACK_S and probe.failed_within(grace)

    async def _ready(self) -> tuple[bool, str]:
        if self.stream is None or not self.stream.started:
            if self.start_error is not None:
                return False, f"starting; the last attempt failed: {self.start_error}"
            return False, "consumer not started"
        ok, detail = self._kafka_ready()
        if not ok:
            return False, detail
        if isinstance(self.state, WatchClusterState):
            ok, detail = self.state.ready()
            if not ok:
                return False, detail
        else:
            ok, detail = await self._k8s_reachable()
            if not ok:
                return False, detail
        stalled = self.stream.stalled()
        if stalled:
            tp, why = next(iter(stalled.items()))
            where = f"{tp.topic}[{tp.partition}]"
            return False, f"{len(stalled)} partition(s) stalled, e.g. {where}: {why}"
        if self.stream.fetch_error is not None:
            return False, f"fetching from Kafka fails: {self.stream.fetch_error}"
        parts = len(self.stream.assignment)
        return True, f"{parts} partitions assigned" if parts else "waiting for assignment"

    async def _k8s_reachable(self) -> tuple[bool, str]:
        checked, ok, detail = self._k8s_ok
        if time.monotonic() - checked < 5:
            return ok, detail
        if self.client is None:
            return False, "kubernetes client not started"
        try:
            await self.client.get_knowledge()
            ok, detail = True, "ok"
        except Exception as exc:  # any failure means not ready; the detail says which
            ok, detail = False, f"kubernetes unreachable: {type(exc).__name__}: {exc}"
        self._k8s_ok = (time.monotonic(), ok, detail)
        return ok, detail

    # ------------------------------------------------------------------ operability

    def _kafka_ready(self) -> tuple[bool, str]:
        probe = self.kafka_probe
        if probe is None:
            return False, "kafka probe not started"
        down = probe.unreachable_for()
        if down > self.config.readiness_bound_s:
            why = probe.last_error or "metadata request pending"
            return False, f"kafka unreachable for {down:.0f}s ({why})"
        return True, "ok"

    async def _heap_keeper(self, interval_s: float = HEAP_REFREEZE_S) -> None:
        """Keep the watch cache out of the cyclic garbage collector's full collections.

        The cache is ~100,000 tracked objects that live as long as the process; every full
        collection walked them all (measured: 55-60 ms of CPU and of event-loop stall each,
        several per second under load, and the main cause of the CPU-per-event figure
        swinging between runs). Once the cache has synced they are frozen (gc.freeze: the
        collector ignores them); periodically everything is unfrozen, collected once and
        frozen again, so cyclic garbage among frozen objects is still freed.
        """
        if isinstance(self.state, WatchClusterState):
            await self.state.wait_synced()
        while True:
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            log.debug("heap_frozen", objects=gc.get_freeze_count())
            await asyncio.sleep(interval_s)

    async def _health_monitor(self, interval_s: float = 2.0) -> None:
        """Mirror the probes into gauges, so alerts see what /readyz says."""
        m = self.metrics
        while True:
            with contextlib.suppress(Exception):  # a probe error must not end the monitor
                kafka_up = self.kafka_probe is not None and self.kafka_probe.reachable
                m.dependency_up.labels("kafka").set(1 if kafka_up else 0)
                if isinstance(self.state, WatchClusterState):
                    m.dependency_up.labels("kubernetes").set(1 if self.state.ready()[0] else 0)
                    now = time.time()
                    for informer in self.state.informers:
                        m.watch_last_activity.labels(informer.kind.plural).set(
                            now - informer.silent_for()
                        )
                else:
                    ok, _ = await self._k8s_reachable()
                    m.dependency_up.labels("kubernetes").set(1 if ok else 0)
                ready, _ = await self._ready()
                m.ready.set(1 if ready else 0)
            await asyncio.sleep(interval_s)


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _close(part: str, close: Callable[[], Awaitable[object]]) -> None:
    try:
        await close()
    except Exception as exc:
        log.error("close_failed", part=part, error=f"{type(exc).__name__}: {exc}"[:300])
        raise


async def run_service(
    config: Config,
    reload: Callable[[], Config] | None = None,
    *,
    secret_files: Mapping[str, str] | None = None,
) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code. ``reload`` reads the
    configuration again (its secret files may have been rotated) for each attempt after
    a failed start or an ended Kafka client. ``secret_files`` (variable -> path, see
    ``config.secret_files``): polled while running; new content that loads rebuilds the
    Kafka clients with it (see ``service.app.rotation``)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watcher = None
    if reload is not None and secret_files:
        watcher = SecretFiles(secret_files, reload, interval_s=config.secret_reload_interval_s)
        # Every load through the watcher, so it knows the content each one was read
        # from; this first one because the files may have changed since ``config``.
        reload = watcher.load
        config = _reloaded(reload) or config
    runtime = Runtime(config)
    if watcher is not None:
        watcher.metrics = runtime.secrets
    restarts = rotations = 0
    jitter = random.Random()
    while True:
        # Transient Kafka/Kubernetes errors are retried; a configuration error exits.
        try:
            running = await _start_with_retry(
                runtime, stop, reload, restarting=restarts > 0 or rotations > 0
            )
        except ConfigError:
            # A setting found wrong only at start-up (CRS_HTTP_HOST not on this host): the
            # exit code of any invalid setting, not that of a failed start.
            return 2
        if running is None:
            return 0 if stop.is_set() else 1
        began = time.monotonic()
        outcome = await _run(running, stop, watcher)
        if isinstance(outcome, int):
            return outcome
        if isinstance(outcome, Reloaded):
            # The work in hand is committed and the group left (see _run): the next
            # attempt starts at once, with clients built from the new files.
            rotations += 1
            log.info("kafka_clients_rebuilding", reason="secret files rotated", files=outcome.files)
            runtime = running.handover(
                "rebuilding the Kafka clients with rotated secret files", outcome.config
            )
            runtime.start_error = None  # nothing failed: /readyz says "consumer not started"
            continue
        # The Kafka client ended for good (see KafkaClientEnded) and its parts are
        # closed: start afresh in this process, as a failed start-up is, keeping the
        # HTTP server (/readyz says why), the metrics and the Kubernetes side (see
        # _Front), and backing off while it keeps ending at once
        # (the foreign group member that ends it is still there).
        quick = time.monotonic() - began < 2 * config.retry_backoff_max_s
        restarts = restarts + 1 if quick else 1
        delay = backoff.exponential(restarts, config.retry_backoff_s, config.retry_backoff_max_s)
        # Jittered: a cause on the broker's side (an ACL) ends every replica's client at
        # once, and their restarts would rebalance the group in lockstep.
        delay = backoff.equal_jitter(delay, jitter)
        log.warning("kafka_client_restarting", error=outcome, restarts=restarts, retry_in_s=delay)
        running.metrics.client_restarts.inc()
        runtime = running.handover(f"the Kafka client ended: {outcome}", _reloaded(reload))
        with contextlib.suppress(TimeoutError):  # a stop ends the wait (and the start)
            await asyncio.wait_for(stop.wait(), delay)


async def _run(
    runtime: Runtime, stop: asyncio.Event, watcher: SecretFiles | None = None
) -> int | str | Reloaded:
    """Run the started ``runtime`` until a stop signal, its end or a rotation of its
    secret files, then stop it; returns the exit code, why the Kafka client ended, or the
    rotated files' configuration (for these two the parts stopped, the front kept)."""
    config = runtime.config
    run_task = asyncio.create_task(runtime.run(), name="consume-loop")
    stop_task = asyncio.create_task(stop.wait(), name="stop-signal")
    waits: set[asyncio.Task[Any]] = {run_task, stop_task}
    rotation = None
    if watcher is not None:
        rotation = asyncio.create_task(watcher.next_change(), name="secret-files")
        waits.add(rotation)
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if rotation is not None and not rotation.done():
            await _cancel(rotation)
    if rotation in done and not done & {run_task, stop_task}:
        return await _rebuild(runtime, run_task, stop_task, rotation.result())
    code = 0
    if run_task in done and (failed := run_task.exception()) is not None:
        if not isinstance(failed, KafkaClientEnded):
            log.error("consume_loop_failed", error=repr(failed))
            code = 1
        elif not stop.is_set():
            stop_task.cancel()
            try:
                await asyncio.wait_for(runtime.stop(keep_front=True), config.shutdown_timeout_s)
            except TimeoutError:
                log.warning("restart_stop_timed_out", timeout_s=config.shutdown_timeout_s)
            except Exception:  # each part's failure is logged by stop()
                pass
            return clip(str(failed))
    log.info("shutting_down")
    started = time.monotonic()
    await _finish(runtime, run_task)
    stop_task.cancel()
    remaining = max(1.0, config.shutdown_timeout_s - (time.monotonic() - started))
    try:
        await asyncio.wait_for(runtime.stop(), remaining)
    except TimeoutError:
        log.warning("shutdown_timed_out")
    log.info("stopped", exit_code=code)
    return code


async def _finish(runtime: Runtime, run_task: asyncio.Task[None]) -> None:
    """Ask the consume loop to stop and wait for it, bounded: it stops taking records at
    once and commits what is done. Most of the shutdown budget goes to that; the rest is
    kept for closing the clients, which leaves the group (a transaction the budget cut
    short is aborted by the partition's next owner, or by the broker after its
    transaction timeout)."""
    runtime.request_stop()
    try:
        await asyncio.wait_for(asyncio.shield(run_task), runtime.config.shutdown_timeout_s * 0.7)
    except TimeoutError:
        log.warning("shutdown_abandoning_in_flight_work")
        run_task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(run_task, 2.0)
    except Exception:  # the caller looks at the task's outcome
        pass


async def _rebuild(
    runtime: Runtime,
    run_task: asyncio.Task[None],
    stop_task: asyncio.Task[bool],
    reloaded: Reloaded,
) -> int | Reloaded:
    """Take the running ``runtime``'s Kafka side down in order for a rebuild with the
    rotated files: the way a shutdown does (the work in hand processed and committed,
    the transactions ended, the group left: nothing lost, nothing written twice, the
    partitions resumed by the next clients from the committed offsets) but keeping the
    front (see _Front), as a restart after an ended Kafka client does."""
    config = runtime.config
    started = time.monotonic()
    await _finish(runtime, run_task)
    stop_task.cancel()
    failed = None if run_task.cancelled() else run_task.exception()
    if failed is not None and not isinstance(failed, KafkaClientEnded):
        # The loop failed while finishing: as when it fails while running, the process
        # ends (with every part closed) instead of building clients for it again.
        log.error("consume_loop_failed", error=repr(failed))
        with contextlib.suppress(Exception):
            await asyncio.wait_for(runtime.stop(), config.shutdown_timeout_s)
        return 1
    remaining = max(1.0, config.shutdown_timeout_s - (time.monotonic() - started))
    try:
        await asyncio.wait_for(runtime.stop(keep_front=True), remaining)
    except TimeoutError:
        log.warning("restart_stop_timed_out", timeout_s=config.shutdown_timeout_s)
    except Exception:  # each part's failure is logged by stop()
        pass
    return reloaded


def _transient_startup_error(exc: BaseException) -> bool:
    """Worth another start-up attempt: the broker or the API server is (briefly) away.

    A configuration error (bad settings, a missing or unreadable file, credentials or
    ACLs that the servers refuse) is not: the process exits and says why.
    """
    if kafka_error_kinds.is_configuration(exc):
        return False
    if kafka_error_kinds.classify(exc) is not kafka_error_kinds.Kind.OTHER:
        return True  # any other Kafka error
    if isinstance(exc, ApiError):
        return exc.retryable
    if isinstance(
        exc, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError
    ):
        return False
    if isinstance(exc, ssl.SSLCertVerificationError):
        return False  # the wrong CA: configuration
    return isinstance(exc, OSError | TimeoutError | aiohttp.ClientError)


def _reloaded(reload: Callable[[], Config] | None) -> Config | None:
    """The configuration read again, or None (keep the last one) when that fails: a
    secret file being replaced may be missing for a moment; the next attempt reads it."""
    if reload is None:
        return None
    try:
        return reload()
    except Exception as exc:
        log.warning("config_reload_failed", error=clip(f"{type(exc).__name__}: {exc}"))
        return None


async def _start_with_retry(
    runtime: Runtime,
    stop: asyncio.Event,
    reload: Callable[[], Config] | None = None,
    *,
    restarting: bool = False,
) -> Runtime | None:
    """Start ``runtime``, retrying transient failures with capped exponential back-off.

    Returns the started runtime, or None after a configuration error (logged) or when a
    stop signal arrives while waiting; a ConfigError (a setting the start found wrong) is
    raised again once logged and torn down. Each attempt starts from a fresh Runtime: a
    failed start is torn down first (its Kafka clients and producer released; the HTTP server,
    metrics and a started Kubernetes side go on to the next attempt, see ``handover``).
    ``reload``: read the configuration again for each further attempt. ``restarting``:
    the service already ran with this configuration, so an authorization the broker
    refuses now (an ACL) changed on its side and is waited out.
    """
    config = runtime.config
    attempt = 0
    while True:
        attempt += 1
        # Raced against the stop signal: a start-up waits on servers (a broker that
        # accepts and never answers holds it for each request's timeout), and the pod is
        # SIGKILLed a grace period after SIGTERM.
        starting = asyncio.create_task(runtime.start(), name="start-up")
        signalled = asyncio.create_task(stop.wait(), name="stop-signal")
        try:
            await asyncio.wait({starting, signalled}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            signalled.cancel()
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(BaseException):
                await starting
            with contextlib.suppress(Exception):
                await asyncio.wait_for(runtime.stop(), config.shutdown_timeout_s)
            log.info("startup_abandoned", attempts=attempt)
            return None
        try:
            starting.result()
            return runtime
        except Exception as exc:
            error = clip(f"{type(exc).__name__}: {exc}")
            transient = _transient_startup_error(exc) or (
                restarting and (kafka_error_kinds.is_acl(exc) or isinstance(exc, KafkaAccessDenied))
            )
            # A retry keeps the HTTP server up: the kubelet restarts a pod whose liveness
            # probe goes unanswered, and /readyz says why it is not ready.
            closing = runtime.stop(keep_front=transient)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(closing, config.shutdown_timeout_s)
            if not transient:
                log.error("startup_failed", error=error, hint="configuration error; not retried")
                if isinstance(exc, ConfigError):
                    raise
                return None
        runtime = runtime.handover(error, _reloaded(reload))
        delay = backoff.exponential(attempt, config.retry_backoff_s, config.retry_backoff_max_s)
        log.warning("startup_retrying", error=error, attempt=attempt, retry_in_s=delay)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
        if stop.is_set():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(runtime.stop(), config.shutdown_timeout_s)
            log.info("startup_abandoned", attempts=attempt)
            return None
