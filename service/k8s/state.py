""":class:`~service.crs.ports.ClusterState` in list mode: every request reads the API.

No cache, no watch: each :meth:`ListClusterState.snapshot` issues the four reads once,
concurrently (one failing cancels the others), and decides on what they returned. Simple
and always fresh, at the cost of listing every Reservation per event; a watch-cache
state can replace it behind the same protocol without the Recorder noticing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence

from service.crs.evaluator import SlotEvaluator
from service.crs.flavors import FLAVOR_GROUPS_KNOWLEDGE_NAME
from service.crs.ports import ClusterState, Snapshot
from service.k8s.client import KubeClient
from service.model import Reservation
from service.tasks import wait_all_or_none

__all__ = ["ListClusterState"]


class ListClusterState(ClusterState):
    """Per-request API reads through a :class:`KubeClient`."""

    def __init__(self, client: KubeClient, *, page_size: int = 500) -> None:
        self._client = client
        self._page_size = page_size

    async def snapshot(self, hosts: Collection[str], project_id: str) -> Snapshot:
        """Hypervisors, CR Reservations, CommittedResources and Knowledge, read at once.

        The evaluator covers every host (a list cannot be narrowed to hosts server-side:
        there is no field selector on CRD spec fields). A missing Knowledge is returned
        as None — the Recorder counts that as a lookup error; every other read failure
        propagates, so the caller retries instead of deciding on partial data.
        """
        # Not gather: when one read fails the others are cancelled instead of running on
        # (a LIST of every Reservation, for an event that already failed).
        client, limit = self._client, self._page_size
        hypervisors = asyncio.ensure_future(client.list_hypervisors(limit=limit))
        reservations = asyncio.ensure_future(client.list_reservations(limit=limit))
        crs = asyncio.ensure_future(client.list_committed_resources(limit=limit))
        knowledge = asyncio.ensure_future(client.get_knowledge(FLAVOR_GROUPS_KNOWLEDGE_NAME))
        await wait_all_or_none([hypervisors, reservations, crs, knowledge])
        return Snapshot(
            evaluator=SlotEvaluator.from_objects(hypervisors.result(), reservations.result()),
            committed_resources=crs.result(),
            knowledge=knowledge.result(),
        )

    async def reservations_on_host(self, host: str) -> Sequence[Reservation]:
        """A fresh label-selected list, filtered to ``spec.targetHost == host``."""
        reservations = await self._client.list_reservations(limit=self._page_size)
        return [r for r in reservations if r.spec.target_host == host]

    async def get_reservation(self, name: str) -> Reservation | None:
        return await self._client.get_reservation(name)

    async def fence_reservation(self, reservation: Reservation) -> Reservation:
        return await self._client.fence_reservation(reservation)

    async def patch_allocation(
        self,
        reservation: Reservation,
        instance_uuid: str,
        allocation: dict[str, object],
    ) -> Reservation:
        return await self._client.patch_allocation(reservation, instance_uuid, allocation)
