"""Invariants of the stored allocations, checked incrementally (read-only).

This service is not the only writer of ``spec.committedResourceReservation.allocations``
(Cortex's reservation controller removes and confirms entries, see docs/semantics.md),
and nothing else checks what ends up stored. :class:`InvariantIndex` keeps, per CR
Reservation, what that Reservation contributes to four kinds of violation, and answers
the current set of each:

* ``vm_in_multiple_slots``: one VM UUID in the spec allocations of more than one CR
  Reservation for longer than ``grace_s`` (Cortex's ``allocationGracePeriod``, 15 min:
  Cortex itself deletes the other entries when it confirms the VM on its host);
* ``slot_overfilled``: sum of allocation memory - the largest allocation ≥ the block
  (``spec.resources.memory``): some allocation was written while the slot had no memory
  left (the reference lets the *last* VM overfill a slot, never one after it);
* ``allocation_malformed``: an allocation whose ``creationTimestamp`` is missing or not
  RFC 3339 (what Go's ``metav1.Time`` parses), or whose memory quantity is missing or
  negative; or a CR Reservation that does not decode at all because of a quantity in its
  allocations (reported by the informer, see :meth:`InvariantIndex.undecodable`);
* ``allocation_without_host``: allocations in a slot whose ``spec.targetHost`` is empty.

Which Reservations count: the label ``reservations.cortex.cloud/type=committed-resource``
(the informer's and the audit's server-side selector) and ``spec.committedResourceReservation``
set, **Ready or not**: the invariants are about what is stored, and a not-Ready slot's
allocations are still there (Cortex makes a not-Ready slot with allocations and a host
Ready again, and its candidate clean-up looks at every Reservation listing the VM).

Cost: :meth:`InvariantIndex.put` and :meth:`~InvariantIndex.remove` touch only that
Reservation's own allocations (O(its allocations), never a scan of the others);
:meth:`~InvariantIndex.evaluate` (the periodic tick that lets the grace pass without
any further event) looks only at the VMs currently listed in more than one Reservation.

Time: ``clock`` is injected. In the service the grace counts from when the index first
saw the VM in more than one Reservation (``since="observed"``, monotonic; a restart
starts it again). The one-shot ``crs-consumer audit`` has no history and counts it from
the allocations' own ``creationTimestamp`` (``since="created"``, wall clock): the VM has
been listed twice at least since the second-oldest of its entries was written (an entry
without a parsable timestamp counts as old).

Nothing here writes: removing allocations is Cortex's reservation controller's job (the
runbook says how an operator removes one by hand).
"""

from __future__ import annotations

import enum
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Final, Literal

from service.model import CommittedResourceAllocation, Reservation

__all__ = [
    "DEFAULT_GRACE_S",
    "KINDS",
    "InvariantIndex",
    "Kind",
    "Violation",
    "audit",
    "parse_rfc3339",
]

# Cortex's allocationGracePeriod (helm/bundles/cortex-nova/values.yaml).
DEFAULT_GRACE_S: Final = 900.0
# Where a decode error must be for an undecodable Reservation to count as malformed.
_ALLOCATIONS_PATH: Final = "$.spec.committedResourceReservation.allocations"
_DETAIL_LIMIT: Final = 3  # malformed entries named per Reservation
_TEXT_LIMIT: Final = 64  # characters of an offending value quoted

# Go's time.RFC3339 as metav1.Time parses it: a 'T', seconds, optional fraction, and an
# offset (Z or ±hh:mm). Python's fromisoformat accepts far more (no offset, a space).
_RFC3339: Final = re.compile(
    r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d)",
    re.ASCII,
)


class Kind(enum.StrEnum):
    VM_IN_MULTIPLE_SLOTS = "vm_in_multiple_slots"
    SLOT_OVERFILLED = "slot_overfilled"
    ALLOCATION_MALFORMED = "allocation_malformed"
    ALLOCATION_WITHOUT_HOST = "allocation_without_host"


KINDS: Final = tuple(Kind)
# The kinds whose objects are Reservations (vm_in_multiple_slots' objects are VM UUIDs).
_PER_RESERVATION: Final = (
    Kind.SLOT_OVERFILLED,
    Kind.ALLOCATION_MALFORMED,
    Kind.ALLOCATION_WITHOUT_HOST,
)


@dataclass(frozen=True, slots=True)
class Violation:
    """One object in violation: a Reservation's name, or a VM UUID for
    ``vm_in_multiple_slots``; ``reservations`` are the Reservations involved."""

    kind: Kind
    object: str
    reservations: tuple[str, ...]
    detail: str


def parse_rfc3339(text: str) -> float | None:
    """Seconds since the epoch of an RFC 3339 timestamp, None when it is not one."""
    if _RFC3339.fullmatch(text) is None:
        return None
    try:  # the shape is strict; fromisoformat (C) checks the ranges (month 13, second 60)
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def _clip(text: str) -> str:
    return text if len(text) <= _TEXT_LIMIT else text[:_TEXT_LIMIT] + "..."


_NO_ALLOCATIONS: Final[dict[str, CommittedResourceAllocation]] = {}
_NO_VMS: Final[frozenset[str]] = frozenset()


@dataclass(frozen=True, slots=True)
class _Entry:
    """What one CR Reservation contributes.

    ``allocations`` is the Reservation's own dict (the one the watch cache holds too: no
    copy); ``bad_ts`` the VMs whose timestamp is missing or unparsable, so an update
    parses only the timestamps that changed; ``created`` (``since="created"`` only) the
    parsed time per VM, None when it has none.
    """

    allocations: dict[str, CommittedResourceAllocation]
    bad_ts: frozenset[str]
    created: dict[str, float | None] | None
    flags: dict[Kind, str]  # per-Reservation kinds in violation -> detail


def _entry(r: Reservation, previous: _Entry | None, keep_times: bool) -> _Entry | None:
    """The Reservation's contribution, O(its allocations); None when it is no CR slot.

    A timestamp equal to the one ``previous`` held for the same VM is not parsed again
    (it is Python work of microseconds; a placement changes one entry of a slot).
    """
    crr = r.spec.committed_resource_reservation
    if crr is None:
        return None
    allocations = crr.allocations or _NO_ALLOCATIONS
    before = previous.allocations if previous is not None else _NO_ALLOCATIONS
    was_bad = previous.bad_ts if previous is not None else frozenset()
    created: dict[str, float | None] | None = {} if keep_times else None
    bad: set[str] = set()
    malformed: list[str] = []
    total = largest = 0
    for vm, alloc in allocations.items():
        ts = alloc.creation_timestamp
        held = before.get(vm)
        if created is None and held is not None and held.creation_timestamp == ts:
            if vm in was_bad:
                bad.add(vm)
                malformed.append(_bad_ts(vm, ts))
        else:
            when = parse_rfc3339(ts) if ts is not None else None
            if created is not None:
                created[vm] = when
            if when is None:
                bad.add(vm)
                malformed.append(_bad_ts(vm, ts))
        memory = alloc.resources.get("memory")
        if memory is None:
            malformed.append(f"{vm}: memory missing")
            continue  # counts as 0, as in the slot evaluator
        value = memory.value()
        if value < 0:
            malformed.append(f"{vm}: memory {_clip(str(memory))} is negative")
        total += value
        if value > largest:
            largest = value
    flags: dict[Kind, str] = {}
    if allocations:
        block_q = (r.spec.resources or {}).get("memory")
        block = block_q.value() if block_q is not None else 0
        if total - largest >= block:
            flags[Kind.SLOT_OVERFILLED] = (
                f"{len(allocations)} allocations: {total} bytes, largest {largest}, block {block}"
            )
        if not r.spec.target_host:
            flags[Kind.ALLOCATION_WITHOUT_HOST] = f"{len(allocations)} allocations, no targetHost"
    if malformed:
        more = len(malformed) - _DETAIL_LIMIT
        flags[Kind.ALLOCATION_MALFORMED] = "; ".join(malformed[:_DETAIL_LIMIT]) + (
            f"; and {more} more" if more > 0 else ""
        )
    return _Entry(allocations, frozenset(bad) if bad else _NO_VMS, created, flags)


def _bad_ts(vm: str, ts: str | None) -> str:
    if ts is None:
        return f"{vm}: creationTimestamp missing"
    return f"{vm}: creationTimestamp {_clip(ts)!r} is not RFC 3339"


class InvariantIndex:
    """The current violations of the CR Reservations it is told about (see the module).

    Feed it :meth:`update` (the informer's ``on_change``) or :meth:`put`/:meth:`remove`,
    and :meth:`undecodable`; call :meth:`evaluate` periodically. :meth:`counts` and
    :meth:`violations` answer; :meth:`take_changed` says which kinds' sets of objects
    changed since it was last called (for a log line per change, not per event).
    """

    def __init__(
        self,
        *,
        grace_s: float = DEFAULT_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
        since: Literal["observed", "created"] = "observed",
    ) -> None:
        if grace_s < 0:
            raise ValueError("grace_s must be >= 0")
        self._grace = grace_s
        self._clock = clock
        self._since = since
        self._entries: dict[str, _Entry] = {}
        # VM -> the Reservation listing it, or the set of them when several do: one
        # string per VM in the common case (hundreds of thousands of VMs at 50k slots).
        self._slots: dict[str, str | set[str]] = {}
        # VMs listed more than once -> when the index first saw that (observed mode).
        self._dup_since: dict[str, float] = {}
        self._dup_over: set[str] = set()  # of those, the ones past the grace
        self._flagged: dict[Kind, dict[str, str]] = {k: {} for k in _PER_RESERVATION}
        # Undecodable Reservations (a quantity in their allocations): name -> detail.
        self._undecodable: dict[str, str] = {}
        self._changed: set[Kind] = set()
        self.touched = 0  # VM entries added or removed: the unit of cost (tests)

    # --- changes ----------------------------------------------------------------------

    def update(self, old: Reservation | None, new: Reservation | None) -> None:
        """An informer's ``on_change(old, new)``: ``new`` None is a delete."""
        if new is not None:
            self.put(new)
        elif old is not None:
            self.remove(old.name)

    def put(self, r: Reservation) -> None:
        """The current version of ``r`` (replacing what the index held under its name)."""
        name = r.name
        previous = self._entries.get(name)
        entry = _entry(r, previous, self._since == "created")
        if entry is None:
            self.remove(name)
            return
        if self._undecodable.pop(name, None) is not None:
            self._changed.add(Kind.ALLOCATION_MALFORMED)
        self._entries[name] = entry
        before = (previous.allocations if previous is not None else _NO_ALLOCATIONS).keys()
        after = entry.allocations.keys()
        if before != after:
            for vm in before - after:
                self._vm_remove(vm, name)
            for vm in after - before:
                self._vm_add(vm, name)
        self._set_flags(name, previous.flags if previous is not None else {}, entry.flags)

    def remove(self, name: str) -> None:
        """The Reservation ``name`` is gone (deleted, or no CR slot any more)."""
        if self._undecodable.pop(name, None) is not None:
            self._changed.add(Kind.ALLOCATION_MALFORMED)
        previous = self._entries.pop(name, None)
        if previous is None:
            return
        for vm in previous.allocations:
            self._vm_remove(vm, name)
        self._set_flags(name, previous.flags, {})

    def undecodable(self, name: str, path: str | None) -> None:
        """The CR Reservation ``name`` exists but does not decode (the first failing
        field at ``path``), or, with ``path`` None, that is over (it decodes again, or it
        is gone). Counted as ``allocation_malformed`` when the failure is in its
        allocations (a quantity the model cannot represent); the service cannot see
        that Reservation's slot at all meanwhile (the client logs it)."""
        if path is None:
            if self._undecodable.pop(name, None) is not None:
                self._changed.add(Kind.ALLOCATION_MALFORMED)
            return
        self.remove(name)  # its decoded version, if any, is not the current one
        if path.startswith(_ALLOCATIONS_PATH):
            self._undecodable[name] = f"does not decode at {_clip(path)}"
            self._changed.add(Kind.ALLOCATION_MALFORMED)

    def _set_flags(self, name: str, before: dict[Kind, str], after: dict[Kind, str]) -> None:
        for kind in _PER_RESERVATION:
            detail = after.get(kind)
            flagged = self._flagged[kind]
            if detail is None:
                if kind in before:
                    del flagged[name]
                    self._changed.add(kind)
            else:
                if kind not in before:
                    self._changed.add(kind)
                flagged[name] = detail

    def _vm_add(self, vm: str, name: str) -> None:
        self.touched += 1
        held = self._slots.get(vm)
        if held is None:
            self._slots[vm] = name
            return
        if isinstance(held, str):
            held = self._slots[vm] = {held}
        held.add(name)
        if vm not in self._dup_since:
            self._dup_since[vm] = self._clock()
        self._check_vm(vm)

    def _vm_remove(self, vm: str, name: str) -> None:
        self.touched += 1
        held = self._slots.get(vm)
        if held is None:
            return
        if isinstance(held, str):
            if held == name:
                del self._slots[vm]
            return
        held.discard(name)
        if len(held) > 1:
            self._check_vm(vm)  # "created": the second-oldest entry may have changed
            return
        if held:
            self._slots[vm] = next(iter(held))
        else:
            del self._slots[vm]
        del self._dup_since[vm]
        if vm in self._dup_over:
            self._dup_over.discard(vm)
            self._changed.add(Kind.VM_IN_MULTIPLE_SLOTS)

    # --- time -------------------------------------------------------------------------

    def _started(self, vm: str) -> float:
        """Since when ``vm`` counts as listed more than once."""
        if self._since == "observed":
            return self._dup_since[vm]
        held = self._slots[vm]
        assert isinstance(held, set)
        times = sorted(self._created(n, vm) for n in held)
        return times[1]

    def _created(self, name: str, vm: str) -> float:
        created = self._entries[name].created
        when = created.get(vm) if created is not None else None
        return -float("inf") if when is None else when  # no timestamp: counts as old

    def _check_vm(self, vm: str, now: float | None = None) -> None:
        over = (self._clock() if now is None else now) - self._started(vm) >= self._grace
        if over != (vm in self._dup_over):
            if over:
                self._dup_over.add(vm)
            else:
                self._dup_over.discard(vm)
            self._changed.add(Kind.VM_IN_MULTIPLE_SLOTS)

    def evaluate(self) -> None:
        """Let time pass: O(VMs listed more than once), whatever the cluster's size."""
        now = self._clock()
        for vm in self._dup_since:
            self._check_vm(vm, now)

    # --- answers ----------------------------------------------------------------------

    def counts(self) -> dict[Kind, int]:
        """Objects currently in violation per kind (VMs for vm_in_multiple_slots)."""
        return {
            Kind.VM_IN_MULTIPLE_SLOTS: len(self._dup_over),
            Kind.SLOT_OVERFILLED: len(self._flagged[Kind.SLOT_OVERFILLED]),
            Kind.ALLOCATION_MALFORMED: len(self._flagged[Kind.ALLOCATION_MALFORMED])
            + len(self._undecodable),
            Kind.ALLOCATION_WITHOUT_HOST: len(self._flagged[Kind.ALLOCATION_WITHOUT_HOST]),
        }

    def violations(self, kind: Kind, limit: int | None = None) -> list[Violation]:
        """The objects in violation of ``kind``, by name (at most ``limit`` of them)."""
        return list(self._iter(kind, limit))

    def _iter(self, kind: Kind, limit: int | None) -> Iterator[Violation]:
        if kind is Kind.VM_IN_MULTIPLE_SLOTS:
            names = sorted(self._dup_over)[:limit]
            for vm in names:
                held = self._slots[vm]
                slots = tuple(sorted(held)) if isinstance(held, set) else (held,)
                yield Violation(kind, vm, slots, f"in {len(slots)} reservations")
            return
        found = dict(self._flagged[kind])
        if kind is Kind.ALLOCATION_MALFORMED:
            found |= self._undecodable
        for name in sorted(found)[:limit]:
            yield Violation(kind, name, (name,), found[name])

    def take_changed(self) -> set[Kind]:
        """The kinds whose set of objects changed since the last call."""
        changed, self._changed = self._changed, set()
        return changed

    def __len__(self) -> int:
        """CR Reservations held."""
        return len(self._entries)


def audit(
    reservations: Iterable[Reservation],
    undecodable: Iterable[tuple[str, str]] = (),
    *,
    grace_s: float = DEFAULT_GRACE_S,
    now: float,
) -> InvariantIndex:
    """The index of one listing (``crs-consumer audit``), evaluated at ``now`` (Unix
    time): no history, so the grace counts from the allocations' creationTimestamp.
    ``undecodable``: (name, decode error path) of the listed objects that did not decode."""
    index = InvariantIndex(grace_s=grace_s, clock=lambda: now, since="created")
    for r in reservations:
        index.put(r)
    for name, path in undecodable:
        index.undecodable(name, path)
    index.evaluate()
    return index
