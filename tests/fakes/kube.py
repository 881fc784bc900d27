"""The part of :class:`~service.k8s.KubeClient` a watch cache uses, over the in-memory cluster.

:class:`FakeKube` serves an :class:`~tests.fakes.cluster_state.InMemoryClusterState` the
way the API server would serve the watch cache: a LIST is one snapshot at the cluster's
latest resourceVersion, a WATCH stays open and delivers nothing (the cache then learns
only from its own writes and fresh reads, the worst case for a lagging watch), GET and
the guarded PATCH are the fake's. ``lists`` counts LIST calls by plural, so a test can
assert that a code path never lists.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from service.k8s.client import RESOURCE_KINDS, ListResult, ResourceKind, WatchEvent
from service.model import Reservation
from tests.fakes.cluster_state import InMemoryClusterState

__all__ = ["FakeKube"]

L = TypeVar("L")

_KIND_OF_PLURAL = {k.plural: kind for kind, k in RESOURCE_KINDS.items()}


class FakeKube:
    """LIST, a silent WATCH, GET and PATCH of Reservations over ``cluster``."""

    request_timeout_s = 1.0

    def __init__(self, cluster: InMemoryClusterState) -> None:
        self.cluster = cluster
        self.lists: Counter[str] = Counter()

    async def list_objects(
        self,
        kind: ResourceKind,
        type_: type[L],
        *,
        label_selector: str | None = None,
        limit: int = 500,
    ) -> ListResult[L]:
        self.lists[kind.plural] += 1
        await asyncio.sleep(0)  # a request is a suspension point
        items = self.cluster.listed(_KIND_OF_PLURAL[kind.plural], type_, label_selector)
        return ListResult(items, self.cluster.resource_version)

    @asynccontextmanager
    async def watch(
        self,
        kind: ResourceKind,
        type_: type[Any],
        *,
        resource_version: str = "",
        label_selector: str | None = None,
        timeout_s: int = 300,
    ) -> AsyncIterator[AsyncIterator[WatchEvent[Any]]]:
        yield self._silent()

    async def _silent(self) -> AsyncIterator[WatchEvent[Any]]:
        await asyncio.Event().wait()  # silent until the informer stops (cancels) it
        yield WatchEvent("BOOKMARK", "", self.cluster.resource_version)  # never reached

    async def get_reservation(self, name: str) -> Reservation | None:
        return await self.cluster.get_reservation(name)

    async def fence_reservation(self, reservation: Reservation) -> Reservation:
        return await self.cluster.fence_reservation(reservation)

    async def patch_allocation(
        self, reservation: Reservation, instance_uuid: str, allocation: dict[str, object]
    ) -> Reservation:
        return await self.cluster.patch_allocation(reservation, instance_uuid, allocation)
