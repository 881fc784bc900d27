"""Slot evaluator: which committed-resource reservation slots can take a VM on a host.

One representation serves every query: each slot is reduced once to a
:class:`SlotSummary` (block size, remaining bytes, owner, allocation UUIDs) and each
host's slots to a :class:`HostSlots` (the block total of all its slots, and its slots
grouped by ``(project, flavor group)`` with the largest remaining memory of each group).
A :class:`SlotEvaluator` is free memory per host plus ``HostSlots`` per host, so every
query is two hash lookups into small records and costs O(slots on the queried host),
never O(cluster).

Both read modes build it the same way, through the constructor:

* list mode (:meth:`SlotEvaluator.from_objects`) summarises the listed Hypervisors
  and Reservations once per request, applying the reference filters (:func:`is_slot`);
* watch mode keeps :func:`hv_free_memory` and ``HostSlots`` per host current as watch
  events arrive (re-summarising only the hosts an event touches) and hands the entries
  of the request's hosts to the constructor: no summarising per request at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final, NamedTuple

from service.model.k8s import (
    LABEL_RESERVATION_TYPE,
    RESERVATION_TYPE_COMMITTED_RESOURCE,
    Hypervisor,
    Reservation,
)
from service.model.meta import is_condition_true
from service.quantity import Quantity

__all__ = [
    "MEMORY",
    "GroupSlots",
    "HostSlots",
    "SlotEvaluator",
    "SlotSummary",
    "host_slots_by_host",
    "hv_free_memory",
    "is_slot",
    "pick_slot",
    "reservation_remaining_memory",
    "slot_summary",
]

MEMORY = "memory"
_CONDITION_READY = "Ready"


def _memory_value(resources: Mapping[str, Quantity] | None) -> int:
    """``Value()`` of the memory entry; a missing map or key counts as 0 (Go zero value)."""
    if not resources:
        return 0
    q = resources.get(MEMORY)
    return q.value() if q is not None else 0


def hv_free_memory(h: Hypervisor) -> int:
    """Free memory in bytes before reservation blocks: max(cap - allocation, 0).

    ``cap`` is ``effectiveCapacity`` whenever that map is present, *even if empty*
    (then the host has no free memory), and ``capacity`` only when it is absent/null.
    """
    status = h.status
    cap = status.effective_capacity if status.effective_capacity is not None else status.capacity
    return max(_memory_value(cap) - _memory_value(status.allocation), 0)


def is_slot(r: Reservation) -> bool:
    """A ready committed-resource reservation: the only kind that counts as a CR slot.

    The reference filters the type label server-side; checking it here too keeps
    :func:`host_slots_by_host` correct for any list it is handed.
    """
    labels = r.metadata.labels
    if labels is None or labels.get(LABEL_RESERVATION_TYPE) != RESERVATION_TYPE_COMMITTED_RESOURCE:
        return False
    if r.spec.committed_resource_reservation is None:
        return False
    return is_condition_true(r.status.conditions, _CONDITION_READY)


def reservation_remaining_memory(res: Reservation | None) -> int:
    """Unallocated bytes of a slot: max(block - sum of allocations, 0); 0 if not a CR slot."""
    if res is None:
        return 0
    crr = res.spec.committed_resource_reservation
    if crr is None:
        return 0
    used = 0
    if crr.allocations:
        for alloc in crr.allocations.values():
            used += _memory_value(alloc.resources)
    return max(_memory_value(res.spec.resources) - used, 0)


def pick_slot(candidates: Sequence[Reservation], vm_memory_bytes: int) -> str:
    """Name of the best slot for a VM, "" if none has memory left.

    Overfill is allowed (the pipeline already checked the host can take the overflow),
    so any slot with remaining > 0 qualifies. Order: most coverage
    (min(remaining, vm)), then the tightest fit (least remaining), then the smallest
    name byte-wise. The total order makes the answer independent of input order.
    """
    # Python compares str by code point, which is exactly the byte order of their UTF-8
    # encodings, i.e. Go's string order; no need to encode.
    best_key: tuple[int, int, str] | None = None
    best_name = ""
    for res in candidates:
        remaining = reservation_remaining_memory(res)
        if remaining <= 0:
            continue
        name = res.name
        key = (-min(remaining, vm_memory_bytes), remaining, name)
        if best_key is None or key < best_key:
            best_key = key
            best_name = name
    return best_name


class SlotSummary(NamedTuple):
    """What the queries need of one slot, computed once (see :func:`slot_summary`).

    ``project_id`` and ``resource_group`` are None for a reservation without a
    ``committedResourceReservation`` spec: its block still counts against the host,
    but it never matches a request.
    """

    name: str
    project_id: str | None
    resource_group: str | None
    block_bytes: int
    remaining_bytes: int
    allocation_uuids: frozenset[str]
    reservation: Reservation


def slot_summary(r: Reservation) -> SlotSummary:
    """Summarise one reservation (what :class:`HostSlots` keeps of it)."""
    crr = r.spec.committed_resource_reservation
    block = _memory_value(r.spec.resources)
    if crr is None:
        return SlotSummary(r.name, None, None, block, 0, frozenset(), r)
    return SlotSummary(
        r.name,
        crr.project_id,
        crr.resource_group,
        block,
        reservation_remaining_memory(r),
        frozenset(crr.allocations) if crr.allocations else frozenset(),
        r,
    )


class GroupSlots(NamedTuple):
    """The slots of one ``(project, flavor group)`` on one host, in input order.

    ``host_blocks`` is the block total of *all* slots on the host (any project or
    group), repeated here so a query needs no second lookup.
    """

    max_remaining: int
    host_blocks: int
    slots: tuple[SlotSummary, ...]


class HostSlots:
    """Immutable summary of one host's slots: block total and slots by (project, group).

    Built from the slots' summaries in the order given (no filtering: pass slots only);
    a watch cache builds a new one when a host's slots change, and may share it between
    evaluators because it never changes.
    """

    __slots__ = ("all_blocks", "groups", "slots")

    all_blocks: int
    groups: Mapping[tuple[str, str], GroupSlots]
    slots: tuple[SlotSummary, ...]

    def __init__(self, slots: Iterable[SlotSummary]) -> None:
        self.slots = tuple(slots)
        self.all_blocks = all_blocks = sum(s.block_bytes for s in self.slots)
        grouped: dict[tuple[str, str], list[SlotSummary]] = {}
        for s in self.slots:
            if s.project_id is not None and s.resource_group is not None:
                grouped.setdefault((s.project_id, s.resource_group), []).append(s)
        self.groups = {
            key: GroupSlots(max(s.remaining_bytes for s in members), all_blocks, tuple(members))
            for key, members in grouped.items()
        }

    @classmethod
    def from_reservations(cls, reservations: Iterable[Reservation]) -> HostSlots:
        """Summarise the reservations of one host (no filtering: pass slots only)."""
        return cls(slot_summary(r) for r in reservations)

    def __repr__(self) -> str:
        return f"HostSlots(all_blocks={self.all_blocks}, slots={[s.name for s in self.slots]})"


_NO_SLOTS: Final = HostSlots(())


def host_slots_by_host(reservations: Iterable[Reservation]) -> dict[str, HostSlots]:
    """The CR slots among ``reservations`` (:func:`is_slot`), summarised per target host.

    Slots keep their input order within a host.
    """
    by_host: dict[str, list[Reservation]] = {}
    for r in reservations:
        if is_slot(r):
            by_host.setdefault(r.spec.target_host, []).append(r)
    return {host: HostSlots.from_reservations(slots) for host, slots in by_host.items()}


class SlotEvaluator:
    """Answers slot questions from one consistent view: free memory and slots per host.

    Build once per request and query without further reads. The constructor takes the
    two per-host maps as they are, without copying them: they must not change while the
    evaluator is in use (a watch cache hands in the entries of the request's hosts;
    :class:`HostSlots` themselves never change). A host missing from
    ``hv_free_memory`` counts as having no free memory; one missing from ``host_slots``
    has no slots.
    """

    __slots__ = ("_hosts", "_hv_free_memory")

    def __init__(
        self, hv_free_memory: Mapping[str, int], host_slots: Mapping[str, HostSlots]
    ) -> None:
        self._hv_free_memory = hv_free_memory
        self._hosts = host_slots

    @classmethod
    def from_objects(
        cls, hypervisors: Iterable[Hypervisor], reservations: Iterable[Reservation]
    ) -> SlotEvaluator:
        """From full object lists (list mode), applying the reference filters."""
        free = {h.metadata.name or "": hv_free_memory(h) for h in hypervisors}
        return cls(free, host_slots_by_host(reservations))

    def host_slots(self, host: str) -> HostSlots:
        """The summarised slots of ``host`` (empty when it has none)."""
        return self._hosts.get(host, _NO_SLOTS)

    def _group(self, host: str, project_id: str, flavor_group: str) -> GroupSlots | None:
        return self._hosts.get(host, _NO_SLOTS).groups.get((project_id, flavor_group))

    def slot_summaries_for_host(
        self, host: str, project_id: str, flavor_group: str
    ) -> list[SlotSummary]:
        """Summaries of the slots on ``host`` of ``project_id`` and ``flavor_group``."""
        group = self._group(host, project_id, flavor_group)
        return list(group.slots) if group is not None else []

    def slots_for_host(self, host: str, project_id: str, flavor_group: str) -> list[Reservation]:
        """The slots on ``host`` that belong to ``project_id`` and ``flavor_group``."""
        group = self._group(host, project_id, flavor_group)
        return [s.reservation for s in group.slots] if group is not None else []

    def has_slot_with_memory(self, host: str, project_id: str, flavor_group: str) -> bool:
        """Whether a matching slot on ``host`` has any unallocated memory left."""
        group = self._group(host, project_id, flavor_group)
        return group is not None and group.max_remaining > 0

    def has_usable_slot(
        self, host: str, project_id: str, flavor_group: str, vm_mem_bytes: int
    ) -> bool:
        """Whether a matching slot could take the VM under the overfill model.

        ``free - all_blocks + remaining >= vm``: every slot on the host blocks its full
        size (whatever its project or group), the VM may spill out of its slot into
        what is left of the host.
        """
        group = self._group(host, project_id, flavor_group)
        if group is None:
            return False
        # Some slot qualifies iff the one with the most memory left does.
        best = group.max_remaining
        base_free = self._hv_free_memory.get(host, 0) - group.host_blocks
        return best > 0 and base_free + best >= vm_mem_bytes
