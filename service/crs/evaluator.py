"""Slot evaluator: which committed-resource reservation slots can take a VM on a host.

The evaluator is deliberately index-shaped (free memory per host, slots per host) rather
than list-shaped: a watch cache keeps both indexes current with :func:`hv_free_memory`
and :func:`is_slot`, and a request then builds an evaluator over just the hosts it
names. Every query therefore costs O(slots on the queried host), never O(cluster).

Queries never walk the Reservation objects themselves. Each slot is reduced once to a
:class:`SlotSummary` (block size, remaining bytes, owner, allocation UUIDs) and each
host to a :class:`HostSlots` (the block total of all its slots, and its slots grouped
by ``(project, flavor group)`` with the largest remaining memory of each group). A
query is then two or three hash lookups into small, contiguous records instead of a
dozen pointer hops per slot through a large heap, which is what made a query on a big
cluster several times slower than the same query on a small one (cache misses, not
extra work).

Recommended use by a watch cache: keep one :class:`SlotIndex` next to the free-memory
dict. On every Reservation watch event compute :func:`slot_summary` once for the new
object (only if :func:`is_slot`), keep the summaries per host (say ``{name: summary}``,
the old host's entry removed when ``targetHost`` changes) and call
``index.set_host(host, summaries.values())`` for each host touched: O(slots on that
host). A request then uses ``SlotEvaluator.from_slot_index(free_by_host, index)``, a
view costing O(1) to build, and pays no summarising at all; the classification queries
are then a single hash probe per host. (:meth:`SlotEvaluator.from_host_slots` over the
request's hosts' :class:`HostSlots` is the alternative for a cache that wants a
per-request snapshot; its queries cost two more pointer hops per host.) The original
constructor, taking Reservation lists, still works unchanged: it scans the lists on each
query and is the slowest of the three on a large cluster.
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
    "SlotIndex",
    "SlotSummary",
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
    :meth:`SlotEvaluator.from_objects` correct for any list it is handed.
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
    """Summarise one reservation; a watch cache calls this once per watch event."""
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
    """Immutable per-host precomputation: block total and slots by (project, group)."""

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
    def from_summaries(cls, summaries: Iterable[SlotSummary]) -> HostSlots:
        """From summaries the caller already holds (the watch-cache path)."""
        return cls(summaries)

    @classmethod
    def from_reservations(cls, reservations: Iterable[Reservation]) -> HostSlots:
        """Summarise the reservations of one host (no filtering: pass slots only)."""
        return cls(slot_summary(r) for r in reservations)

    def __repr__(self) -> str:
        return f"HostSlots(all_blocks={self.all_blocks}, slots={[s.name for s in self.slots]})"


_NO_SLOTS: Final = HostSlots(())
_GroupKey = tuple[str, str, str]


class SlotIndex:
    """Mutable slot index over many hosts, kept current by a watch cache.

    Besides the :class:`HostSlots` per host it keeps one flat dict keyed by
    ``(host, project, group)``, so that a query on a host without a matching slot (the
    common case) is a single hash probe, touching no per-host object at all.
    Replacing a host costs O(slots on that host).
    """

    __slots__ = ("_groups", "_hosts")

    def __init__(self) -> None:
        self._hosts: dict[str, HostSlots] = {}
        self._groups: dict[_GroupKey, GroupSlots] = {}

    def set_host(self, host: str, slots: HostSlots | Iterable[SlotSummary]) -> None:
        """Replace everything known about ``host``'s slots (empty: forget the host)."""
        hs = slots if isinstance(slots, HostSlots) else HostSlots(slots)
        self.discard_host(host)
        if not hs.slots:
            return
        self._hosts[host] = hs
        groups = self._groups
        for (project_id, flavor_group), group in hs.groups.items():
            groups[(host, project_id, flavor_group)] = group

    def discard_host(self, host: str) -> None:
        old = self._hosts.pop(host, None)
        if old is not None:
            for project_id, flavor_group in old.groups:
                del self._groups[(host, project_id, flavor_group)]

    def host(self, host: str) -> HostSlots:
        """The summarised slots of ``host`` (empty when it has none)."""
        return self._hosts.get(host, _NO_SLOTS)

    @property
    def hosts(self) -> Mapping[str, HostSlots]:
        return self._hosts

    def __len__(self) -> int:
        return len(self._hosts)


class SlotEvaluator:
    """Answers slot questions from one consistent snapshot of two per-host indexes.

    Ways to build one, fastest queries first:

    * :meth:`from_slot_index` over a :class:`SlotIndex` (what :meth:`from_objects`
      does, and the recommended watch-cache path, see the module docstring);
    * :meth:`from_host_slots` from precomputed :class:`HostSlots` per host;
    * the constructor, from Reservation lists per host, which every query scans as
      before (no summarising: a per-request evaluator would pay more for building
      summaries than it saves).

    Whatever is passed is used as-is, not copied: it must not change while the
    evaluator is in use (within one request, without an ``await`` in between, a live
    watch-cache index qualifies).
    """

    __slots__ = ("_groups", "_host_slots", "_hv_free_memory", "_reservations_by_host")

    def __init__(
        self,
        hv_free_memory: Mapping[str, int],
        reservations_by_host: Mapping[str, Sequence[Reservation]],
    ) -> None:
        # Taken as-is (no copy, no filtering): callers pass indexes they already hold.
        self._hv_free_memory = hv_free_memory
        self._reservations_by_host = reservations_by_host
        # Summarised hosts, handed in by the other constructors; None: scan the lists.
        self._host_slots: Mapping[str, HostSlots] | None = None
        # The flat (host, project, group) index, when built from a SlotIndex.
        self._groups: Mapping[_GroupKey, GroupSlots] | None = None

    @classmethod
    def from_host_slots(
        cls, hv_free_memory: Mapping[str, int], host_slots: Mapping[str, HostSlots]
    ) -> SlotEvaluator:
        """From precomputed per-host summaries, taken as-is (no copy, no summarising)."""
        ev = cls(hv_free_memory, {})
        ev._host_slots = host_slots
        return ev

    @classmethod
    def from_slot_index(cls, hv_free_memory: Mapping[str, int], index: SlotIndex) -> SlotEvaluator:
        """A view of a :class:`SlotIndex` (not a copy); the fastest queries."""
        ev = cls(hv_free_memory, {})
        ev._host_slots = index._hosts
        ev._groups = index._groups
        return ev

    @classmethod
    def from_objects(
        cls, hypervisors: Iterable[Hypervisor], reservations: Iterable[Reservation]
    ) -> SlotEvaluator:
        """Build both indexes from full object lists, applying the reference filters."""
        free: dict[str, int] = {}
        for h in hypervisors:
            free[h.metadata.name or ""] = hv_free_memory(h)
        by_host: dict[str, list[SlotSummary]] = {}
        for r in reservations:
            if is_slot(r):
                by_host.setdefault(r.spec.target_host, []).append(slot_summary(r))
        index = SlotIndex()
        for host, summaries in by_host.items():
            index.set_host(host, summaries)
        return cls.from_slot_index(free, index)

    def _host(self, host: str) -> HostSlots:
        if self._host_slots is not None:
            return self._host_slots.get(host, _NO_SLOTS)
        return HostSlots.from_reservations(self._reservations_by_host.get(host, ()))

    def _group(self, host: str, project_id: str, flavor_group: str) -> GroupSlots | None:
        groups = self._groups
        if groups is not None:
            return groups.get((host, project_id, flavor_group))
        return self._host(host).groups.get((project_id, flavor_group))

    def _matching(self, host: str, project_id: str, flavor_group: str) -> list[Reservation]:
        """Constructor path: filter the host's Reservation list (no summaries)."""
        result = []
        for res in self._reservations_by_host.get(host, ()):
            crr = res.spec.committed_resource_reservation
            if crr is not None and crr.matches_group(project_id, flavor_group):
                result.append(res)
        return result

    def host_slots(self, host: str) -> HostSlots:
        """The summarised slots of ``host`` (empty when it has none)."""
        return self._host(host)

    def slot_summaries_for_host(
        self, host: str, project_id: str, flavor_group: str
    ) -> list[SlotSummary]:
        """Summaries of the slots on ``host`` of ``project_id`` and ``flavor_group``."""
        if self._host_slots is None:
            return [slot_summary(r) for r in self._matching(host, project_id, flavor_group)]
        group = self._group(host, project_id, flavor_group)
        return list(group.slots) if group is not None else []

    def slots_for_host(self, host: str, project_id: str, flavor_group: str) -> list[Reservation]:
        """The slots on ``host`` that belong to ``project_id`` and ``flavor_group``."""
        if self._host_slots is None:
            return self._matching(host, project_id, flavor_group)
        group = self._group(host, project_id, flavor_group)
        return [s.reservation for s in group.slots] if group is not None else []

    def has_slot_with_memory(self, host: str, project_id: str, flavor_group: str) -> bool:
        """Whether a matching slot on ``host`` has any unallocated memory left."""
        groups = self._groups
        if groups is not None:
            group = groups.get((host, project_id, flavor_group))
        elif self._host_slots is not None:
            group = self._host_slots.get(host, _NO_SLOTS).groups.get((project_id, flavor_group))
        else:
            return any(
                reservation_remaining_memory(r) > 0
                for r in self._matching(host, project_id, flavor_group)
            )
        return group is not None and group.max_remaining > 0

    def has_usable_slot(
        self, host: str, project_id: str, flavor_group: str, vm_mem_bytes: int
    ) -> bool:
        """Whether a matching slot could take the VM under the overfill model.

        ``free - all_blocks + remaining >= vm``: every slot on the host blocks its full
        size (whatever its project or group), the VM may spill out of its slot into
        what is left of the host.
        """
        groups = self._groups
        if groups is not None:
            group = groups.get((host, project_id, flavor_group))
        elif self._host_slots is not None:
            group = self._host_slots.get(host, _NO_SLOTS).groups.get((project_id, flavor_group))
        else:
            return self._has_usable_slot_scan(host, project_id, flavor_group, vm_mem_bytes)
        if group is None:
            return False
        # Some slot qualifies iff the one with the most memory left does.
        best = group.max_remaining
        base_free = self._hv_free_memory.get(host, 0) - group.host_blocks
        return best > 0 and base_free + best >= vm_mem_bytes

    def _has_usable_slot_scan(
        self, host: str, project_id: str, flavor_group: str, vm_mem_bytes: int
    ) -> bool:
        """Constructor path: one pass over the host's Reservation objects."""
        # The block total needs every slot, the candidates only matching ones.
        all_blocks = 0
        candidates = []
        for res in self._reservations_by_host.get(host, ()):
            all_blocks += _memory_value(res.spec.resources)
            crr = res.spec.committed_resource_reservation
            if crr is not None and crr.matches_group(project_id, flavor_group):
                candidates.append(res)
        if not candidates:
            return False
        base_free = self._hv_free_memory.get(host, 0) - all_blocks
        for res in candidates:
            remaining = reservation_remaining_memory(res)
            if remaining > 0 and base_free + remaining >= vm_mem_bytes:
                return True
        return False
