"""An in-memory :class:`~service.crs.ports.ClusterState` for fast unit tests of the Recorder.

It keeps the four kinds as API-server JSON and enforces what the Recorder relies on from
the real server: every write bumps a cluster-wide ``resourceVersion``, a patch guarded by
a stale ``resourceVersion`` is rejected with :class:`ConflictError` (409), a patch of a
deleted object with :class:`NotFoundError` (404), and every read returns fresh objects
(decoded anew, like a list or get response). Reads are label-selected and filtered like
:class:`~service.k8s.ListClusterState`'s, so a unit test decides on what list mode would
see. Each behaviour tested on this fake is also tested end to end against the real API
server (tests/integration/test_recorder.py).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from typing import Any

from service.crs.evaluator import SlotEvaluator
from service.crs.flavors import FLAVOR_GROUPS_KNOWLEDGE_NAME
from service.crs.ports import (
    ApiError,
    ClusterState,
    ConflictError,
    NotFoundError,
    Snapshot,
)
from service.model import (
    LABEL_RESERVATION_TYPE,
    RESERVATION_TYPE_COMMITTED_RESOURCE,
    CommittedResource,
    Hypervisor,
    Knowledge,
    Reservation,
    from_k8s,
)

__all__ = ["InMemoryClusterState", "merge_patch"]

# A hook run inside patch_allocation before the write is checked: (reservation the caller
# decided on, number of this patch call starting at 1).
BeforePatch = Callable[[Reservation, int], Awaitable[None]]


def merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """Apply a JSON merge patch (RFC 7386) to ``target`` in place: null deletes a key."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            merge_patch(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class InMemoryClusterState(ClusterState):
    """Hypervisors, Reservations, CommittedResources and Knowledges held in memory.

    Test set-up and "other writers" use :meth:`put`, :meth:`patch` and :meth:`delete`
    (no guard, like an admin client); the Recorder uses the port. ``before_patch`` lets a
    test act between the Recorder's read and its write; ``read_error`` makes every read
    fail with that error. ``calls`` counts port calls by name, ``patch_results`` the
    outcomes of ``patch_allocation`` (``"200"``, ``"409"``, ``"404"``).
    ``resource_version`` is the cluster's latest (what a LIST would report).
    """

    def __init__(self) -> None:
        self._objects: dict[tuple[str, str], dict[str, Any]] = {}
        self._revision = itertools.count(1)
        self._uids = itertools.count(1)
        self.before_patch: BeforePatch | None = None
        self.read_error: ApiError | None = None
        self.calls: Counter[str] = Counter()
        self.patch_results: Counter[str] = Counter()
        self.fence_results: Counter[str] = Counter()
        self.resource_version = "0"
        self._patches = 0

    # --- set-up and other writers ---------------------------------------------------

    def put(self, *objects: dict[str, Any]) -> None:
        """Create or replace objects (status included), each with a new resourceVersion."""
        for obj in objects:
            stored = copy.deepcopy(obj)
            meta = stored.setdefault("metadata", {})
            old = self._objects.get((stored["kind"], meta["name"]))
            meta["uid"] = old["metadata"]["uid"] if old else f"uid-{next(self._uids)}"
            self._bump(stored)
            self._objects[(stored["kind"], meta["name"])] = stored

    def patch(self, kind: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """An unguarded merge patch (another writer); raises NotFoundError if absent."""
        stored = self._get(kind, name)
        merge_patch(stored, patch)
        self._bump(stored)
        return copy.deepcopy(stored)

    def delete(self, kind: str, name: str) -> None:
        self._get(kind, name)
        del self._objects[(kind, name)]

    def stored(self, kind: str, name: str) -> dict[str, Any] | None:
        """A copy of the stored JSON, None when absent."""
        obj = self._objects.get((kind, name))
        return copy.deepcopy(obj) if obj is not None else None

    def listed(self, kind: str, type_: type[Any], label_selector: str | None = None) -> list[Any]:
        """Objects of ``kind`` decoded into ``type_``, in name order, as a LIST returns them;
        ``label_selector`` is one ``key=value`` (the only form the service sends)."""
        items = self._decoded(kind, type_)
        if not label_selector:
            return list(items)
        key, _, value = label_selector.partition("=")
        return [o for o in items if (o.metadata.labels or {}).get(key) == value]

    # --- ClusterState -----------------------------------------------------------------

    async def snapshot(self, hosts: Collection[str], project_id: str) -> Snapshot:
        """Everything, as ListClusterState reads it (the evaluator covers every host)."""
        self.calls["snapshot"] += 1
        await self._read()
        knowledge = self._objects.get(("Knowledge", FLAVOR_GROUPS_KNOWLEDGE_NAME))
        return Snapshot(
            evaluator=SlotEvaluator.from_objects(
                self._decoded("Hypervisor", Hypervisor), self._cr_reservations()
            ),
            committed_resources=list(self._decoded("CommittedResource", CommittedResource)),
            knowledge=from_k8s(knowledge, Knowledge) if knowledge is not None else None,
        )

    async def reservations_on_host(self, host: str) -> Sequence[Reservation]:
        self.calls["reservations_on_host"] += 1
        await self._read()
        return [r for r in self._cr_reservations() if r.spec.target_host == host]

    async def get_reservation(self, name: str) -> Reservation | None:
        self.calls["get_reservation"] += 1
        await self._read()
        obj = self._objects.get(("Reservation", name))
        return from_k8s(obj, Reservation) if obj is not None else None

    async def fence_reservation(self, reservation: Reservation) -> Reservation:
        """The guarded fence: a new resourceVersion, nothing else that a slot means."""
        self.calls["fence_reservation"] += 1
        await asyncio.sleep(0)  # a request is a suspension point
        stored = self._guarded(reservation, self.fence_results)
        self._bump(stored)
        self.fence_results["200"] += 1
        return from_k8s(stored, Reservation)

    async def patch_allocation(
        self, reservation: Reservation, instance_uuid: str, allocation: dict[str, object]
    ) -> Reservation:
        self.calls["patch_allocation"] += 1
        self._patches += 1
        name, rv = reservation.name, reservation.metadata.resource_version
        if not name or not rv:
            raise ValueError("patch_allocation needs a Reservation read from the cluster")
        if self.before_patch is not None:
            await self.before_patch(reservation, self._patches)
        await asyncio.sleep(0)  # a request is a suspension point
        # From here on no await: the check and the write are one atomic step, as in etcd.
        stored = self._guarded(reservation, self.patch_results)
        patch = {
            "spec": {"committedResourceReservation": {"allocations": {instance_uuid: allocation}}}
        }
        merge_patch(stored, patch)
        self._bump(stored)
        self.patch_results["200"] += 1
        return from_k8s(stored, Reservation)

    # --- internals ------------------------------------------------------------------

    def _guarded(self, reservation: Reservation, results: Counter[str]) -> dict[str, Any]:
        """The stored object a write guarded by ``reservation``'s resourceVersion may
        change, or the API server's 404 / 409 (counted in ``results``)."""
        name = reservation.name
        stored = self._objects.get(("Reservation", name))
        if stored is None:
            results["404"] += 1
            raise NotFoundError(f"reservations {name!r} not found", status=404, kind="reservations")
        if stored["metadata"]["resourceVersion"] != reservation.metadata.resource_version:
            results["409"] += 1
            raise ConflictError(
                f"reservations {name!r}: the object has been modified",
                status=409,
                kind="reservations",
            )
        return stored

    def _bump(self, stored: dict[str, Any]) -> None:
        self.resource_version = stored["metadata"]["resourceVersion"] = str(next(self._revision))

    def _get(self, kind: str, name: str) -> dict[str, Any]:
        obj = self._objects.get((kind, name))
        if obj is None:
            raise NotFoundError(f"{kind} {name!r} not found", status=404, kind=kind)
        return obj

    async def _read(self) -> None:
        await asyncio.sleep(0)  # a read is a suspension point too
        if self.read_error is not None:
            raise self.read_error

    def _decoded(self, kind: str, type_: type[Any]) -> Iterable[Any]:
        # Name order, as the API server lists.
        return [from_k8s(obj, type_) for (k, _), obj in sorted(self._objects.items()) if k == kind]

    def _cr_reservations(self) -> list[Reservation]:
        """The label-selected list ListClusterState reads."""
        return [
            r
            for r in self._decoded("Reservation", Reservation)
            if (r.metadata.labels or {}).get(LABEL_RESERVATION_TYPE)
            == RESERVATION_TYPE_COMMITTED_RESOURCE
        ]
