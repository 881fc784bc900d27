"""The allocation invariant index (service.crs.invariants): each kind, updates and
deletes, the grace on a fake clock, and the cost of an update (only that object's VMs)."""

from __future__ import annotations

from typing import Any

import pytest

from service.crs.invariants import (
    KINDS,
    InvariantIndex,
    Kind,
    parse_rfc3339,
)
from service.model import Reservation, from_k8s
from tests import factories as f

TS = "2026-01-01T00:00:00Z"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def res(
    name: str,
    allocations: dict[str, Any] | None = None,
    *,
    host: str = "hv-1",
    memory: str = "8Gi",
    rv: str = "1",
) -> Reservation:
    obj = f.reservation(name, host=host, memory=memory, allocations=allocations)
    obj["metadata"]["resourceVersion"] = rv
    return from_k8s(obj, Reservation)


def alloc(memory: str | None = "2Gi", ts: str | None = TS) -> dict[str, Any]:
    out: dict[str, Any] = {"resources": {} if memory is None else {"memory": memory}}
    if ts is not None:
        out["creationTimestamp"] = ts
    return out


def names(index: InvariantIndex, kind: Kind) -> list[str]:
    return [v.object for v in index.violations(kind)]


def test_a_clean_slot_violates_nothing() -> None:
    index = InvariantIndex()
    index.put(res("a", {"vm-1": alloc("4Gi"), "vm-2": alloc("4Gi")}))
    assert index.counts() == dict.fromkeys(KINDS, 0)
    assert len(index) == 1


# --- slot_overfilled --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("allocs", "overfilled"),
    [
        (["4Gi", "4Gi"], False),  # exactly full
        (["6Gi", "4Gi"], False),  # the last VM overfilled it: allowed (6 < 8)
        (["8Gi", "1"], False),  # the 1-byte VM may have come first
        (["8Gi", "8Gi"], True),  # whichever came second found the slot full
        (["4Gi", "4Gi", "1"], False),  # 1 + 4Gi < 8Gi: the last 4Gi overfilled it
        (["20Gi"], False),  # one VM larger than the block: the reference allows it
        (["3Gi", "3Gi", "3Gi"], False),  # 9 - 3 = 6 < 8
        (["4Gi", "4Gi", "4Gi"], True),  # 12 - 4 = 8 >= 8
    ],
)
def test_overfill_is_sum_minus_largest_at_least_the_block(
    allocs: list[str], overfilled: bool
) -> None:
    index = InvariantIndex()
    index.put(res("a", {f"vm-{i}": alloc(m) for i, m in enumerate(allocs)}))
    expected = sum(parse_bytes(m) for m in allocs) - max(parse_bytes(m) for m in allocs)
    assert overfilled == (expected >= 8 * 1024**3)
    assert names(index, Kind.SLOT_OVERFILLED) == (["a"] if overfilled else [])


def parse_bytes(text: str) -> int:
    from service.quantity import Quantity

    return Quantity.parse(text).value()


def test_overfill_uses_exact_rounded_up_values() -> None:
    # 8Gi block; 4Gi + (4Gi - 0.5 bytes, rounded up to 4Gi) + 1m (rounded up to 1): the
    # rounding makes sum - largest reach the block exactly.
    index = InvariantIndex()
    half_below = f"{4 * 1024**3 - 1}.5"
    index.put(res("a", {"vm-1": alloc("4Gi"), "vm-2": alloc(half_below), "vm-3": alloc("1m")}))
    # values: 4Gi, 4Gi, 1 -> sum - largest = 4Gi + 1 < 8Gi
    assert index.counts()[Kind.SLOT_OVERFILLED] == 0
    index.put(res("a", {"vm-1": alloc("4Gi"), "vm-2": alloc(half_below), "vm-3": alloc("4Gi")}))
    assert index.counts()[Kind.SLOT_OVERFILLED] == 1


def test_a_slot_of_zero_memory_with_an_allocation_is_overfilled() -> None:
    index = InvariantIndex()
    index.put(res("a", {"vm-1": alloc("1Gi")}, memory="0"))
    index.put(res("b", {}, memory="0"))  # no allocation: nothing was written into it
    assert names(index, Kind.SLOT_OVERFILLED) == ["a"]


# --- allocation_without_host -------------------------------------------------------------


def test_allocations_without_a_target_host() -> None:
    index = InvariantIndex()
    index.put(res("a", {"vm-1": alloc()}, host=""))
    index.put(res("b", {}, host=""))  # an empty slot without a host is fine
    assert names(index, Kind.ALLOCATION_WITHOUT_HOST) == ["a"]
    index.put(res("a", {"vm-1": alloc()}, host="hv-2", rv="2"))
    assert names(index, Kind.ALLOCATION_WITHOUT_HOST) == []


# --- allocation_malformed ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        (alloc(ts=None), "creationTimestamp missing"),
        (alloc(ts="yesterday"), "is not RFC 3339"),
        (alloc(ts="2026-01-01 00:00:00Z"), "is not RFC 3339"),  # a space, not a T
        (alloc(ts="2026-01-01T00:00:00"), "is not RFC 3339"),  # no offset
        (alloc(ts="2026-02-30T00:00:00Z"), "is not RFC 3339"),
        (alloc(memory=None), "memory missing"),
        (alloc(memory="-1Gi"), "is negative"),
    ],
)
def test_malformed_allocations(entry: dict[str, Any], why: str) -> None:
    index = InvariantIndex()
    index.put(res("a", {"vm-1": entry, "vm-2": alloc()}))
    (v,) = index.violations(Kind.ALLOCATION_MALFORMED)
    assert v.object == "a"
    assert why in v.detail
    assert "vm-1" in v.detail
    assert "vm-2" not in v.detail


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("2026-01-01T00:00:00Z", True),
        ("2026-01-01T00:00:00.123456789Z", True),
        ("2026-01-01T02:00:00+02:00", True),
        ("2026-01-01T00:00:00z", False),
        ("2026-01-01", False),
        ("2026-13-01T00:00:00Z", False),
        ("2026-01-01T00:00:60Z", False),
    ],
)
def test_rfc3339(text: str, ok: bool) -> None:
    got = parse_rfc3339(text)
    assert (got is not None) == ok
    if ok and "+02:00" in text:
        assert got == parse_rfc3339("2026-01-01T00:00:00Z")


def test_an_undecodable_reservation_counts_when_its_allocations_failed() -> None:
    index = InvariantIndex()
    index.put(res("a", {"vm-1": alloc(), "vm-x": alloc()}))
    index.put(res("b", {"vm-x": alloc()}))
    index.undecodable("a", "$.spec.committedResourceReservation.allocations[...].resources[...]")
    (v,) = index.violations(Kind.ALLOCATION_MALFORMED)
    assert v.object == "a"
    assert "does not decode" in v.detail
    # Its decoded version is gone from the index: vm-x is in one slot only now.
    assert index._slots == {"vm-x": "b"}
    index.undecodable("c", "$.spec.resources[...]")  # not its allocations: not counted
    assert index.counts()[Kind.ALLOCATION_MALFORMED] == 1
    index.undecodable("a", None)
    assert index.counts()[Kind.ALLOCATION_MALFORMED] == 0
    # A decodable version replaces the mark too.
    index.undecodable("a", "$.spec.committedResourceReservation.allocations[...]")
    index.put(res("a", {"vm-1": alloc()}, rv="3"))
    assert index.counts()[Kind.ALLOCATION_MALFORMED] == 0


# --- vm_in_multiple_slots ----------------------------------------------------------------


def test_a_vm_in_two_slots_counts_once_the_grace_has_passed_without_further_events() -> None:
    clock = Clock()
    index = InvariantIndex(grace_s=60, clock=clock)
    index.put(res("a", {"vm-1": alloc(), "vm-2": alloc()}))
    index.put(res("b", {"vm-1": alloc()}))
    index.evaluate()
    assert index.counts()[Kind.VM_IN_MULTIPLE_SLOTS] == 0
    index.take_changed()
    clock.now += 59.9
    index.evaluate()
    assert index.counts()[Kind.VM_IN_MULTIPLE_SLOTS] == 0
    clock.now += 0.1
    index.evaluate()  # no event in between: the tick alone
    (v,) = index.violations(Kind.VM_IN_MULTIPLE_SLOTS)
    assert (v.object, v.reservations) == ("vm-1", ("a", "b"))
    assert index.take_changed() == {Kind.VM_IN_MULTIPLE_SLOTS}
    # Resolved (Cortex removed the candidate): gone at once.
    index.put(res("b", {}, rv="2"))
    assert index.counts()[Kind.VM_IN_MULTIPLE_SLOTS] == 0
    assert index.take_changed() == {Kind.VM_IN_MULTIPLE_SLOTS}
    # Listed twice again: the grace starts afresh.
    index.put(res("b", {"vm-1": alloc()}, rv="3"))
    clock.now += 30
    index.evaluate()
    assert index.counts()[Kind.VM_IN_MULTIPLE_SLOTS] == 0


def test_a_vm_in_three_slots_stays_listed_until_one_slot_is_left() -> None:
    clock = Clock()
    index = InvariantIndex(grace_s=0, clock=clock)
    for name in "abc":
        index.put(res(name, {"vm-1": alloc()}))
    assert index.violations(Kind.VM_IN_MULTIPLE_SLOTS)[0].reservations == ("a", "b", "c")
    index.remove("a")
    assert index.violations(Kind.VM_IN_MULTIPLE_SLOTS)[0].reservations == ("b", "c")
    index.update(res("c", {"vm-1": alloc()}), None)
    assert index.counts()[Kind.VM_IN_MULTIPLE_SLOTS] == 0
    assert index._slots == {"vm-1": "b"}
    assert not index._dup_since


def test_created_mode_counts_the_grace_from_the_second_oldest_timestamp() -> None:
    now = parse_rfc3339("2026-01-01T01:00:00Z")
    assert now is not None
    index = InvariantIndex(grace_s=900, clock=lambda: now, since="created")
    index.put(res("a", {"vm-1": alloc(ts="2026-01-01T00:00:00Z")}))  # an hour old
    index.put(res("b", {"vm-1": alloc(ts="2026-01-01T00:50:00Z")}))  # 10 min old
    index.put(res("c", {"vm-2": alloc(ts="2026-01-01T00:10:00Z")}))
    index.put(res("d", {"vm-2": alloc(ts="2026-01-01T00:20:00Z")}))
    index.put(res("e", {"vm-3": alloc(ts=None)}))  # no timestamp counts as old
    index.put(res("f", {"vm-3": alloc(ts=None)}))
    index.evaluate()
    assert names(index, Kind.VM_IN_MULTIPLE_SLOTS) == ["vm-2", "vm-3"]


# --- updates, deletes and cost ------------------------------------------------------------


def test_updates_and_deletes_take_back_what_an_object_contributed() -> None:
    index = InvariantIndex(grace_s=0)
    index.put(res("a", {"vm-1": alloc("8Gi"), "vm-2": alloc("8Gi", ts=None)}, host=""))
    index.put(res("b", {"vm-1": alloc()}))
    assert index.counts() == dict.fromkeys(KINDS, 1)
    assert index.take_changed() == set(KINDS)
    index.update(res("a", {}), None)
    assert index.counts() == dict.fromkeys(KINDS, 0)
    assert index.take_changed() == set(KINDS)
    assert index._slots == {"vm-1": "b"}
    # Not a CR slot any more (committedResourceReservation removed): gone too.
    obj = f.reservation("b", host="hv-1")
    del obj["spec"]["committedResourceReservation"]
    index.put(from_k8s(obj, Reservation))
    assert len(index) == 0
    assert index._slots == {}


def test_the_change_log_only_reports_changes_of_the_set() -> None:
    index = InvariantIndex()
    index.put(res("a", {"vm-1": alloc()}, host=""))
    assert index.take_changed() == {Kind.ALLOCATION_WITHOUT_HOST}
    index.put(res("a", {"vm-1": alloc(), "vm-2": alloc()}, host="", rv="2"))
    assert index.take_changed() == set()  # still the same object in violation


def test_an_update_touches_only_that_objects_entries() -> None:
    index = InvariantIndex()
    for i in range(2000):
        index.put(res(f"r-{i}", {f"vm-{i}-{j}": alloc("1Gi") for j in range(4)}))
    index.touched = 0
    # One VM added to one slot of 2,000: one entry touched, not the cluster.
    allocs = {f"vm-7-{j}": alloc("1Gi") for j in range(5)}
    index.put(res("r-7", allocs, rv="2"))
    assert index.touched == 1
    index.touched = 0
    index.put(res("r-7", allocs, rv="3"))  # same VMs (a status change): nothing
    assert index.touched == 0
    index.remove("r-8")
    assert index.touched == 4


def test_an_update_keeps_the_verdict_on_unchanged_timestamps_and_rechecks_changed_ones() -> None:
    index = InvariantIndex()
    index.put(res("a", {"vm-1": alloc(ts="bad"), "vm-2": alloc()}))
    index.put(res("a", {"vm-1": alloc(ts="bad"), "vm-2": alloc(), "vm-3": alloc()}, rv="2"))
    (v,) = index.violations(Kind.ALLOCATION_MALFORMED)
    assert "vm-1" in v.detail
    index.put(res("a", {"vm-1": alloc(), "vm-2": alloc(ts="worse"), "vm-3": alloc()}, rv="3"))
    (v,) = index.violations(Kind.ALLOCATION_MALFORMED)
    assert "vm-2" in v.detail
    assert "vm-1" not in v.detail
    index.put(res("a", {"vm-1": alloc(), "vm-2": alloc(), "vm-3": alloc()}, rv="4"))
    assert index.counts()[Kind.ALLOCATION_MALFORMED] == 0
    assert parse_rfc3339("\uff12026-01-01T00:00:00Z") is None  # a non-ASCII digit
