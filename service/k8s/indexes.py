"""The watch cache's per-request indexes, maintained change by change.

The informers report every applied change (``old``, ``new``) synchronously; the
handlers here keep exactly what a request needs:

* free memory per hypervisor (:func:`~service.crs.evaluator.hv_free_memory`),
* CR slots per ``spec.targetHost`` (only Reservations passing
  :func:`~service.crs.evaluator.is_slot`; a move, a not-Ready or a delete moves/removes),
  each host's slots also summarised once per change as a
  :class:`~service.crs.evaluator.HostSlots`,
* CommittedResources per project,
* the ``flavor-groups`` Knowledge.

:meth:`ClusterIndexes.snapshot` copies a request's part without an ``await``. Slots and
CommittedResources come out in name order, which is the order a LIST returns them in,
so decisions equal list mode's.
"""

from __future__ import annotations

from collections.abc import Collection

from service.crs.evaluator import HostSlots, SlotEvaluator, hv_free_memory, is_slot
from service.crs.ports import Snapshot
from service.model import CommittedResource, Hypervisor, Knowledge, Reservation

__all__ = ["ClusterIndexes"]


class ClusterIndexes:
    """The indexes of one watch cache; the ``on_*`` methods are the informers' handlers."""

    def __init__(self) -> None:
        # Inner dicts are keyed by object name so an update replaces in O(1).
        self._hv_free: dict[str, int] = {}
        self._slots_by_host: dict[str, dict[str, Reservation]] = {}
        # The same slots summarised once per change (immutable, replaced per host), so a
        # request's queries never walk Reservation objects (see service.crs.evaluator).
        self._host_slots: dict[str, HostSlots] = {}
        self._crs_by_project: dict[str, dict[str, CommittedResource]] = {}
        # The same in name order, built on the first request after a change (sorting per
        # request was a few per cent of an event's CPU).
        self._crs_sorted: dict[str, tuple[CommittedResource, ...]] = {}
        self._knowledge: Knowledge | None = None

    def on_hypervisor(self, old: Hypervisor | None, new: Hypervisor | None) -> None:
        if new is None:
            if old is not None:
                self._hv_free.pop(old.metadata.name or "", None)
            return
        self._hv_free[new.metadata.name or ""] = hv_free_memory(new)

    def on_reservation(self, old: Reservation | None, new: Reservation | None) -> None:
        if old is not None:
            name = old.name
            host_slots = self._slots_by_host.get(old.spec.target_host)
            if host_slots is not None and host_slots.pop(name, None) is not None and not host_slots:
                del self._slots_by_host[old.spec.target_host]
        if new is not None and is_slot(new):
            self._slots_by_host.setdefault(new.spec.target_host, {})[new.name] = new
        if old is not None:
            self._summarise(old.spec.target_host)
        if new is not None and (old is None or old.spec.target_host != new.spec.target_host):
            self._summarise(new.spec.target_host)

    def _summarise(self, host: str) -> None:
        """Re-summarise one host's slots, in name order (O(slots on the host))."""
        slots = self._slots_by_host.get(host)
        if slots:
            self._host_slots[host] = HostSlots.from_reservations(slots[n] for n in sorted(slots))
        else:
            self._host_slots.pop(host, None)

    def on_committed_resource(
        self, old: CommittedResource | None, new: CommittedResource | None
    ) -> None:
        if old is not None:
            project = self._crs_by_project.get(old.spec.project_id)
            name = old.metadata.name or ""
            if project is not None and project.pop(name, None) is not None and not project:
                del self._crs_by_project[old.spec.project_id]
            self._crs_sorted.pop(old.spec.project_id, None)
        if new is not None:
            self._crs_by_project.setdefault(new.spec.project_id, {})[new.metadata.name or ""] = new
            self._crs_sorted.pop(new.spec.project_id, None)

    def on_knowledge(self, old: Knowledge | None, new: Knowledge | None) -> None:
        self._knowledge = new

    def snapshot(self, hosts: Collection[str], project_id: str) -> Snapshot:
        """``hosts`` and the project's CommittedResources, copied in one synchronous step."""
        free = self._hv_free
        summarised = self._host_slots
        hv: dict[str, int] = {}
        by_host: dict[str, HostSlots] = {}
        for host in hosts:
            value = free.get(host)
            if value is not None:
                hv[host] = value
            host_slots = summarised.get(host)
            if host_slots is not None:
                by_host[host] = host_slots  # immutable: a copy of the reference suffices
        crs = self._crs_sorted.get(project_id)
        if crs is None:
            project = self._crs_by_project.get(project_id)
            crs = tuple(project[n] for n in sorted(project)) if project else ()
            if project:
                self._crs_sorted[project_id] = crs
        return Snapshot(
            evaluator=SlotEvaluator(hv, by_host),
            committed_resources=crs,  # immutable: shared by the requests until a change
            knowledge=self._knowledge,
        )
