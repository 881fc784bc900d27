"""Slot evaluator: which committed-resource reservation slots can take a VM on a host.

The evaluator is deliberately index-shaped (free memory per host, slots per host) rather
than list-shaped: a watch cache keeps both indexes current with :func:`hv_free_memory`
and :func:`is_slot`, and a request then builds an evaluator over just the hosts it
names. Every query therefore costs O(slots on the queried host), never O(cluster).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

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
    "SlotEvaluator",
    "hv_free_memory",
    "is_slot",
    "pick_slot",
    "reservation_remaining_memory",
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


class SlotEvaluator:
    """Answers slot questions from one consistent snapshot of two per-host indexes."""

    __slots__ = ("_hv_free_memory", "_reservations_by_host")

    def __init__(
        self,
        hv_free_memory: Mapping[str, int],
        reservations_by_host: Mapping[str, Sequence[Reservation]],
    ) -> None:
        # Taken as-is (no copy, no filtering): callers pass indexes they already hold.
        self._hv_free_memory = hv_free_memory
        self._reservations_by_host = reservations_by_host

    @classmethod
    def from_objects(
        cls, hypervisors: Iterable[Hypervisor], reservations: Iterable[Reservation]
    ) -> SlotEvaluator:
        """Build both indexes from full object lists, applying the reference filters."""
        free: dict[str, int] = {}
        for h in hypervisors:
            free[h.metadata.name or ""] = hv_free_memory(h)
        by_host: dict[str, list[Reservation]] = {}
        for r in reservations:
            if is_slot(r):
                by_host.setdefault(r.spec.target_host, []).append(r)
        return cls(free, by_host)

    def slots_for_host(self, host: str, project_id: str, flavor_group: str) -> list[Reservation]:
        """The slots on ``host`` that belong to ``project_id`` and ``flavor_group``."""
        result = []
        for res in self._reservations_by_host.get(host, ()):
            crr = res.spec.committed_resource_reservation
            if crr is not None and crr.matches_group(project_id, flavor_group):
                result.append(res)
        return result

    def has_usable_slot(
        self, host: str, project_id: str, flavor_group: str, vm_mem_bytes: int
    ) -> bool:
        """Whether a matching slot could take the VM under the overfill model.

        ``free - all_blocks + remaining >= vm``: every slot on the host blocks its full
        size (whatever its project or group), the VM may spill out of its slot into
        what is left of the host.
        """
        # One pass: the block total needs every slot, the candidates only matching ones.
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
