""":class:`~service.crs.ports.ClusterState` in watch mode (``CRS_K8S_READ_MODE=watch``).

List mode reads every Reservation of the cluster for every event. Here four
:class:`~service.k8s.informer.Informer` s keep the cluster in memory and feed each change
into :class:`~service.k8s.indexes.ClusterIndexes`, which keep exactly what a request
needs (free memory per hypervisor, CR slots per host, CommittedResources per project, the
``flavor-groups`` Knowledge). A request then costs O(hosts it names) and no API call.

Consistency and freshness:

* **One snapshot, one state.** :meth:`WatchClusterState.snapshot` copies what it needs
  from the indexes without an ``await``; handlers also run without one, so a snapshot
  never mixes two states of the cluster.
* **Read-your-writes.** :meth:`~WatchClusterState.patch_allocation` applies the object
  the server returned to the cache at once (newer resourceVersion wins), so the next
  event deciding on the same slot sees the allocation even if the watch lags.
* **Conflicts read the API.** :meth:`~WatchClusterState.get_reservation` and
  :meth:`~WatchClusterState.reservations_on_host` run only after a 409/404, i.e. exactly
  when the cache is known to be behind the server; they read fresh from the API (at
  least as new as anything the server returned before) and feed the result back into
  the cache. Simpler than waiting for the watch to reach an unknown resourceVersion.
  Both GET by name (the host's names come from the cache): never a LIST of every
  Reservation per lost race.
* **Never answer from a partial cache.** Before the first LIST of every kind is applied,
  a request waits (bounded by ``sync_timeout_s``) and then raises
  :class:`~service.crs.ports.UnavailableError`; so does a request while a watch has been
  down for longer than ``stale_after_s`` (list mode would fail outright then, too).

Known differences from list mode, both deliberate: during a watch outage requests are
answered from the cache for up to ``stale_after_s`` instead of failing at once; and an
undecodable ``flavor-groups`` Knowledge (impossible under the CRD schema) reads as
absent (None, a lookup error for the Recorder) instead of raising InvalidError.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Sequence
from typing import Any, Final

import structlog

from service.crs.flavors import FLAVOR_GROUPS_KNOWLEDGE_NAME
from service.crs.invariants import DEFAULT_GRACE_S, InvariantIndex
from service.crs.ports import ClusterState, Snapshot, UnavailableError
from service.k8s.client import (
    COMMITTED_RESOURCES,
    CR_RESERVATION_SELECTOR,
    DEFAULT_PAGE_SIZE,
    HYPERVISORS,
    KNOWLEDGES,
    RESERVATIONS,
    KubeClient,
)
from service.k8s.indexes import ClusterIndexes
from service.k8s.informer import Informer, InformerOptions, ListWatch
from service.model import (
    LABEL_RESERVATION_TYPE,
    RESERVATION_TYPE_COMMITTED_RESOURCE,
    CommittedResource,
    Hypervisor,
    Knowledge,
    Reservation,
)
from service.tasks import all_or_none

__all__ = ["WatchClusterState"]

_log = structlog.get_logger(__name__)

_DEFAULT_STALE_AFTER_S: Final = 30.0


def _is_cr_reservation(r: Reservation) -> bool:
    """The server-side label selector, re-checked for objects that come from writes."""
    labels = r.metadata.labels
    return labels is not None and labels.get(LABEL_RESERVATION_TYPE) == (
        RESERVATION_TYPE_COMMITTED_RESOURCE
    )


def _is_flavor_groups(k: Knowledge) -> bool:
    return k.metadata.name == FLAVOR_GROUPS_KNOWLEDGE_NAME


class WatchClusterState(ClusterState):
    """Informer-backed cluster state with incrementally maintained per-request indexes.

    ``sync_timeout_s`` (default: the client's request timeout) bounds how long a request
    waits for the initial sync; ``stale_after_s`` is how long a watch may be down (while
    it reconnects) before requests fail and :meth:`ready` reports it;
    ``silence_bound_s`` is how long a watch may deliver nothing at all (no event, no
    bookmark, no renewal) before :meth:`ready` reports it. ``invariant_grace_s`` is the
    grace of :attr:`invariants` (the allocation invariant monitor, see
    :mod:`service.crs.invariants`). The informers list and watch
    through ``transport`` (default: ``client``); fresh reads and writes always go
    through ``client``.
    """

    def __init__(
        self,
        client: KubeClient,
        *,
        page_size: int = DEFAULT_PAGE_SIZE,
        # Short renewals: each one is a sign of life, so a healthy watch on a quiet kind
        # is never silent longer than ~18 s and a frozen API server shows within
        # stale_after_s; the idle limit then drops the half-open connection.
        watch_timeout_s: float = 15.0,
        idle_timeout_s: float = 30.0,
        sync_timeout_s: float | None = None,
        stale_after_s: float = _DEFAULT_STALE_AFTER_S,
        silence_bound_s: float = _DEFAULT_STALE_AFTER_S,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
        transport: ListWatch | None = None,
        invariant_grace_s: float = DEFAULT_GRACE_S,
    ) -> None:
        self._client = client
        self._page_size = page_size
        self._sync_timeout_s = (
            sync_timeout_s if sync_timeout_s is not None else client.request_timeout_s
        )
        self._stale_after_s = stale_after_s
        self._silence_bound_s = silence_bound_s
        self._started = False
        # The first sync is logged once, not by every request that waited for it.
        self._sync_logged = False

        self._indexes = ClusterIndexes()
        indexes = self._indexes
        # The read-only allocation invariant monitor, fed every CR Reservation change
        # (O(that object's allocations) each; the runtime ticks it and exports it).
        self.invariants = InvariantIndex(grace_s=invariant_grace_s)
        # Names of the cached CR Reservations by spec.targetHost, Ready or not: which
        # objects reservations_on_host reads fresh.
        self._names_by_host: dict[str, set[str]] = {}

        opts = InformerOptions(
            page_size=page_size,
            watch_timeout_s=watch_timeout_s,
            idle_timeout_s=idle_timeout_s,
            backoff_base_s=backoff_base_s,
            backoff_max_s=backoff_max_s,
        )
        source = transport if transport is not None else client
        self.hypervisors: Informer[Hypervisor] = Informer(
            source, HYPERVISORS, Hypervisor, on_change=indexes.on_hypervisor, options=opts
        )
        self.reservations: Informer[Reservation] = Informer(
            source,
            RESERVATIONS,
            Reservation,
            on_change=self._on_reservation,
            label_selector=CR_RESERVATION_SELECTOR,
            keep=_is_cr_reservation,
            on_undecodable=self.invariants.undecodable,
            options=opts,
        )
        self.committed_resources: Informer[CommittedResource] = Informer(
            source,
            COMMITTED_RESOURCES,
            CommittedResource,
            on_change=indexes.on_committed_resource,
            options=opts,
        )
        # Knowledges are few; listing them all and keeping one is simpler than a
        # field-selected watch the client's LIST cannot mirror.
        self.knowledges: Informer[Knowledge] = Informer(
            source,
            KNOWLEDGES,
            Knowledge,
            on_change=indexes.on_knowledge,
            keep=_is_flavor_groups,
            options=opts,
        )
        # Lifecycle and health only touch the kind-independent part of an informer.
        self._informers: tuple[Informer[Any], ...] = (
            self.hypervisors,
            self.reservations,
            self.committed_resources,
            self.knowledges,
        )

    def _on_reservation(self, old: Reservation | None, new: Reservation | None) -> None:
        self._indexes.on_reservation(old, new)
        self.invariants.update(old, new)
        by_host = self._names_by_host
        if old is not None:
            names = by_host.get(old.spec.target_host)
            if names is not None:
                names.discard(old.name)
                if not names:
                    del by_host[old.spec.target_host]
        if new is not None:
            by_host.setdefault(new.spec.target_host, set()).add(new.name)

    # --- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Start the four informers; returns at once (use :meth:`wait_synced` to wait)."""
        for informer in self._informers:
            informer.start()
        self._started = True
        _log.info("watch_cache_started", kinds=[i.kind.plural for i in self._informers])

    async def wait_synced(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """Wait until every informer has applied its first LIST; False on timeout."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                for informer in self._informers:
                    await informer.wait_synced()
        except TimeoutError:
            return False
        if not self._sync_logged:
            self._sync_logged = True
            _log.info("watch_cache_synced", seconds=round(time.monotonic() - started, 3))
        return True

    @property
    def has_synced(self) -> bool:
        return all(i.has_synced for i in self._informers)

    @property
    def informers(self) -> tuple[Informer[Any], ...]:
        return self._informers

    def ready(self) -> tuple[bool, str]:
        """(ready, detail): every kind synced and its watch up or reconnecting in grace."""
        if not self._started:
            return False, "watch cache not started"
        problems = self._problems()
        # Readiness only: a silent watch (e.g. a frozen API server behind a half-open
        # connection) still has a cache worth serving from until it is known down.
        for informer in self._informers:
            silent = informer.silent_for()
            if informer.has_synced and silent > self._silence_bound_s:
                problems.append(f"{informer.kind.plural}: watch silent for {silent:.0f}s")
        if problems:
            return False, "; ".join(problems)
        return True, "watch cache synced"

    async def stop(self) -> None:
        self._started = False
        await asyncio.gather(*(i.stop() for i in self._informers))
        _log.info("watch_cache_stopped")

    def _problems(self) -> list[str]:
        problems = []
        for informer in self._informers:
            name = informer.kind.plural
            if not informer.has_synced:
                problems.append(f"{name}: not synced ({informer.last_error or 'listing'})")
                continue
            down = informer.down_for()
            if down > self._stale_after_s:
                problems.append(f"{name}: watch down for {down:.0f}s ({informer.last_error})")
        return problems

    # --- ClusterState ---------------------------------------------------------------

    async def snapshot(self, hosts: Collection[str], project_id: str) -> Snapshot:
        """The request's hosts and project, copied from the indexes in one synchronous step.

        The evaluator covers exactly ``hosts``; ``committed_resources`` are the project's.
        Raises UnavailableError before the initial sync (after waiting for it) or while
        a watch has been down longer than ``stale_after_s``.
        """
        if not all(i.connected and i.has_synced for i in self._informers):  # else none is stale
            if not self.has_synced:
                await self._wait_for_sync()
            problems = self._problems()
            if problems:
                raise UnavailableError("watch cache stale: " + "; ".join(problems))
        # No await from here on: one consistent view of the cluster.
        return self._indexes.snapshot(hosts, project_id)

    async def _wait_for_sync(self) -> None:
        if await self.wait_synced(self._sync_timeout_s):
            return
        pending = [i.kind.plural for i in self._informers if not i.has_synced]
        raise UnavailableError(
            f"watch cache not synced after {self._sync_timeout_s:g}s: {', '.join(pending)}"
        )

    async def reservations_on_host(self, host: str) -> Sequence[Reservation]:
        """Fresh API reads (only used after a conflict), also fed back into the cache.

        Every CR Reservation the cache holds on ``host`` is read with a GET, Ready or not
        (one that just became Ready may not show as such here yet), in name order as a
        LIST returns them. Not a LIST: it would read every CR Reservation of the cluster
        (tens of thousands) for each lost race. The cost is one of freshness: a
        Reservation created on or moved onto ``host`` that the watch has not delivered
        yet is not read, so it is not chosen this time; the write guard is unaffected.
        """
        names = sorted(self._names_by_host.get(host, ()))
        # Not gather: one failed read cancels the rest.
        fresh = await all_or_none([self.get_reservation(n) for n in names])
        return [r for r in fresh if r is not None and r.spec.target_host == host]

    async def get_reservation(self, name: str) -> Reservation | None:
        """A fresh API read (only used after a conflict), also fed back into the cache."""
        fresh = await self._client.get_reservation(name)
        if fresh is not None:
            self.reservations.apply(fresh)
        return fresh

    async def fence_reservation(self, reservation: Reservation) -> Reservation:
        """The guarded fence, its answer applied to the cache (a fresh read, in effect)."""
        fenced = await self._client.fence_reservation(reservation)
        self.reservations.apply(fenced)
        return fenced

    async def patch_allocation(
        self,
        reservation: Reservation,
        instance_uuid: str,
        allocation: dict[str, object],
    ) -> Reservation:
        """The guarded write, then the server's answer applied to the cache at once."""
        updated = await self._client.patch_allocation(reservation, instance_uuid, allocation)
        applied = self.reservations.apply(updated)
        _log.debug(
            "allocation_applied_to_cache",
            kind=RESERVATIONS.plural,
            reservation=updated.name,
            resource_version=updated.metadata.resource_version,
            applied=applied,
        )
        return updated
