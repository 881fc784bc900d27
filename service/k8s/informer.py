"""The list/watch protocol for one kind (client-go's reflector), over a small transport.

The informer speaks only to :class:`ListWatch` (a paged LIST and a WATCH as an async
iterator of :class:`~service.k8s.client.WatchEvent`; :class:`KubeClient` is the real
one, the unit tests script a fake) and keeps a :class:`~service.k8s.store.Store`.
How each edge of the protocol is handled:

* **Start**: a LIST fills the store and yields the resourceVersion to watch from.
* **Watch** from that resourceVersion, bookmarks on, with a server-side timeout of
  ``watch_timeout_s`` (spread by up to +20 %). When the server ends the stream the
  informer watches again from the last resourceVersion it saw (an object event or a
  BOOKMARK), without a LIST.
* **410 Gone** (:class:`ResourceExpiredError`): the resourceVersion fell out of the
  server's window, events were lost: LIST again. The relist is diffed against the
  store, so the indexes above stay incremental.
* **Any other failure** (refused, reset, 5xx, 429, a torn line, an ERROR event) and a
  stream silent for ``idle_timeout_s`` (presumed dead: the server sends a BOOKMARK
  about every minute even on a quiet kind): keep the resourceVersion, wait a capped,
  jittered exponential back-off, watch again. No LIST: the server replays everything
  after that resourceVersion. A LIST that fails is retried the same way. A relist after
  a 410 is immediate, unless the watch expired again before it got going (a LIST slower
  than the server's watch window): then relists back off too.
* **Up and alive** (``down_for``, ``silent_for``; readiness and the stale bound use
  them): a LIST, an event or BOOKMARK, and a watch the server ended as asked are signs
  of life. A watch that opened and failed before delivering anything was not up: the
  outage it interrupted goes on, so a server that answers every watch with 200 and then
  an ERROR shows as down, not as a healthy watch reconnecting.

Callers see only :class:`~service.crs.ports.ApiError` types; a bug in a handler is
logged and the informer keeps going (with back-off) instead of dying silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Final, Generic, Protocol, TypeVar

import structlog

from service import backoff
from service.crs.ports import ApiError, UnavailableError
from service.k8s.client import (
    DEFAULT_PAGE_SIZE,
    K8sObject,
    ListResult,
    ResourceKind,
    WatchEvent,
)
from service.k8s.errors import ResourceExpiredError
from service.k8s.store import Store, is_newer, rv_int

__all__ = [
    "Informer",
    "InformerOptions",
    "K8sObject",
    "ListWatch",
    "ResourceExpiredError",
    "is_newer",
]

_log = structlog.get_logger(__name__)

_MESSAGE_LIMIT: Final = 300
# A watch that stayed up this long counts as healthy: the next failure backs off from 0.
_HEALTHY_WATCH_S: Final = 10.0
# The server-side timeout of a watch opened after a silent one (see _watch).
_PROBE_WATCH_S: Final = 2

T = TypeVar("T", bound=K8sObject)
L = TypeVar("L")


class _SilentWatch(UnavailableError):
    """A watch ended by the informer's idle limit: the server sent nothing for that long."""


class ListWatch(Protocol):
    """The transport an informer needs; :class:`~service.k8s.client.KubeClient` is one.

    ``list_objects`` returns one consistent snapshot and its resourceVersion, and fails
    with ApiError types. ``watch`` is entered to open the stream and iterated for its
    events; it raises ResourceExpiredError on 410 and another ApiError on any failure,
    and ends when the server ends the stream.
    """

    async def list_objects(
        self,
        kind: ResourceKind,
        type_: type[L],
        *,
        label_selector: str | None = None,
        limit: int = DEFAULT_PAGE_SIZE,
    ) -> ListResult[L]: ...

    def watch(
        self,
        kind: ResourceKind,
        type_: type[T],
        *,
        resource_version: str = "",
        label_selector: str | None = None,
        timeout_s: int = 300,
    ) -> AbstractAsyncContextManager[AsyncIterator[WatchEvent[T]]]: ...


@dataclass(frozen=True, slots=True)
class InformerOptions:
    """Tuning shared by all informers of a cache.

    ``watch_timeout_s`` is the server-side ``timeoutSeconds`` (renewal period, spread by
    up to +20 %); ``idle_timeout_s`` is how long a stream may stay silent before it is
    presumed dead (the server sends a BOOKMARK about every minute); reconnects wait
    ``backoff_base_s * 2**attempt`` capped at ``backoff_max_s``, with jitter.
    """

    page_size: int = DEFAULT_PAGE_SIZE
    watch_timeout_s: float = 300.0
    idle_timeout_s: float = 150.0
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.watch_timeout_s < 1 or self.idle_timeout_s <= 0:
            raise ValueError("page_size, watch_timeout_s (>= 1) and idle_timeout_s must be > 0")
        if self.backoff_base_s < 0 or self.backoff_max_s < self.backoff_base_s:
            raise ValueError("need 0 <= backoff_base_s <= backoff_max_s")


class Informer(Generic[T]):
    """Keeps a newer-wins store of one kind current and reports every change.

    ``on_change(old, new)`` and ``keep`` are the store's (see :class:`Store`).
    ``on_undecodable(name, path)``: an object the server has but that does not decode
    into ``type_`` (it counts as absent from the store), with the path where decoding
    failed; ``path`` None once that is over (it decoded again, was deleted, or a relist
    no longer has it).
    ``clock`` and ``sleep`` are the time it runs on (the unit tests fake both).
    """

    def __init__(
        self,
        transport: ListWatch,
        kind: ResourceKind,
        type_: type[T],
        *,
        on_change: Callable[[T | None, T | None], None],
        label_selector: str | None = None,
        keep: Callable[[T], bool] | None = None,
        on_undecodable: Callable[[str, str | None], None] | None = None,
        options: InformerOptions | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        opts = options or InformerOptions()
        self._transport = transport
        self.kind = kind
        self._type = type_
        self._selector = label_selector
        self._opts = opts
        self._clock = clock
        self._sleep = sleep
        self._random = random.Random()
        self._log = _log.bind(kind=kind.plural)

        self._store: Store[T] = Store(on_change, keep=keep)
        self._on_undecodable = on_undecodable
        self._undecodable: set[str] = set()
        self._rv = ""  # where the next watch starts: last list, event or bookmark
        self._synced = asyncio.Event()
        self._connected_since: float | None = None
        self._down_since = clock()
        self._last_error = "not started"
        self._task: asyncio.Task[None] | None = None
        # Last sign of life from the server: a LIST, a watch established, any event or
        # BOOKMARK. A half-open connection to a frozen server keeps the watch
        # "connected" while this ages; readiness uses it.
        self._last_activity = clock()
        # A watch's opening counts as up and alive only provisionally: one that fails
        # before it delivers anything (and within _HEALTHY_WATCH_S) was neither, and
        # these clocks go back to where they were before it opened.
        self._before_up = (self._last_activity, self._down_since)
        self._delivered = False
        # The last watch ended at our idle limit with nothing delivered. A server that
        # answers every WATCH and then sends nothing (a wedged handler, a proxy holding
        # the stream after its upstream died) would otherwise look up again at each
        # re-open: the next watch is up, and its opening a sign of life, only once it
        # delivers something.
        self._silent_end = False
        # Plain counters for diagnostics and tests (the request metrics are the client's).
        self.lists = 0
        self.watches = 0
        self.expired = 0
        self.events = 0

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Start the list/watch loop as a task (idempotent); returns immediately."""
        if self._task is None or self._task.done():
            self._down_since = self._clock()
            self._silent_end = False
            self._last_error = "starting"
            self._task = asyncio.create_task(self._run(), name=f"informer-{self.kind.plural}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._mark_down("stopped")

    async def wait_synced(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """Wait until the first LIST has been applied; False on timeout (a poll API)."""
        if self._synced.is_set():
            return True
        try:
            async with asyncio.timeout(timeout):
                await self._synced.wait()
        except TimeoutError:
            return False
        return True

    # --- state ----------------------------------------------------------------------

    @property
    def store(self) -> Store[T]:
        return self._store

    @property
    def has_synced(self) -> bool:
        return self._synced.is_set()

    @property
    def resource_version(self) -> str:
        return self._rv

    @property
    def connected(self) -> bool:
        return self._connected_since is not None and not self._silent_end

    @property
    def last_error(self) -> str:
        return self._last_error

    def down_for(self) -> float:
        """Seconds since the watch was last connected; 0.0 while it is connected."""
        if self.connected:
            return 0.0
        return self._clock() - self._down_since

    def silent_for(self) -> float:
        """Seconds since the server last delivered anything (list, watch start, event)."""
        return self._clock() - self._last_activity

    def get(self, name: str) -> T | None:
        return self._store.get(name)

    def __len__(self) -> int:
        return len(self._store)

    # --- changes from outside the watch (read-your-writes) --------------------------

    def apply(self, obj: T) -> bool:
        """Apply an object the API server returned to us (a write result or a fresh read).

        Applied only if it is newer than both the stored object and the watch position:
        if the watch already got past its resourceVersion, the stream has delivered this
        version or a later one (including a delete), and applying it could resurrect a
        deleted object. Returns whether the store changed.
        """
        a, b = rv_int(obj.metadata.resource_version), rv_int(self._rv)
        if a is not None and b is not None and a <= b:
            return False
        applied = self._store.upsert(obj)
        if applied:
            self._decodes(obj.metadata.name or "", None)
        return applied

    def _decodes(self, name: str, path: str | None) -> None:
        """Track and report an object that does not decode (``path``), or no longer."""
        report = self._on_undecodable
        if report is None:
            return
        if path is not None:
            self._undecodable.add(name)
            report(name, path)
        elif name in self._undecodable:
            self._undecodable.discard(name)
            report(name, None)

    # --- the loop -------------------------------------------------------------------

    def _backoff(self, attempt: int) -> float:
        """Capped exponential with "equal jitter"; ``attempt`` counts from 0 here."""
        opts = self._opts
        delay = backoff.exponential(attempt + 1, opts.backoff_base_s, opts.backoff_max_s)
        return backoff.equal_jitter(delay, self._random)

    async def _run(self) -> None:
        attempt = 0
        relists = 0  # expiries in a row with no healthy watch between them
        need_list = True
        while True:
            delay = 0.0
            try:
                if need_list:
                    await self._list()
                    need_list = False
                    attempt = 0
                started = self._clock()
                events = await self._watch()
                spun = events == 0 and self._clock() - started < 1.0
                self._mark_down("watch ended", renewal=not spun)
                if spun:
                    # An empty stream that ended at once: do not spin on such a server.
                    delay = self._backoff(attempt)
                    attempt += 1
                else:
                    attempt = relists = 0
            except ResourceExpiredError as exc:
                self.expired += 1
                if self._delivered or self._stayed_up():
                    relists = 0
                attempt = self._healthy_reset(attempt)
                self._mark_down(str(exc))
                need_list = True
                # The first relist is immediate: nothing is wrong with the server. Its
                # LIST succeeding proves little (it may be slower than the server's watch
                # window): expiring again before a watch got going backs off.
                delay = self._backoff(relists - 1) if relists else 0.0
                relists += 1
                self._log.warning(
                    "watch_expired_relisting", resource_version=self._rv, error=str(exc)
                )
            except ApiError as exc:
                silent = isinstance(exc, _SilentWatch)
                attempt = attempt if silent else self._healthy_reset(attempt)
                self._mark_down(str(exc), silent=silent)
                delay = self._backoff(attempt)
                attempt += 1
                self._log.warning(
                    "watch_failed_retrying",
                    phase="list" if need_list else "watch",
                    resource_version=self._rv,
                    status=exc.status,
                    error=str(exc)[:_MESSAGE_LIMIT],
                    retry_in_s=round(delay, 2),
                )
            except Exception as exc:  # a bug must not end the informer silently
                attempt = self._healthy_reset(attempt)
                self._mark_down(f"{type(exc).__name__}: {exc}")
                delay = self._backoff(attempt)
                attempt += 1
                self._log.error("informer_loop_error", resource_version=self._rv, exc_info=True)
            await self._sleep(delay)

    def _stayed_up(self) -> bool:
        """Whether the watch now open has been up for _HEALTHY_WATCH_S."""
        since = self._connected_since
        return since is not None and self._clock() - since >= _HEALTHY_WATCH_S

    def _healthy_reset(self, attempt: int) -> int:
        return 0 if self._stayed_up() else attempt

    def _mark_up(self) -> None:
        self._before_up = (self._last_activity, self._down_since)
        self._connected_since = self._clock()
        if not self._silent_end:
            self._last_activity = self._connected_since
        self._last_error = ""

    def _mark_down(self, error: str, *, renewal: bool = False, silent: bool = False) -> None:
        """The watch is no longer open; ``renewal``: the server ended it as asked;
        ``silent``: our idle limit ended it."""
        after_silence = self._silent_end
        if silent:  # whatever it delivered before it fell silent
            self._silent_end = True
        elif renewal or self._delivered:
            self._silent_end = False
        if self._connected_since is not None:
            # The first stream that stays silent until our idle limit counts as up until
            # then (a frozen API server: the cache is served for stale_after_s more, as
            # for any watch that went down). One opened after it proves nothing unless it
            # delivers, however long it stays open: the outage goes on from that first
            # silent end (a server answering every WATCH and then sending nothing).
            proven = renewal or self._delivered or (self._stayed_up() and not after_silence)
            self._connected_since = None
            now = self._clock()
            if proven:
                self._down_since = now
                if renewal:
                    self._last_activity = now
            else:
                # Opened and failed with nothing delivered (an ERROR event right after
                # the 200, a server ending every stream at once): the outage goes on.
                self._last_activity, self._down_since = self._before_up
        self._last_error = error[:_MESSAGE_LIMIT]

    async def _list(self) -> None:
        started = self._clock()
        result = await self._transport.list_objects(
            self.kind, self._type, label_selector=self._selector, limit=self._opts.page_size
        )
        changed, removed = self._store.replace(result.items, result.resource_version)
        undecodable = dict(result.undecodable)
        for name in self._undecodable - undecodable.keys():
            self._decodes(name, None)
        for name, path in undecodable.items():
            self._decodes(name, path)
        self._rv = result.resource_version
        self._last_activity = self._clock()
        self._silent_end = False  # the whole state delivered: the next watch counts
        self.lists += 1
        first = not self._synced.is_set()
        self._synced.set()
        self._log.info(
            "informer_listed",
            resource_version=self._rv,
            objects=len(self._store),
            changed=changed,
            removed=removed,
            initial=first,
            seconds=round(self._clock() - started, 3),
        )

    async def _watch(self) -> int:
        """One watch from ``self._rv``; returns the number of events handled.

        Returns normally when the server ends the stream; raises ResourceExpiredError
        on 410 and another ApiError on anything else, including a silent stream.
        """
        # client-go spreads watch renewals over [timeout, 2*timeout); a smaller spread
        # keeps the same effect (no thundering herd of re-watches) with a known bound.
        server_timeout = int(self._opts.watch_timeout_s * (1.0 + 0.2 * self._random.random()))
        if self._silent_end:
            # After a silent stream this watch counts only once it delivers: asked to end
            # within seconds, a live server proves itself at once (a renewal), instead of
            # at its next bookmark or renewal (~15 s on a quiet kind, while requests fail
            # on a cache that went stale during a freeze the server has recovered from).
            server_timeout = min(server_timeout, _PROBE_WATCH_S)
        idle = self._opts.idle_timeout_s
        handled = 0
        self.watches += 1
        self._delivered = False
        stream = self._transport.watch(
            self.kind,
            self._type,
            resource_version=self._rv,
            label_selector=self._selector,
            timeout_s=server_timeout,
        )
        async with stream as events:
            self._mark_up()
            self._log.debug("watch_started", resource_version=self._rv, timeout_s=server_timeout)
            loop = asyncio.get_running_loop()
            # The deadline moves only once it is nearer than ``idle``: a stream is
            # presumed dead after idle to idle + slack of silence, and a burst of events
            # costs one timer reschedule instead of one each.
            slack = idle / 64
            deadline = asyncio.timeout(idle + slack)
            try:
                async with deadline:
                    async for event in events:
                        now = loop.time()
                        if (deadline.when() or now) - now < idle:
                            deadline.reschedule(now + idle + slack)
                        self._handle(event)
                        handled += 1
            except TimeoutError as exc:
                if not deadline.expired():
                    raise
                message = f"watch {self.kind.plural}: nothing received for {idle:g}s"
                raise _SilentWatch(message, kind=self.kind.plural) from exc
        return handled

    def _handle(self, event: WatchEvent[T]) -> None:
        self._last_activity = self._clock()
        self._delivered = True
        self._silent_end = False
        rv = event.resource_version
        if event.type == "BOOKMARK":
            if rv:
                self._rv = rv
            return
        self.events += 1
        obj = event.object
        if obj is None or event.type == "DELETED":
            # An object that does not decode counts as absent (the client logged it).
            self._store.delete(event.name, rv or None)
            deleted = event.type == "DELETED"
            self._decodes(event.name, None if deleted else event.undecodable_at or "$")
        else:
            self._store.upsert(obj)
            self._decodes(obj.metadata.name or "", None)
        if rv:
            self._rv = rv
