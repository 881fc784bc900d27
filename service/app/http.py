"""The operating surface over HTTP: /metrics, /healthz, /readyz.

``/healthz`` answers "is this process worth keeping": the event loop is responsive and
the consume loop has turned recently. ``/readyz`` answers "should traffic wait for me":
the consumer has started and joined its group (or is waiting for an assignment) and the
cluster state is usable (the watch caches have synced, or the API server answered).
Both return a small JSON body that says why, for the person reading a failing probe.
"""

from __future__ import annotations

import errno
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from service.app.config import ConfigError

__all__ = ["HealthChecks", "HttpServer"]


@dataclass
class HealthChecks:
    """Callables the server asks; each returns (ok, detail)."""

    alive: Callable[[], tuple[bool, str]]
    ready: Callable[[], Awaitable[tuple[bool, str]]]


class HttpServer:
    def __init__(
        self, registry: CollectorRegistry, checks: HealthChecks, host: str, port: int
    ) -> None:
        self._registry = registry
        self._checks = checks
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        self._app = app

    def serve(self, registry: CollectorRegistry, checks: HealthChecks) -> None:
        """Answer from ``registry`` and ``checks`` from now on (a retried start-up hands
        the running server to its next attempt, so the probes never go unanswered)."""
        self._registry = registry
        self._checks = checks

    async def start(self) -> None:
        self._runner = web.AppRunner(self._app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            # An address that is not this host's or does not resolve is a setting no
            # retry fixes (start-up retries OSErrors: a server briefly away); a port in
            # use may be freed by a process still exiting, and a name server may answer
            # "try again" (EAI_AGAIN): those stay OSErrors.
            unresolvable = isinstance(exc, socket.gaierror) and exc.errno != socket.EAI_AGAIN
            if unresolvable or exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(
                    f"CRS_HTTP_HOST={self._host!r}: cannot listen there ({exc.strerror or exc})"
                ) from exc
            raise
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else self._port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, _: web.Request) -> web.Response:
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, _: web.Request) -> web.Response:
        ok, detail = self._checks.alive()
        return web.json_response({"ok": ok, "detail": detail}, status=200 if ok else 503)

    async def _readyz(self, _: web.Request) -> web.Response:
        ok, detail = await self._checks.ready()
        return web.json_response({"ok": ok, "detail": detail}, status=200 if ok else 503)


class LoopWatchdog:
    """Measures event-loop responsiveness: a stuck loop is an unhealthy process."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.last_tick = time.monotonic()

    async def run(self) -> None:
        import asyncio

        while True:
            self.last_tick = time.monotonic()
            await asyncio.sleep(self.interval_s)

    def stalled_for(self) -> float:
        return max(0.0, time.monotonic() - self.last_tick - self.interval_s)
