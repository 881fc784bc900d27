"""A small async Kubernetes client for the four custom resources the service uses.

Built on kubernetes_asyncio for configuration and authentication (kubeconfig, in-cluster
service account, token refresh); requests go out through :mod:`service.k8s.transport`
on its session, and responses are read as raw bytes and decoded straight into the
msgspec models: building Python dicts for 50,000 Reservations and then converting them
would cost several times the decode itself.

Every request carries a timeout, is counted in :class:`~service.k8s.metrics.K8sMetrics`,
and fails only with the :mod:`service.crs.ports` error types; both happen in one place
(:meth:`KubeClient._call` and :func:`mapped_errors`). A WATCH is the same kind of request
whose body is a stream: :meth:`KubeClient.watch` returns it as an async context manager
that yields typed :class:`WatchEvent` s. What to do with them (resourceVersions,
bookmarks, relists, re-watches) is :mod:`service.k8s.informer`'s business.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Generic, Literal, Protocol, TypeVar

import aiohttp
import msgspec
import structlog
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config

from service.crs.ports import API_REQUEST_HOOK, ApiError, NotFoundError, UnavailableError
from service.k8s.errors import ResourceExpiredError, error_for_status, map_exception
from service.k8s.metrics import K8sMetrics
from service.k8s.transport import JSON, Query, Transport
from service.model import (
    LABEL_RESERVATION_TYPE,
    RESERVATION_TYPE_COMMITTED_RESOURCE,
    CommittedResource,
    DecodeError,
    Hypervisor,
    Knowledge,
    ObjectMeta,
    Reservation,
    from_k8s,
)

__all__ = [
    "COMMITTED_RESOURCES",
    "CR_RESERVATION_SELECTOR",
    "FENCE_ANNOTATION",
    "HYPERVISORS",
    "KNOWLEDGES",
    "RESERVATIONS",
    "RESOURCE_KINDS",
    "K8sObject",
    "KubeClient",
    "ListResult",
    "ResourceKind",
    "WatchEvent",
    "WatchStream",
    "mapped_errors",
]

T = TypeVar("T")


class K8sObject(Protocol):
    """What the watch needs of a decoded object: its metadata (name, resourceVersion)."""

    @property
    def metadata(self) -> ObjectMeta: ...


Obj = TypeVar("Obj", bound=K8sObject)

_log = structlog.get_logger(__name__)

MERGE_PATCH: Final = "application/merge-patch+json"
# Set by fence_reservation to a new random token each time; its value means nothing.
FENCE_ANNOTATION: Final = "crs-consumer.cortex.cloud/fence"
DEFAULT_PAGE_SIZE: Final = 500
# A continue token expires after ~5-15 minutes (HTTP 410); restart the list this often.
_MAX_LIST_RESTARTS: Final = 2
_STATUS_MESSAGE_LIMIT: Final = 300
_METHODS: Final[Mapping[str, str]] = MappingProxyType(
    {"get": "GET", "list": "GET", "patch": "PATCH"}
)
# The verbs that write (max_writes): the guarded allocation patch and the fence.
_WRITES: Final = frozenset({"patch"})
# What a request that waits for no write slot enters instead (reusable: it holds nothing).
_NO_WAIT: Final = contextlib.nullcontext()


@dataclass(frozen=True, slots=True)
class ResourceKind:
    """A cluster-scoped custom resource: API group, version and plural."""

    group: str
    version: str
    plural: str


HYPERVISORS: Final = ResourceKind("kvm.cloud.sap", "v1", "hypervisors")
RESERVATIONS: Final = ResourceKind("cortex.cloud", "v1alpha1", "reservations")
COMMITTED_RESOURCES: Final = ResourceKind("cortex.cloud", "v1alpha1", "committedresources")
KNOWLEDGES: Final = ResourceKind("cortex.cloud", "v1alpha1", "knowledges")

# The four kinds by their object ``kind``: the one definition tools and tests use too.
RESOURCE_KINDS: Final[Mapping[str, ResourceKind]] = MappingProxyType(
    {
        "Hypervisor": HYPERVISORS,
        "Reservation": RESERVATIONS,
        "CommittedResource": COMMITTED_RESOURCES,
        "Knowledge": KNOWLEDGES,
    }
)

# Every (verb, kind) the service may call: what deploy/clusterrole.yaml grants, no more
# (tests/unit/test_k8s_metrics.py compares the two). The metrics create their
# refusal series for these at start (K8sMetrics.expect).
CALLS: Final[tuple[tuple[str, str], ...]] = (
    *((verb, kind.plural) for kind in RESOURCE_KINDS.values() for verb in ("get", "list", "watch")),
    ("patch", RESERVATIONS.plural),
)

CR_RESERVATION_SELECTOR: Final = f"{LABEL_RESERVATION_TYPE}={RESERVATION_TYPE_COMMITTED_RESOURCE}"


class _ListMeta(msgspec.Struct, frozen=True):
    resourceVersion: str | None = None  # the wire name: camelCase
    continue_: str | None = msgspec.field(default=None, name="continue")


class _ObjectList(msgspec.Struct, Generic[T], frozen=True):
    """A list response: only ``items`` and the paging metadata are decoded."""

    items: list[T] | None = None
    metadata: _ListMeta = msgspec.field(default_factory=_ListMeta)


class _StatusDetails(msgspec.Struct, frozen=True):
    name: str = ""


class _Status(msgspec.Struct, frozen=True):
    """The ``Status`` body of an error response or of a watch ERROR event."""

    code: int = 0
    message: str = ""
    reason: str = ""
    details: _StatusDetails = _StatusDetails()


class _Meta(msgspec.Struct, frozen=True):
    name: str = ""
    resourceVersion: str = ""  # the wire name: camelCase


class _MetaOnly(msgspec.Struct, frozen=True):
    metadata: _Meta = msgspec.field(default_factory=_Meta)


class _Event(msgspec.Struct, frozen=True):
    """One watch line; ``object`` stays raw until the type says how to decode it."""

    type: str = ""
    object: msgspec.Raw = msgspec.Raw(b"null")


_EVENT_DECODER: Final = msgspec.json.Decoder(_Event)
_STATUS_DECODER: Final = msgspec.json.Decoder(_Status)
_META_DECODER: Final = msgspec.json.Decoder(_MetaOnly)

EventType = Literal["ADDED", "MODIFIED", "DELETED", "BOOKMARK"]
_OBJECT_EVENTS: Final[Mapping[str, EventType]] = MappingProxyType(
    {"ADDED": "ADDED", "MODIFIED": "MODIFIED", "DELETED": "DELETED"}
)


@dataclass(frozen=True, slots=True)
class WatchEvent(Generic[T]):
    """One change a watch delivered.

    ``object`` is None for a BOOKMARK (only ``resource_version`` counts there) and for
    an object that does not decode into the model: the client's rule for those, in a
    LIST and a watch alike, is that the object counts as absent. ``name`` and
    ``resource_version`` are always the object's own.
    """

    type: EventType
    name: str
    resource_version: str
    object: T | None = None
    # An ADDED/MODIFIED object that did not decode: where it failed ("$" if unknown).
    undecodable_at: str | None = None


@dataclass(frozen=True, slots=True)
class ListResult(Generic[T]):
    """All items of a (paged) list and the resourceVersion to start a watch from."""

    items: list[T]
    resource_version: str
    # (name, decode error path) of the listed objects left out because they do not
    # decode into the model (the invariant monitor reports them).
    undecodable: tuple[tuple[str, str], ...] = ()


_LIST_TYPES: dict[type[Any], Any] = {}


def _list_type(item_type: type[T]) -> type[_ObjectList[T]]:
    # Parametrised once per item type so the decoder cache in service.model is hit.
    lt = _LIST_TYPES.get(item_type)
    if lt is None:
        lt = _LIST_TYPES[item_type] = _ObjectList.__class_getitem__(item_type)  # type: ignore[attr-defined]
    result: type[_ObjectList[T]] = lt
    return result


class _Call:
    """What the metric of one request records: its HTTP status, ``"error"`` if none came."""

    __slots__ = ("code",)

    def __init__(self) -> None:
        self.code: int | str = "error"


@contextlib.contextmanager
def mapped_errors(kind: ResourceKind, what: str) -> Iterator[None]:
    """Re-raise what the transport raises as the :class:`ApiError` it means.

    The one place that does: requests, the opening of a watch and the reading of its
    stream all go through here. Exceptions that are not transport failures (a bug)
    pass unchanged.
    """
    try:
        yield
    except ApiError:
        raise
    except Exception as exc:
        mapped = map_exception(exc, kind=kind.plural, what=what)
        if mapped is None:
            raise
        raise mapped from exc


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


def _explanation(status: _Status) -> str:
    """The API server's own explanation, bounded: never echo whole response bodies."""
    return (status.message or status.reason)[:_STATUS_MESSAGE_LIMIT]


def _token() -> str:
    """A fence token: random, so that each fence really changes the object."""
    return secrets.token_hex(8)


def _status_message(body: bytes) -> str:
    return _explanation(_status_of(body))


class KubeClient:
    """Typed reads and the one guarded write, with timeouts, metrics and mapped errors.

    Use :meth:`create` (kubeconfig or in-cluster) or :meth:`from_token`; close with
    :meth:`close` or ``async with``.
    """

    def __init__(
        self,
        api: Any,
        *,
        request_timeout_s: float = 10.0,
        metrics: K8sMetrics | None = None,
        max_writes: int = 0,
    ) -> None:
        if request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be positive")
        if max_writes < 0:
            raise ValueError("max_writes must be >= 0")
        self._api = api
        self._http = Transport(api)
        self._timeout = request_timeout_s
        self._metrics = metrics
        # Writes in flight at once (0: no limit). The API server's update path slows
        # down with the writes it has in flight (bench_latency.py at 200 events/s: its
        # etcd requests took 75-163 ms on average with up to 126 PATCHes in flight,
        # 31-39 ms with at most 8), so a replica catching up on a backlog of placements
        # should not pile them all onto an API server it shares with Cortex. It adds no
        # throughput (the service's latency did not change on the dev stack), hence off
        # by default. A write waits for its turn here, outside its deadline: the
        # deadline bounds the API server's answer, not this replica's own queue.
        self._writes = asyncio.Semaphore(max_writes) if max_writes else None
        if metrics is not None:
            metrics.expect(CALLS)

    # --- construction ---------------------------------------------------------------

    @classmethod
    async def create(
        cls,
        kubeconfig: str | None = None,
        *,
        request_timeout_s: float = 10.0,
        metrics: K8sMetrics | None = None,
        max_writes: int = 0,
    ) -> KubeClient:
        """Client from a kubeconfig file (argument, else ``$KUBECONFIG``), else in-cluster.

        In-cluster auth re-reads the projected service-account token when it rotates
        (kubernetes_asyncio's refresh hook), so long-running pods keep working.
        """
        cfg = k8s_client.Configuration()
        path = kubeconfig or os.environ.get("KUBECONFIG") or None
        if path:
            # persist_config=False: never rewrite the operator's kubeconfig file.
            await k8s_config.load_kube_config(
                config_file=path, client_configuration=cfg, persist_config=False
            )
        else:
            k8s_config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        return cls(
            k8s_client.ApiClient(configuration=cfg),
            request_timeout_s=request_timeout_s,
            metrics=metrics,
            max_writes=max_writes,
        )

    @classmethod
    def from_token(
        cls,
        server: str,
        ca_file: str | None,
        token: str,
        *,
        request_timeout_s: float = 10.0,
        metrics: K8sMetrics | None = None,
    ) -> KubeClient:
        """Client authenticating with a bearer token (e.g. a ServiceAccount token).

        Must be called with an event loop running (it opens an aiohttp session).
        ``ca_file`` None trusts the system CAs.
        """
        cfg = k8s_client.Configuration(host=server)
        cfg.ssl_ca_cert = ca_file
        cfg.api_key = {"BearerToken": token}
        cfg.api_key_prefix = {"BearerToken": "Bearer"}
        return cls(
            k8s_client.ApiClient(configuration=cfg),
            request_timeout_s=request_timeout_s,
            metrics=metrics,
        )

    async def close(self) -> None:
        await self._api.close()

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def api_client(self) -> Any:
        """The underlying kubernetes_asyncio ApiClient (for tools and tests)."""
        return self._api

    @property
    def request_timeout_s(self) -> float:
        return self._timeout

    @property
    def metrics(self) -> K8sMetrics | None:
        return self._metrics

    # --- typed API ------------------------------------------------------------------

    async def list_hypervisors(self, *, limit: int = DEFAULT_PAGE_SIZE) -> list[Hypervisor]:
        return (await self.list_objects(HYPERVISORS, Hypervisor, limit=limit)).items

    async def list_reservations(self, *, limit: int = DEFAULT_PAGE_SIZE) -> list[Reservation]:
        """Committed-resource Reservations only (server-side label selector)."""
        result = await self.list_objects(
            RESERVATIONS, Reservation, label_selector=CR_RESERVATION_SELECTOR, limit=limit
        )
        return result.items

    async def list_committed_resources(
        self, *, limit: int = DEFAULT_PAGE_SIZE
    ) -> list[CommittedResource]:
        return (await self.list_objects(COMMITTED_RESOURCES, CommittedResource, limit=limit)).items

    async def probe_list(self, kind: ResourceKind) -> None:
        """One list request of at most one object: is ``kind`` served and readable?

        Unlike the typed lists it never follows continue tokens, so it costs one round
        trip however many objects exist (``crs-consumer check``).
        """
        await self._list_page(kind, {"limit": 1})

    async def get_knowledge(self, name: str = "flavor-groups") -> Knowledge | None:
        """The Knowledge object, None when it does not exist."""
        try:
            return await self.get_object(KNOWLEDGES, name, Knowledge)
        except NotFoundError:
            return None

    async def get_reservation(self, name: str) -> Reservation | None:
        """A fresh read of one Reservation, None when it does not exist."""
        try:
            return await self.get_object(RESERVATIONS, name, Reservation)
        except NotFoundError:
            return None

    async def fence_reservation(self, reservation: Reservation) -> Reservation:
        """A guarded merge patch that sets only :data:`FENCE_ANNOTATION` to a new token.

        The point is the new resourceVersion it gives the object (a patch that changed
        nothing would keep the old one): every write still in flight that was guarded by
        an older version now fails its precondition. Cortex reads no annotation of ours.
        Raises ConflictError (409) or NotFoundError (404).
        """
        name = reservation.name
        rv = reservation.metadata.resource_version
        if not name or not rv:
            raise ValueError("fence_reservation needs a Reservation read from the API server")
        body = {"metadata": {"resourceVersion": rv, "annotations": {FENCE_ANNOTATION: _token()}}}
        return await self._merge_patch(name, body)

    async def patch_allocation(
        self,
        reservation: Reservation,
        instance_uuid: str,
        allocation: dict[str, object],
    ) -> Reservation:
        """Add one allocation with a merge patch guarded by the resourceVersion read.

        The API server compares ``metadata.resourceVersion`` in a merge patch with the
        stored one and answers 409 on a mismatch (what controller-runtime's
        ``MergeFromWithOptimisticLock`` does): the write lands only on the exact version
        the caller decided on. Raises ConflictError (409) or NotFoundError (404).
        """
        name = reservation.name
        rv = reservation.metadata.resource_version
        if not name or not rv:
            raise ValueError("patch_allocation needs a Reservation read from the API server")
        body = {
            "metadata": {"resourceVersion": rv},
            "spec": {"committedResourceReservation": {"allocations": {instance_uuid: allocation}}},
        }
        return await self._merge_patch(name, body)

    async def _merge_patch(self, name: str, body: dict[str, Any]) -> Reservation:
        raw = await self._request(
            "patch", RESERVATIONS, name, body=msgspec.json.encode(body), content_type=MERGE_PATCH
        )
        return self._decode_one(raw, Reservation, RESERVATIONS, name)

    # --- generic API ----------------------------------------------------------------

    async def get_object(self, kind: ResourceKind, name: str, type_: type[T]) -> T:
        """One object decoded into ``type_``; raises NotFoundError when it is absent."""
        raw = await self._request("get", kind, name)
        return self._decode_one(raw, type_, kind, name)

    async def list_objects(
        self,
        kind: ResourceKind,
        type_: type[T],
        *,
        label_selector: str | None = None,
        limit: int = DEFAULT_PAGE_SIZE,
    ) -> ListResult[T]:
        """All objects of ``kind``, read in pages of ``limit`` (one consistent snapshot).

        Pages after the first are served from the first page's snapshot; if the continue
        token expires (410) the whole list restarts, because mixing snapshots would break
        the "one consistent view" the evaluator relies on.
        """
        if limit <= 0:
            raise ValueError("limit must be positive")
        restarts = 0
        while True:
            items: list[T] = []
            skipped: list[tuple[str, str]] = []
            token: str | None = None
            try:
                while True:
                    query: dict[str, str | int | bool] = {"limit": limit}
                    if label_selector:
                        query["labelSelector"] = label_selector
                    if token:
                        query["continue"] = token
                    raw = await self._list_page(kind, query)
                    page = self._decode_list(raw, type_, kind, skipped)
                    if page.items:
                        items.extend(page.items)
                    token = page.metadata.continue_
                    if not token:
                        rv = page.metadata.resourceVersion or ""
                        return ListResult(items, rv, tuple(skipped))
            except UnavailableError as exc:
                if exc.status != 410 or token is None or restarts >= _MAX_LIST_RESTARTS:
                    raise
                restarts += 1
                _log.warning("list continue token expired, restarting", kind=kind.plural)
            except NotFoundError as exc:
                # A collection is never absent: a 404 means the kind is not served (its
                # CRD not installed yet, or not registered again after an API server
                # restart). Waiting can fix that, so it is an outage, not the event's fault.
                raise UnavailableError(
                    f"{exc} (kind not served)", status=404, kind=kind.plural
                ) from exc

    def watch(
        self,
        kind: ResourceKind,
        type_: type[Obj],
        *,
        resource_version: str = "",
        label_selector: str | None = None,
        timeout_s: int = 300,
    ) -> WatchStream[Obj]:
        """A WATCH of ``kind`` from ``resource_version``, bookmarks on; see WatchStream.

        ``timeout_s`` is the server-side ``timeoutSeconds``: the server ends the stream
        after it, which is the caller's cue to watch again.
        """
        params: dict[str, str | int | bool] = {
            "watch": True,
            "allowWatchBookmarks": True,
            "timeoutSeconds": timeout_s,
        }
        if resource_version:
            params["resourceVersion"] = resource_version
        if label_selector:
            params["labelSelector"] = label_selector
        return WatchStream(self, kind, type_, params)

    # --- plumbing -------------------------------------------------------------------

    async def _list_page(self, kind: ResourceKind, query: Query) -> bytes:
        """One LIST request (one page): the raw response body."""
        return await self._request("list", kind, "", query=query)

    async def _request(
        self,
        verb: str,
        kind: ResourceKind,
        name: str,
        *,
        query: Query | None = None,
        body: bytes | None = None,
        content_type: str = JSON,
    ) -> bytes:
        """Run one API call with a deadline; return the 2xx body or raise an ApiError."""
        what = f"{verb} {kind.plural}/{name}" if name else f"{verb} {kind.plural}"
        turn = self._writes if self._writes is not None and verb in _WRITES else _NO_WAIT
        async with turn:
            # Told when the request leaves, after any wait for a write slot: the engine
            # opens the partition's next transaction on it (service.crs.ports).
            if (hook := API_REQUEST_HOOK.get()) is not None:
                hook()
            with self._call(verb, kind, what) as call:
                # aiohttp's own total timeout covers connect + headers + body; the outer
                # deadline also bounds auth-hook and DNS work done before the request.
                async with asyncio.timeout(self._timeout):
                    resp = await self._http.open(
                        _METHODS[verb],
                        Transport.path(kind.group, kind.version, kind.plural, name),
                        query=query,
                        body=body,
                        content_type=content_type,
                        deadlines=aiohttp.ClientTimeout(total=self._timeout),
                    )
                    try:
                        answer: bytes = await resp.read()
                    finally:
                        resp.release()
                    call.code = status = int(resp.status)
        if not 200 <= status < 300:
            found = _status_of(answer)
            if status == 404 and name and found.details.name != name:
                # The object is gone only when the Status says so by naming it. Without
                # that the *kind* is not served: an API server registering its CRDs after
                # a restart, a version no longer served (or a 404 from something in
                # between). Waiting can fix that; taking it for a deleted slot ended a
                # placement no_slot for good (a collection's 404 is handled alike in
                # list_objects).
                raise UnavailableError(
                    f"{what}: {_explanation(found)} (kind not served) (HTTP 404)",
                    status=status,
                    kind=kind.plural,
                )
            raise error_for_status(status, f"{what}: {_explanation(found)}", kind=kind.plural)
        return answer

    @contextlib.contextmanager
    def _call(self, verb: str, kind: ResourceKind, what: str) -> Iterator[_Call]:
        """One request's bookkeeping: errors mapped, and counted once however it ends.

        The body sets ``call.code`` to the HTTP status once it has one; a request that
        fails before that is counted with the status of its error, else as ``"error"``.
        """
        call = _Call()
        started = time.monotonic()
        try:
            with mapped_errors(kind, what):
                yield call
        except ApiError as exc:
            if call.code == "error" and exc.status:
                call.code = exc.status
            raise
        finally:
            if self._metrics is not None:
                self._metrics.observe(verb, kind.plural, call.code, time.monotonic() - started)

    def _decode_one(self, raw: bytes, type_: type[T], kind: ResourceKind, name: str) -> T:
        try:
            return from_k8s(raw, type_)
        except DecodeError as exc:
            # The server's object does not fit our model: not retryable, say where.
            raise error_for_status(
                422, f"decode {kind.plural}/{name} failed at {exc.path}: {exc}", kind=kind.plural
            ) from exc

    def _decode_list(
        self,
        raw: bytes,
        type_: type[T],
        kind: ResourceKind,
        skipped: list[tuple[str, str]] | None = None,
    ) -> _ObjectList[T]:
        """One page; ``skipped`` gets (name, path) of each item that does not decode."""
        try:
            return from_k8s(raw, _list_type(type_))
        except DecodeError:
            pass
        # Slow path: one bad object must not blind the service to all the others. Decode
        # item by item and skip (and log) the ones that do not fit.
        try:
            rough = from_k8s(raw, _list_type(msgspec.Raw))
        except DecodeError as exc:
            raise error_for_status(
                422, f"decode {kind.plural} list failed: {exc}", kind=kind.plural
            ) from exc
        good: list[T] = []
        for item in rough.items or ():
            try:
                good.append(from_k8s(bytes(item), type_))
            except DecodeError as exc:
                name = _meta_of(bytes(item)).name
                if skipped is not None:
                    skipped.append((name, exc.path or "$"))
                _log.warning(
                    "skipping undecodable object",
                    kind=kind.plural,
                    name=name,
                    path=exc.path,
                    error=str(exc)[:_STATUS_MESSAGE_LIMIT],
                )
        return _ObjectList(items=good, metadata=rough.metadata)


class WatchStream(Generic[Obj]):
    """One watch request: ``async with client.watch(...) as events: async for e in events``.

    Entering sends the request and waits for the response headers (within the request
    timeout); that is when the request is counted, as verb ``watch``: the stream's
    lifetime is not a request latency and would only blur the duration histogram. An
    answer other than 200 raises (410 Gone as ResourceExpiredError). The events end when
    the server ends the stream; an ERROR event (410 again as ResourceExpiredError), a
    torn line or a broken connection raise an ApiError. Leaving closes the connection.

    There is no read deadline: a healthy stream may stay quiet between bookmarks, and how
    long is too long is the caller's call.
    """

    def __init__(
        self, client: KubeClient, kind: ResourceKind, type_: type[Obj], params: Query
    ) -> None:
        self._client = client
        self._kind = kind
        self._type = type_
        self._params = params
        self._what = f"watch {kind.plural}"
        self._resp: Any = None
        self._events: AsyncGenerator[WatchEvent[Obj], None] | None = None

    async def __aenter__(self) -> AsyncIterator[WatchEvent[Obj]]:
        client, kind, what = self._client, self._kind, self._what
        request_timeout = client.request_timeout_s
        # No total deadline (the stream is long-lived) and no read deadline (see above).
        timeout = aiohttp.ClientTimeout(
            total=None, connect=request_timeout, sock_connect=request_timeout
        )
        with client._call("watch", kind, what) as call:
            async with asyncio.timeout(request_timeout):
                resp = await client._http.open(
                    "GET",
                    Transport.path(kind.group, kind.version, kind.plural),
                    query=self._params,
                    deadlines=timeout,
                )
            call.code = code = int(resp.status)
        if code != 200:
            body = b""
            try:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(request_timeout):
                        body = await resp.read()
            finally:
                resp.close()
            message = f"{what}: {_status_message(body)}"
            if code == 410:
                raise ResourceExpiredError(message, status=410, kind=kind.plural)
            raise error_for_status(code, message, kind=kind.plural)
        self._resp = resp
        self._events = events = self._read(resp)
        return events

    async def __aexit__(self, *exc_info: object) -> None:
        events, self._events = self._events, None
        resp, self._resp = self._resp, None
        try:
            if events is not None:
                await events.aclose()
        finally:
            if resp is not None:
                resp.close()

    async def _read(self, resp: Any) -> AsyncGenerator[WatchEvent[Obj], None]:
        """Split the chunked body into lines and decode each as it completes."""
        buf = bytearray()
        with mapped_errors(self._kind, self._what):
            async for chunk in resp.content.iter_any():
                buf += chunk
                end = buf.rfind(b"\n")
                if end < 0:
                    continue
                block = bytes(buf[:end])
                del buf[: end + 1]
                # Every complete line of a chunk is handed over before the next read
                # awaits, so a burst of events reaches the caller as one step.
                for line in block.split(b"\n"):
                    if line.strip() and (event := self._decode(line)) is not None:
                        yield event
            if buf.strip() and (event := self._decode(bytes(buf))) is not None:
                yield event

    def _decode(self, line: bytes) -> WatchEvent[Obj] | None:
        plural = self._kind.plural
        try:
            event = _EVENT_DECODER.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            # A torn stream: watching again from the last good resourceVersion repairs it.
            raise UnavailableError(f"{self._what}: undecodable line: {exc}", kind=plural) from exc
        etype = event.type
        raw = memoryview(event.object)
        if etype == "BOOKMARK":
            return WatchEvent("BOOKMARK", "", _meta_of(raw).resourceVersion)
        if etype == "ERROR":
            status = _status_of(raw)
            message = f"{self._what}: {_explanation(status)}"
            if status.code == 410 or status.reason in ("Expired", "Gone"):
                raise ResourceExpiredError(message, status=410, kind=plural)
            raise error_for_status(status.code or 500, message, kind=plural)
        etype_ = _OBJECT_EVENTS.get(etype)
        if etype_ is None:
            _log.debug("watch_event_ignored", kind=plural, type=etype[:_STATUS_MESSAGE_LIMIT])
            return None
        try:
            obj = from_k8s(raw, self._type)
        except DecodeError as exc:
            # Same rule as a LIST (which skips undecodable items): the object counts as
            # absent rather than being kept at a stale version.
            meta = _meta_of(raw)
            _log.warning(
                "skipping_undecodable_object",
                kind=plural,
                name=meta.name,
                resource_version=meta.resourceVersion,
                path=exc.path,
                error=str(exc)[:_STATUS_MESSAGE_LIMIT],
            )
            if etype_ == "DELETED":
                return WatchEvent(etype_, meta.name, meta.resourceVersion)
            return WatchEvent(etype_, meta.name, meta.resourceVersion, None, exc.path or "$")
        meta_ = obj.metadata
        return WatchEvent(etype_, meta_.name or "", meta_.resource_version or "", obj)
