"""Is Kafka reachable? A small metadata probe, independent of the consume loop.

The consumer and producer reconnect on their own and say nothing while the brokers are
gone: the loop simply gets empty fetches. Readiness needs an answer that does not depend
on their internals, so this probe keeps its own client and asks the cluster for its
metadata every ``interval_s``. ``unreachable_for()`` is how long no answer came back.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import structlog

__all__ = ["KafkaProbe"]

log = structlog.get_logger(__name__)

_ERROR_LIMIT = 300


class KafkaProbe:
    def __init__(
        self,
        client_args: dict[str, Any],
        *,
        interval_s: float = 3.0,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._args = dict(client_args)
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._client: Any = None
        self._task: asyncio.Task[None] | None = None
        self._last_ok: float | None = None
        self._last_failed: float | None = None
        self._since = clock()  # reference until the first success
        self.last_error = "not probed yet"
        self.probes = 0

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._since = self._clock()
            self._task = asyncio.create_task(self._run(), name="kafka-probe")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._close_client()

    @property
    def reachable(self) -> bool:
        """The last probe succeeded (a probe in flight does not count as failed yet)."""
        return self._last_ok is not None and self.last_error == ""

    def unreachable_for(self) -> float:
        """Seconds since the cluster last answered (since start if it never did).

        Measured from the last success, not from the first failure: a frozen broker
        leaves the probe hanging until its timeout, and that time counts too. Healthy,
        this stays below ``interval_s`` plus one round trip.
        """
        ref = self._last_ok if self._last_ok is not None else self._since
        return max(0.0, self._clock() - ref)

    def failed_within(self, seconds: float) -> bool:
        """A probe failed in the last ``seconds`` (a timed-out one counts when it ends)."""
        failed = self._last_failed
        return failed is not None and self._clock() - failed <= seconds

    async def probe_once(self) -> bool:
        self.probes += 1
        try:
            async with asyncio.timeout(self._timeout_s):
                if self._client is None:
                    self._client = self._new_client()
                    await self._client.bootstrap()
                await self._client.fetch_all_metadata()
        except Exception as exc:  # any failure means "not reachable"; the text says why
            if self.last_error == "" or (self._last_ok is None and self.probes == 1):
                log.warning("kafka_unreachable", error=self._describe(exc))
            self.last_error = self._describe(exc)
            self._last_failed = self._clock()
            # A client that failed to bootstrap is unusable; a fresh one is cheap.
            await self._close_client()
            return False
        if self.last_error and self._last_ok is not None:
            log.info("kafka_reachable_again", down_s=round(self.unreachable_for(), 1))
        self._last_ok = self._clock()
        self.last_error = ""
        return True

    async def _run(self) -> None:
        while True:
            await self.probe_once()
            await asyncio.sleep(self._interval_s)

    def _new_client(self) -> Any:
        from aiokafka.client import AIOKafkaClient

        args = {
            **self._args,
            "request_timeout_ms": int(self._timeout_s * 1000),
            # The replica's client.id (KAFKA_CLIENT_ID) marked as its probe.
            "client_id": f"{self._args.get('client_id', 'crs-consumer')}-probe",
        }
        return AIOKafkaClient(**args)

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()

    @staticmethod
    def _describe(exc: BaseException) -> str:
        name = type(exc).__name__
        text = str(exc) or ("timed out" if isinstance(exc, TimeoutError) else "")
        # aiokafka's errors already start with their class name.
        return (text if text.startswith(name) else f"{name}: {text}")[:_ERROR_LIMIT]
