"""A list-then-watch informer for one custom resource kind (client-go's reflector pattern).

Why not kubernetes_asyncio's ``watch.Watch``: it decodes every event into Python dicts
and then into its own model objects; for 50,000 Reservations that is several times the
cost of decoding the raw line straight into the msgspec model, which is what this does.

The protocol, and how each edge is handled:

* **Start**: a paged LIST (through :meth:`KubeClient.list_objects`, so it is counted and
  its errors are mapped) fills the store and yields the resourceVersion to watch from.
* **Watch**: ``watch=true&allowWatchBookmarks=true&timeoutSeconds=~300`` from that
  resourceVersion. The server ends the stream at the timeout; the informer re-watches
  from the last resourceVersion it saw (an object event or a BOOKMARK), without a LIST.
* **410 Gone** (an ``ERROR`` event with code 410 / reason Expired, or HTTP 410): the
  resourceVersion fell out of the server's window, events were lost: LIST again. The
  relist is diffed against the store, so the indexes above stay incremental.
* **Connection errors** (refused, reset, idle timeout, 5xx, 429, any other HTTP error or
  ERROR event): keep the resourceVersion, wait a capped, jittered exponential backoff,
  re-watch. No LIST: the server replays everything after that resourceVersion. A torn
  (undecodable) line is handled the same way. A LIST that fails is retried the same way.
* **Newer-wins store**: every change (watch event, our own write, a fresh read) is applied
  only if its resourceVersion is newer than what the store holds, so a watch event that
  lags behind our own write cannot roll the object back (read-your-writes).

Callers see only :class:`~service.crs.ports.ApiError` types; a bug in a handler is
logged and the informer keeps going (with backoff) instead of dying silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Generic, Protocol, TypeVar

import aiohttp
import msgspec
import structlog
from kubernetes_asyncio import client as k8s_client

from service import backoff
from service.crs.ports import ApiError, UnavailableError
from service.k8s.client import DEFAULT_PAGE_SIZE, KubeClient, ResourceKind
from service.k8s.errors import error_for_status, map_exception
from service.model import DecodeError, ObjectMeta, from_k8s

__all__ = ["Informer", "InformerOptions", "K8sObject", "ResourceExpiredError", "is_newer"]

_log = structlog.get_logger(__name__)

_MESSAGE_LIMIT: Final = 300
# A watch that stayed up this long counts as healthy: the next failure backs off from 0.
_HEALTHY_WATCH_S: Final = 10.0


class K8sObject(Protocol):
    """What the informer needs of a decoded object: its metadata (name, resourceVersion)."""

    @property
    def metadata(self) -> ObjectMeta: ...


T = TypeVar("T", bound=K8sObject)


class ResourceExpiredError(UnavailableError):
    """HTTP 410 on a watch: the resourceVersion is too old, only a new LIST helps."""


def _rv_int(rv: str | None) -> int | None:
    if not rv:
        return None
    try:
        return int(rv)
    except ValueError:
        return None


def is_newer(candidate: str | None, current: str | None) -> bool:
    """Whether ``candidate`` is a strictly newer resourceVersion than ``current``.

    Kubernetes documents resourceVersions as opaque, but etcd-backed servers hand out
    monotonic integers and client-go's own caches rely on comparing them. When either
    does not parse the fallback is "a different version wins" (the plain informer
    rule: the last thing delivered is the truth); equal strings are never newer.
    """
    if candidate == current:
        return False
    a, b = _rv_int(candidate), _rv_int(current)
    if a is None or b is None:
        return True
    return a > b


def _rv_of(obj: K8sObject) -> str | None:
    return obj.metadata.resource_version


def _name_of(obj: K8sObject) -> str:
    return obj.metadata.name or ""


# --- wire types of a watch stream ---------------------------------------------------


class _Event(msgspec.Struct, frozen=True):
    """One watch line; ``object`` stays raw until the type says how to decode it."""

    type: str = ""
    object: msgspec.Raw = msgspec.Raw(b"null")


class _Status(msgspec.Struct, frozen=True):
    code: int = 0
    reason: str = ""
    message: str = ""


class _Meta(msgspec.Struct, frozen=True):
    name: str = ""
    resourceVersion: str = ""  # the wire name: camelCase


class _MetaOnly(msgspec.Struct, frozen=True):
    metadata: _Meta = msgspec.field(default_factory=_Meta)


_EVENT_DECODER: Final = msgspec.json.Decoder(_Event)
_STATUS_DECODER: Final = msgspec.json.Decoder(_Status)
_META_DECODER: Final = msgspec.json.Decoder(_MetaOnly)


def _status_of(raw: bytes | memoryview) -> _Status:
    try:
        return _STATUS_DECODER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _Status()


def _meta_of(raw: bytes | memoryview) -> _Meta:
    try:
        return _META_DECODER.decode(raw).metadata
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _Meta()


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

    ``on_change(old, new)`` is called synchronously for each applied change (``old``
    None for an add, ``new`` None for a delete), so the owner's indexes are updated in
    the same step as the store and no reader ever sees the two disagree. ``keep``
    filters client-side: objects it rejects are treated as absent (a write that takes
    an object out of the filter removes it).
    """

    def __init__(
        self,
        client: KubeClient,
        kind: ResourceKind,
        type_: type[T],
        *,
        on_change: Callable[[T | None, T | None], None],
        label_selector: str | None = None,
        keep: Callable[[T], bool] | None = None,
        options: InformerOptions | None = None,
    ) -> None:
        opts = options or InformerOptions()
        self._client = client
        self._co: Any = k8s_client.CustomObjectsApi(client.api_client)
        self.kind = kind
        self._type = type_
        self._on_change = on_change
        self._selector = label_selector
        self._keep = keep
        self._page_size = opts.page_size
        self._watch_timeout_s = opts.watch_timeout_s
        self._idle_timeout_s = opts.idle_timeout_s
        self._backoff_base_s = opts.backoff_base_s
        self._backoff_max_s = opts.backoff_max_s
        self._random = random.Random()
        self._log = _log.bind(kind=kind.plural)

        self._store: dict[str, T] = {}
        self._rv = ""  # where the next watch starts: last list, event or bookmark
        self._synced = asyncio.Event()
        self._connected_since: float | None = None
        self._down_since = time.monotonic()
        self._last_error = "not started"
        self._resp: Any = None
        self._task: asyncio.Task[None] | None = None
        # Last sign of life from the server: a LIST, a watch established, any watch line
        # (event or BOOKMARK). A half-open connection to a frozen server keeps the watch
        # "connected" while this ages; readiness uses it.
        self._last_activity = time.monotonic()
        # Plain counters for diagnostics and tests (the request metrics are in K8sMetrics).
        self.lists = 0
        self.watches = 0
        self.expired = 0
        self.events = 0

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Start the list/watch loop as a task (idempotent); returns immediately."""
        if self._task is None or self._task.done():
            self._down_since = time.monotonic()
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
    def has_synced(self) -> bool:
        return self._synced.is_set()

    @property
    def resource_version(self) -> str:
        return self._rv

    @property
    def connected(self) -> bool:
        return self._connected_since is not None

    @property
    def last_error(self) -> str:
        return self._last_error

    def down_for(self) -> float:
        """Seconds since the watch was last connected; 0.0 while it is connected."""
        if self._connected_since is not None:
            return 0.0
        return time.monotonic() - self._down_since

    def silent_for(self) -> float:
        """Seconds since the server last delivered anything (list, watch start, line)."""
        return time.monotonic() - self._last_activity

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
        rv = _rv_of(obj)
        a, b = _rv_int(rv), _rv_int(self._rv)
        if a is not None and b is not None and a <= b:
            return False
        return self._upsert(obj)

    # --- the store ------------------------------------------------------------------

    def _upsert(self, obj: T) -> bool:
        name = _name_of(obj)
        old = self._store.get(name)
        if old is not None and not is_newer(_rv_of(obj), _rv_of(old)):
            return False
        if self._keep is not None and not self._keep(obj):
            if old is None:
                return False
            del self._store[name]
            self._on_change(old, None)
            return True
        self._store[name] = obj
        self._on_change(old, obj)
        return True

    def _delete(self, name: str, rv: str | None) -> bool:
        old = self._store.get(name)
        if old is None:
            return False
        if rv and not is_newer(rv, _rv_of(old)):
            return False  # we hold a version written after this delete (a recreation)
        del self._store[name]
        self._on_change(old, None)
        return True

    def _replace(self, items: list[T], list_rv: str) -> tuple[int, int]:
        """Make the store equal to a LIST, as a diff; returns (changed, removed).

        Objects we hold at a version newer than the list (our own write landed after the
        list's snapshot) are kept: the watch from ``list_rv`` will deliver the truth.
        """
        seen: set[str] = set()
        changed = 0
        for obj in items:
            seen.add(_name_of(obj))
            if self._upsert(obj):
                changed += 1
        list_n = _rv_int(list_rv)
        removed = 0
        for name in [n for n in self._store if n not in seen]:
            held = _rv_int(_rv_of(self._store[name]))
            if list_n is not None and held is not None and held > list_n:
                continue
            old = self._store.pop(name)
            self._on_change(old, None)
            removed += 1
        return changed, removed

    # --- the loop -------------------------------------------------------------------

    def _backoff(self, attempt: int) -> float:
        """Capped exponential with "equal jitter"; ``attempt`` counts from 0 here."""
        delay = backoff.exponential(attempt + 1, self._backoff_base_s, self._backoff_max_s)
        return backoff.equal_jitter(delay, self._random)

    async def _run(self) -> None:
        attempt = 0
        need_list = True
        while True:
            delay = 0.0
            try:
                if need_list:
                    await self._list()
                    need_list = False
                    attempt = 0
                started = time.monotonic()
                lines = await self._watch()
                self._mark_down("watch ended")
                if lines == 0 and time.monotonic() - started < 1.0:
                    # An empty stream that ended at once: do not spin on such a server.
                    delay = self._backoff(attempt)
                    attempt += 1
                else:
                    attempt = 0
            except ResourceExpiredError as exc:
                self.expired += 1
                attempt = self._healthy_reset(attempt)
                self._mark_down(str(exc))
                need_list = True
                # The first relist is immediate: nothing is wrong with the server.
                delay = self._backoff(attempt) if attempt else 0.0
                attempt += 1
                self._log.warning(
                    "watch_expired_relisting", resource_version=self._rv, error=str(exc)
                )
            except ApiError as exc:
                attempt = self._healthy_reset(attempt)
                self._mark_down(str(exc))
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
            finally:
                self._resp = None
            await asyncio.sleep(delay)

    def _healthy_reset(self, attempt: int) -> int:
        since = self._connected_since
        if since is not None and time.monotonic() - since >= _HEALTHY_WATCH_S:
            return 0
        return attempt

    def _mark_up(self) -> None:
        self._connected_since = self._last_activity = time.monotonic()
        self._last_error = ""

    def _mark_down(self, error: str) -> None:
        if self._connected_since is not None:
            self._connected_since = None
            self._down_since = time.monotonic()
        self._last_error = error[:_MESSAGE_LIMIT]

    async def _list(self) -> None:
        started = time.monotonic()
        result = await self._client.list_objects(
            self.kind, self._type, label_selector=self._selector, limit=self._page_size
        )
        changed, removed = self._replace(result.items, result.resource_version)
        self._rv = result.resource_version
        self._last_activity = time.monotonic()
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
            seconds=round(time.monotonic() - started, 3),
        )

    async def _watch(self) -> int:
        """One watch request from ``self._rv``; returns the number of lines handled.

        Returns normally when the server ends the stream (its ``timeoutSeconds``);
        raises ResourceExpiredError on 410 and another ApiError on anything else.
        """
        kind = self.kind
        what = f"watch {kind.plural}"
        request_timeout = self._client.request_timeout_s
        # client-go spreads watch renewals over [timeout, 2*timeout); a smaller spread
        # keeps the same effect (no thundering herd of re-watches) with a known bound.
        server_timeout = int(self._watch_timeout_s * (1.0 + 0.2 * self._random.random()))
        kwargs: dict[str, Any] = {
            "watch": True,
            "allow_watch_bookmarks": True,
            "timeout_seconds": server_timeout,
        }
        if self._rv:
            kwargs["resource_version"] = self._rv
        if self._selector:
            kwargs["label_selector"] = self._selector
        # No total deadline (the stream is long-lived); the idle limit catches a dead
        # peer: the server sends a BOOKMARK about every minute even on a quiet kind.
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=request_timeout,
            sock_connect=request_timeout,
            sock_read=self._idle_timeout_s,
        )
        metrics = self._client.metrics
        started = time.monotonic()
        code: int | str = "error"
        self.watches += 1
        try:
            try:
                async with asyncio.timeout(request_timeout):
                    resp = await self._co.list_cluster_custom_object(
                        kind.group,
                        kind.version,
                        kind.plural,
                        _preload_content=False,
                        _request_timeout=timeout,
                        **kwargs,
                    )
            except Exception as exc:
                mapped = map_exception(exc, kind=kind.plural, what=what)
                if mapped is None:
                    raise
                if mapped.status:
                    code = mapped.status
                raise mapped from exc
            code = int(resp.status)
        finally:
            # Counted when the response headers arrive: the stream's lifetime is not a
            # request latency and would only blur the duration histogram.
            if metrics is not None:
                metrics.observe("watch", kind.plural, code, time.monotonic() - started)
        self._resp = resp
        try:
            if code != 200:
                body = b""
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(request_timeout):
                        body = await resp.read()
                status = _status_of(body)
                message = f"{what}: {(status.message or status.reason)[:_MESSAGE_LIMIT]}"
                if code == 410:
                    raise ResourceExpiredError(message, status=410, kind=kind.plural)
                raise error_for_status(code, message, kind=kind.plural)
            self._mark_up()
            self._log.debug("watch_started", resource_version=self._rv, timeout_s=server_timeout)
            return await self._consume(resp, what)
        finally:
            resp.close()

    async def _consume(self, resp: Any, what: str) -> int:
        """Split the chunked body into lines and handle each as it completes."""
        buf = bytearray()
        lines = 0
        try:
            async for chunk in resp.content.iter_any():
                buf += chunk
                end = buf.rfind(b"\n")
                if end < 0:
                    continue
                block = bytes(buf[:end])
                del buf[: end + 1]
                # Every complete line is applied before the next await: a burst of events
                # lands in the indexes as one step.
                for line in block.split(b"\n"):
                    if line.strip():
                        self._handle_line(line)
                        lines += 1
        except ApiError:
            raise
        except Exception as exc:
            mapped = map_exception(exc, kind=self.kind.plural, what=what)
            if mapped is None:
                raise
            raise mapped from exc
        if buf.strip():
            self._handle_line(bytes(buf))
            lines += 1
        return lines

    def _handle_line(self, line: bytes) -> None:
        kind = self.kind.plural
        self._last_activity = time.monotonic()
        try:
            event = _EVENT_DECODER.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            # A torn stream: reconnecting from the last good resourceVersion repairs it.
            raise UnavailableError(f"watch {kind}: undecodable line: {exc}", kind=kind) from exc
        etype = event.type
        raw = memoryview(event.object)
        if etype == "BOOKMARK":
            rv = _meta_of(raw).resourceVersion
            if rv:
                self._rv = rv
            return
        if etype == "ERROR":
            status = _status_of(raw)
            message = f"watch {kind}: {(status.message or status.reason)[:_MESSAGE_LIMIT]}"
            if status.code == 410 or status.reason in ("Expired", "Gone"):
                raise ResourceExpiredError(message, status=410, kind=kind)
            raise error_for_status(status.code or 500, message, kind=kind)
        if etype not in ("ADDED", "MODIFIED", "DELETED"):
            self._log.debug("watch_event_ignored", type=etype, resource_version=self._rv)
            return
        self.events += 1
        try:
            obj = from_k8s(raw, self._type)
        except DecodeError as exc:
            # Same rule as a LIST (the client skips undecodable items): the object is
            # treated as absent rather than kept at a stale version.
            meta = _meta_of(raw)
            self._log.warning(
                "skipping_undecodable_object",
                name=meta.name,
                resource_version=meta.resourceVersion,
                path=exc.path,
                error=str(exc)[:_MESSAGE_LIMIT],
            )
            self._delete(meta.name, meta.resourceVersion or None)
            if meta.resourceVersion:
                self._rv = meta.resourceVersion
            return
        if etype == "DELETED":
            self._delete(_name_of(obj), _rv_of(obj))
        else:
            self._upsert(obj)
        obj_rv = _rv_of(obj)
        if obj_rv:
            self._rv = obj_rv

    # --- test hook ------------------------------------------------------------------

    def _drop_connection(self) -> bool:
        """Abort the current watch's TCP connection, as a network failure would."""
        resp = self._resp
        if resp is None or resp.connection is None:
            return False
        transport = resp.connection.transport
        if transport is None:
            return False
        transport.abort()
        return True
