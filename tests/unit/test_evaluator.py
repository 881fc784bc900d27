"""Slot evaluator: free memory, slot filtering, remaining memory, overfill, slot choice."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.crs import (
    SlotEvaluator,
    hv_free_memory,
    is_slot,
    pick_slot,
    reservation_remaining_memory,
)
from service.crs.evaluator import HostSlots, slot_summary
from service.model import Hypervisor, Reservation, from_k8s

MI = 2**20
GI = 2**30
LABEL = "reservations.cortex.cloud/type"
_UNSET: Any = object()


def evaluator_over(
    free: Mapping[str, int], slots_by_host: Mapping[str, Sequence[Reservation]]
) -> SlotEvaluator:
    """An evaluator over the given slots per host, taken unfiltered (as a watch cache does)."""
    return SlotEvaluator(
        free, {h: HostSlots.from_reservations(rs) for h, rs in slots_by_host.items()}
    )


def hypervisor(
    name: str = "h1",
    *,
    capacity: Any = _UNSET,
    effective: Any = _UNSET,
    allocation: Any = _UNSET,
) -> Hypervisor:
    status: dict[str, Any] = {}
    if capacity is not _UNSET:
        status["capacity"] = capacity
    if effective is not _UNSET:
        status["effectiveCapacity"] = effective
    if allocation is not _UNSET:
        status["allocation"] = allocation
    return from_k8s({"metadata": {"name": name}, "status": status}, Hypervisor)


def slot(
    name: str = "slot",
    host: str = "h1",
    *,
    project: str = "p",
    group: str = "g",
    memory: Any = "8Gi",
    allocated: list[Any] | None = None,
    ready: str | None = "True",
    label: str | None = "committed-resource",
    crr: bool = True,
    cpu: Any = 4,
    alloc_cpu: Any = 0,
) -> Reservation:
    spec: dict[str, Any] = {"type": "CommittedResourceReservation", "targetHost": host}
    resources: dict[str, Any] = {"cpu": cpu}
    if memory is not None:
        resources["memory"] = memory
    spec["resources"] = resources
    if crr:
        allocations = {
            f"vm-{i}": {
                "creationTimestamp": "2026-01-01T00:00:00Z",
                "resources": {} if mem is None else {"memory": mem, "cpu": alloc_cpu},
            }
            for i, mem in enumerate(allocated or [])
        }
        spec["committedResourceReservation"] = {
            "projectID": project,
            "resourceGroup": group,
            "allocations": allocations or None,
        }
    obj: dict[str, Any] = {"metadata": {"name": name}, "spec": spec, "status": {}}
    if label is not None:
        obj["metadata"]["labels"] = {LABEL: label}
    if ready is not None:
        obj["status"]["conditions"] = [{"type": "Ready", "status": ready}]
    return from_k8s(obj, Reservation)


# --- hv free memory -----------------------------------------------------------------

HV_FREE = [
    pytest.param(
        hypervisor(capacity={"memory": "64Gi"}, allocation={"memory": "16Gi"}),
        48 * GI,
        id="capacity",
    ),
    pytest.param(
        hypervisor(
            capacity={"memory": "64Gi"}, effective={"memory": "32Gi"}, allocation={"memory": "16Gi"}
        ),
        16 * GI,
        id="effective-wins",
    ),
    pytest.param(
        hypervisor(capacity={"memory": "64Gi"}, effective=None, allocation={"memory": "16Gi"}),
        48 * GI,
        id="effective-null-uses-capacity",
    ),
    pytest.param(
        hypervisor(capacity={"memory": "64Gi"}, effective={}, allocation={}),
        0,
        id="effective-empty-map-means-zero",
    ),
    pytest.param(
        hypervisor(capacity={"memory": "64Gi"}, effective={"cpu": 8}),
        0,
        id="effective-missing-memory-key",
    ),
    pytest.param(hypervisor(capacity={"memory": "64Gi"}), 64 * GI, id="no-allocation"),
    pytest.param(hypervisor(capacity={"cpu": 8}, allocation={"cpu": 2}), 0, id="no-memory-keys"),
    pytest.param(hypervisor(), 0, id="empty-status"),
    pytest.param(
        hypervisor(capacity={"memory": "16Gi"}, allocation={"memory": "20Gi"}),
        0,
        id="over-allocated-floored",
    ),
    pytest.param(
        hypervisor(capacity={"memory": "1.5"}, allocation={"memory": "100m"}),
        1,
        id="values-rounded-up-before-subtracting",
    ),
]


@pytest.mark.parametrize(("hv", "expected"), HV_FREE)
def test_hv_free_memory(hv: Hypervisor, expected: int) -> None:
    assert hv_free_memory(hv) == expected


# --- slot filter --------------------------------------------------------------------

IS_SLOT = [
    pytest.param(slot(), True, id="ready-cr-slot"),
    pytest.param(slot(ready="False"), False, id="not-ready"),
    pytest.param(slot(ready="Unknown"), False, id="ready-unknown"),
    pytest.param(slot(ready=None), False, id="no-conditions"),
    pytest.param(slot(label="failover"), False, id="failover-label"),
    pytest.param(slot(label=None), False, id="no-label"),
    pytest.param(slot(crr=False), False, id="no-committed-resource-reservation"),
]


@pytest.mark.parametrize(("res", "expected"), IS_SLOT)
def test_is_slot(res: Reservation, expected: bool) -> None:
    assert is_slot(res) is expected


def test_is_slot_uses_first_ready_condition() -> None:
    obj = {
        "metadata": {"labels": {LABEL: "committed-resource"}},
        "spec": {"committedResourceReservation": {"projectID": "p"}},
        "status": {
            "conditions": [
                {"type": "Other", "status": "False"},
                {"type": "Ready", "status": "True"},
                {"type": "Ready", "status": "False"},
            ]
        },
    }
    assert is_slot(from_k8s(obj, Reservation)) is True


# --- remaining memory ---------------------------------------------------------------

REMAINING = [
    pytest.param(slot(memory="8Gi"), 8 * GI, id="empty-slot"),
    pytest.param(slot(memory="8Gi", allocated=["4Gi"]), 4 * GI, id="partially-used"),
    pytest.param(slot(memory="8Gi", allocated=["2Gi", 2 * GI]), 4 * GI, id="two-allocations"),
    pytest.param(slot(memory="8Gi", allocated=["8Gi"]), 0, id="fully-used"),
    pytest.param(slot(memory="4Gi", allocated=["8Gi"]), 0, id="over-allocated-clamped"),
    pytest.param(slot(memory=None), 0, id="no-memory-key"),
    pytest.param(slot(memory="8Gi", allocated=[None]), 8 * GI, id="allocation-without-memory"),
    pytest.param(slot(crr=False), 0, id="no-committed-resource-reservation"),
    pytest.param(slot(memory="1.5", allocated=["100m"]), 1, id="each-value-rounded-up"),
]


@pytest.mark.parametrize(("res", "expected"), REMAINING)
def test_reservation_remaining_memory(res: Reservation, expected: int) -> None:
    assert reservation_remaining_memory(res) == expected


def test_reservation_remaining_memory_of_none() -> None:
    assert reservation_remaining_memory(None) == 0


# --- pick_slot ----------------------------------------------------------------------

VM = 4096 * MI

PICK = [
    pytest.param([], "", id="no-candidates"),
    pytest.param([slot("a", memory="8Gi")], "a", id="single-fits"),
    pytest.param([slot("a", memory="8Gi", allocated=["8Gi"])], "", id="zero-remaining-excluded"),
    pytest.param(
        [slot("large", memory="8Gi"), slot("small", memory="6Gi")], "small", id="tightest-fit"
    ),
    pytest.param(
        [slot("slot-b", memory="6Gi"), slot("slot-a", memory="6Gi")], "slot-a", id="name-tiebreak"
    ),
    pytest.param(
        [slot("b", memory="6Gi"), slot("B", memory="6Gi"), slot("a", memory="6Gi")],
        "B",
        id="name-tiebreak-bytewise-uppercase-first",
    ),
    pytest.param(
        [slot("é", memory="6Gi"), slot("z", memory="6Gi")],
        "z",
        id="name-tiebreak-bytewise-non-ascii-last",
    ),
    pytest.param([slot("a", memory=None)], "", id="missing-memory-key"),
    pytest.param([slot("partial", memory="8Gi", allocated=["2Gi"])], "partial", id="partly-used"),
    pytest.param([slot("a", memory="4Gi", allocated=["2Gi"])], "a", id="overfill-smaller-than-vm"),
    pytest.param(
        [slot("partial", memory="4Gi", allocated=["2Gi"]), slot("full", memory="6Gi")],
        "full",
        id="full-coverage-beats-partial",
    ),
    pytest.param(
        [
            slot("low", memory="4Gi", allocated=["2Gi"]),
            slot("high", memory="4Gi", allocated=["1Gi"]),
        ],
        "high",
        id="highest-partial-coverage",
    ),
    pytest.param(
        [slot("cpu-full", memory="8Gi", cpu=2, allocated=["0"], alloc_cpu=2)],
        "cpu-full",
        id="cpu-exhausted-still-usable",
    ),
    pytest.param(
        [slot("more-cpu", memory="6Gi", cpu=8), slot("less-cpu", memory="6Gi", cpu=4)],
        "less-cpu",
        id="cpu-is-not-a-tiebreak",
    ),
    pytest.param(
        [slot("b", memory="4Gi"), slot("a", memory="6Gi")], "b", id="exact-fit-beats-larger"
    ),
]


@pytest.mark.parametrize(("candidates", "expected"), PICK)
def test_pick_slot(candidates: list[Reservation], expected: str) -> None:
    assert pick_slot(candidates, VM) == expected


remaining_mib = st.integers(min_value=0, max_value=64)


@given(
    st.lists(st.tuples(st.sampled_from("abcdefgh"), remaining_mib), max_size=8),
    st.integers(min_value=1, max_value=64),
)
def test_pick_slot_maximises_coverage_and_ignores_order(
    specs: list[tuple[str, int]], vm_mib: int
) -> None:
    candidates = [slot(name, memory=mem * MI) for name, mem in specs]
    chosen = pick_slot(candidates, vm_mib * MI)
    usable = [(n, m * MI) for n, m in specs if m > 0]
    if not usable:
        assert chosen == ""
        return
    best_coverage = max(min(m, vm_mib * MI) for _, m in usable)
    chosen_rem = {m for n, m in usable if n == chosen}
    assert chosen_rem, "the chosen name must be a usable candidate"
    assert max(min(m, vm_mib * MI) for m in chosen_rem) == best_coverage
    for perm in itertools.islice(itertools.permutations(candidates), 24):
        assert pick_slot(list(perm), vm_mib * MI) == chosen


# --- evaluator ----------------------------------------------------------------------


def test_slots_for_host_filters_project_and_group() -> None:
    mine = slot("mine")
    other_project = slot("other-project", project="q")
    other_group = slot("other-group", group="h")
    ev = evaluator_over({"h1": 64 * GI}, {"h1": [mine, other_project, other_group]})
    assert ev.slots_for_host("h1", "p", "g") == [mine]
    assert ev.slots_for_host("h2", "p", "g") == []


HAS_USABLE = [
    # (hv free, slots on host, vm) -> usable
    pytest.param(16 * GI, [slot(memory="8Gi", allocated=["4Gi"])], 4 * GI, True, id="room-left"),
    pytest.param(
        16 * GI, [slot(memory="8Gi", allocated=["6Gi"])], 4 * GI, True, id="overfill-into-host"
    ),
    pytest.param(
        8 * GI, [slot(memory="8Gi", allocated=["6Gi"])], 4 * GI, False, id="overfill-host-too-full"
    ),
    pytest.param(
        8 * GI, [slot(memory="8Gi", allocated=["4Gi"])], 4 * GI, True, id="exact-boundary"
    ),
    pytest.param(8 * GI, [slot(memory="8Gi", allocated=["8Gi"])], GI, False, id="slot-full"),
    pytest.param(
        24 * GI,
        [slot("mine", memory="8Gi", allocated=["6Gi"]), slot("theirs", project="q", memory="16Gi")],
        4 * GI,
        False,
        id="other-project-blocks-count",
    ),
    pytest.param(
        26 * GI,
        [slot("mine", memory="8Gi", allocated=["6Gi"]), slot("theirs", group="x", memory="16Gi")],
        4 * GI,
        True,
        id="other-group-blocks-count-enough-room",
    ),
    pytest.param(16 * GI, [slot(project="q")], GI, False, id="only-other-project-slots"),
    pytest.param(16 * GI, [], GI, False, id="no-slots"),
    pytest.param(8 * GI, [slot(memory="8Gi")], 8 * GI, True, id="vm-fills-the-whole-slot"),
    pytest.param(0, [slot(memory="8Gi")], GI, False, id="zero-free-negative-base"),
    pytest.param(
        0, [slot(memory="8Gi", allocated=["1Gi"])], 8 * GI, False, id="zero-free-slot-too-small"
    ),
]


@pytest.mark.parametrize(("free", "slots", "vm", "expected"), HAS_USABLE)
def test_has_usable_slot(free: int, slots: list[Reservation], vm: int, expected: bool) -> None:
    ev = evaluator_over({"h1": free}, {"h1": slots})
    assert ev.has_usable_slot("h1", "p", "g", vm) is expected


def test_has_usable_slot_unknown_host_counts_zero_free() -> None:
    ev = evaluator_over({}, {"h1": [slot(memory="8Gi")]})
    # free 0 - blocks 8Gi + remaining 8Gi = 0 >= vm?
    assert ev.has_usable_slot("h1", "p", "g", 0) is True
    assert ev.has_usable_slot("h1", "p", "g", 1) is False
    assert ev.has_usable_slot("nowhere", "p", "g", 0) is False


def test_from_objects_applies_reference_filters() -> None:
    hvs = [
        hypervisor("h1", capacity={"memory": "64Gi"}, allocation={"memory": "16Gi"}),
        hypervisor("h2", capacity={"memory": "64Gi"}, effective={"memory": "32Gi"}),
    ]
    good = slot("good", "h1")
    reservations = [
        good,
        slot("not-ready", "h1", ready="False"),
        slot("failover", "h1", label="failover"),
        slot("no-crr", "h1", crr=False),
        slot("on-h2", "h2"),
    ]
    ev = SlotEvaluator.from_objects(hvs, reservations)
    assert ev.slots_for_host("h1", "p", "g") == [good]
    assert [r.name for r in ev.slots_for_host("h2", "p", "g")] == ["on-h2"]
    # h2: effective 32Gi - 8Gi block + 8Gi remaining = 32Gi >= 32Gi, but not 32Gi + 1.
    assert ev.has_usable_slot("h2", "p", "g", 32 * GI) is True
    assert ev.has_usable_slot("h2", "p", "g", 32 * GI + 1) is False


def test_evaluator_accepts_any_mapping_and_small_subsets() -> None:
    from types import MappingProxyType

    slots = {"h1": HostSlots.from_reservations((slot("a"),))}
    ev = SlotEvaluator(MappingProxyType({"h1": 16 * GI}), MappingProxyType(slots))
    assert [r.name for r in ev.slots_for_host("h1", "p", "g")] == ["a"]
    assert ev.has_usable_slot("h1", "p", "g", GI) is True


# --- the summaries answer as a scan over the Reservation objects would ------------------


def _scan_slots(slots: Sequence[Reservation], project: str, group: str) -> list[Reservation]:
    return [
        r
        for r in slots
        if r.spec.committed_resource_reservation is not None
        and r.spec.committed_resource_reservation.matches_group(project, group)
    ]


def _scan_usable(
    free: int, slots: Sequence[Reservation], project: str, group: str, vm: int
) -> bool:
    """The reference formula, slot by slot: remaining > 0 and free - blocks + remaining >= vm."""
    blocks = 0
    for r in slots:
        block = (r.spec.resources or {}).get("memory")
        blocks += block.value() if block is not None else 0
    return any(
        reservation_remaining_memory(r) > 0
        and free - blocks + reservation_remaining_memory(r) >= vm
        for r in _scan_slots(slots, project, group)
    )


def test_slot_summary() -> None:
    s = slot_summary(slot("a", memory="8Gi", allocated=["2Gi", "1Gi"]))
    assert (s.name, s.project_id, s.resource_group) == ("a", "p", "g")
    assert (s.block_bytes, s.remaining_bytes) == (8 * GI, 5 * GI)
    assert len(s.allocation_uuids) == 2
    plain = slot_summary(slot("b", crr=False))
    assert plain.project_id is None
    assert (plain.remaining_bytes, plain.block_bytes) == (0, 8 * GI)


def test_host_slots_precomputes_blocks_and_groups() -> None:
    hs = HostSlots.from_reservations(
        [
            slot("a", memory="8Gi", allocated=["6Gi"]),
            slot("b", memory="4Gi"),
            slot("c", project="q"),
        ]
    )
    assert hs.all_blocks == 20 * GI
    group = hs.groups[("p", "g")]
    assert (group.max_remaining, group.host_blocks) == (4 * GI, 20 * GI)
    assert [s.name for s in group.slots] == ["a", "b"]


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["h1", "h2"]),
            st.sampled_from(["p", "q"]),
            st.sampled_from(["g", "x"]),
            st.integers(0, 16),
            st.lists(st.integers(0, 8), max_size=3),
            st.booleans(),
        ),
        max_size=8,
    ),
    st.integers(0, 40),
    st.integers(0, 24),
)
def test_summaries_agree_with_a_scan_of_the_reservations(
    specs: list[tuple[str, str, str, int, list[int], bool]], free_gib: int, vm_gib: int
) -> None:
    by_host: dict[str, list[Reservation]] = {}
    for i, (host, project, group, mem, allocs, crr) in enumerate(specs):
        r = slot(
            f"s{i}",
            host,
            project=project,
            group=group,
            memory=f"{mem}Gi",
            allocated=[f"{a}Gi" for a in allocs],
            crr=crr,
        )
        by_host.setdefault(host, []).append(r)
    free = {"h1": free_gib * GI}
    ev = evaluator_over(free, by_host)
    for host in ("h1", "h2", "h3"):
        slots = by_host.get(host, [])
        for project, group in itertools.product(["p", "q"], ["g", "x"]):
            expected_slots = _scan_slots(slots, project, group)
            expected_any = any(reservation_remaining_memory(r) > 0 for r in expected_slots)
            expected_usable = _scan_usable(free.get(host, 0), slots, project, group, vm_gib * GI)
            assert ev.slots_for_host(host, project, group) == expected_slots
            assert ev.has_slot_with_memory(host, project, group) is expected_any
            assert ev.has_usable_slot(host, project, group, vm_gib * GI) is expected_usable
            summaries = ev.slot_summaries_for_host(host, project, group)
            assert [s.reservation for s in summaries] == expected_slots
