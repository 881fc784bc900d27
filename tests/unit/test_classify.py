"""Active commitments, exhaustion, and both classifiers branch by branch."""

from __future__ import annotations

from typing import Any

import pytest

from service.crs import (
    CrSlot,
    SlotEvaluator,
    active_commitments,
    classify_no_host_found,
    classify_placement,
    commitments_exhausted,
)
from service.model import CommittedResource, from_k8s
from tests.unit.test_evaluator import GI, evaluator_over, slot

P, G = "project-1", "kvm_v2_hana_s"


def cr(
    amount: Any = "8Gi",
    used: Any = None,
    *,
    state: str = "confirmed",
    project: str = P,
    group: str = G,
    used_key: str = "memory",
) -> CommittedResource:
    obj: dict[str, Any] = {
        "spec": {
            "projectID": project,
            "flavorGroupName": group,
            "state": state,
            "amount": amount,
            "resourceType": "memory",
        },
        "status": {},
    }
    if used is not None:
        obj["status"]["usedResources"] = {used_key: used}
    return from_k8s(obj, CommittedResource)


# --- active commitments -------------------------------------------------------------

STATES = [
    ("confirmed", True),
    ("guaranteed", True),
    ("planned", False),
    ("pending", False),
    ("superseded", False),
    ("expired", False),
    ("", False),
]


@pytest.mark.parametrize(("state", "active"), STATES, ids=[s or "empty" for s, _ in STATES])
def test_only_confirmed_and_guaranteed_are_active(state: str, active: bool) -> None:
    assert (active_commitments([cr(state=state)], P, G) != []) is active


def test_active_commitments_match_project_and_group() -> None:
    mine = cr()
    crs = [mine, cr(project="other"), cr(group="other"), cr(state="pending")]
    assert active_commitments(crs, P, G) == [mine]
    assert active_commitments(iter(crs), P, G) == [mine]


EXHAUSTED = [
    pytest.param([cr("8Gi", "8Gi")], True, id="used-equals-amount"),
    pytest.param([cr("8Gi", "10Gi")], True, id="used-exceeds-amount"),
    pytest.param([cr("8Gi", "4Gi")], False, id="room-left"),
    pytest.param([cr("8Gi")], False, id="no-used-resources"),
    pytest.param([cr("8Gi", "8Gi", used_key="cpu")], False, id="used-without-memory-key"),
    pytest.param([cr("4Gi", "4Gi"), cr("4Gi", "4Gi", state="guaranteed")], True, id="sum-full"),
    pytest.param([cr("4Gi", "8Gi"), cr("4Gi")], True, id="sum-over-one-under"),
    pytest.param([cr("1.5Gi", "1536Mi")], True, id="decimal-amount-exact-equal"),
    pytest.param([cr("1.5Gi", "1535Mi")], False, id="decimal-amount-just-below"),
    pytest.param([cr("0.1", "0.1"), cr("0.2", "0.2")], True, id="no-float-drift"),
    pytest.param([cr("0.3", "0.1"), cr("0", "0.2")], True, id="no-float-drift-across-crs"),
    pytest.param([cr(1610612736, "1.5Gi")], True, id="int-amount-vs-string-used"),
    pytest.param([cr("1610612737", "1.5Gi")], False, id="one-byte-left"),
    pytest.param([], True, id="empty-is-exhausted"),
]


@pytest.mark.parametrize(("crs", "expected"), EXHAUSTED)
def test_commitments_exhausted(crs: list[CommittedResource], expected: bool) -> None:
    assert commitments_exhausted(crs) is expected
    assert commitments_exhausted(iter(crs)) is expected  # one pass over any iterable


# --- classify_placement -------------------------------------------------------------


def evaluator(**slots_by_host: list[Any]) -> SlotEvaluator:
    return evaluator_over({h: 64 * GI for h in slots_by_host}, slots_by_host)


PLACEMENT = [
    pytest.param([], evaluator(h1=[slot(project=P, group=G)]), ["h1"], "no_cr", id="no-active-cr"),
    pytest.param(
        [cr("8Gi", "8Gi")],
        evaluator(h1=[slot(project=P, group=G)]),
        ["h1"],
        "no_cr",
        id="exhausted",
    ),
    pytest.param(
        [cr("8Gi", "4Gi")], evaluator(h1=[slot(project=P, group=G)]), ["h1"], "slot_used", id="used"
    ),
    pytest.param(
        [cr()],
        evaluator(h1=[], h2=[slot(project=P, group=G)]),
        ["h1", "h2"],
        "slot_used",
        id="slot-on-non-first-candidate",
    ),
    pytest.param(
        [cr()],
        evaluator(h1=[slot(project=P, group=G, allocated=["8Gi"])]),
        ["h1"],
        "slot_missed",
        id="slot-full",
    ),
    pytest.param(
        [cr()],
        evaluator(h1=[slot(project="other", group=G)]),
        ["h1"],
        "slot_missed",
        id="other-project-slot",
    ),
    pytest.param(
        [cr()],
        evaluator(h9=[slot(project=P, group=G)]),
        ["h1"],
        "slot_missed",
        id="slot-not-on-a-candidate",
    ),
    pytest.param([cr()], evaluator(), [], "slot_missed", id="no-candidates"),
    pytest.param(
        [cr()],
        evaluator(h1=[slot(project=P, group=G, memory="4Gi", allocated=["3Gi"])]),
        ["h1"],
        "slot_used",
        id="any-remaining-counts-even-below-vm-size",
    ),
]


@pytest.mark.parametrize(("crs", "ev", "hosts", "expected"), PLACEMENT)
def test_classify_placement(
    crs: list[CommittedResource], ev: SlotEvaluator, hosts: list[str], expected: str
) -> None:
    assert classify_placement(ev, crs, hosts, P, G) == expected


# --- classify_no_host_found ---------------------------------------------------------

VM = 4 * GI


def single_host(free: int, *slots: Any) -> SlotEvaluator:
    return evaluator_over({"h1": free}, {"h1": list(slots)})


NO_HOST = [
    pytest.param([], single_host(16 * GI), ["h1"], "no_cr", id="no-active-cr"),
    pytest.param(
        [cr("8Gi", "8Gi")],
        single_host(16 * GI, slot(project=P, group=G)),
        ["h1"],
        "cr_exhausted",
        id="used-equals-capacity",
    ),
    pytest.param(
        [cr("8Gi", "10000Mi")], single_host(16 * GI), ["h1"], "cr_exhausted", id="used-over"
    ),
    pytest.param(
        [cr("4Gi", "4Gi"), cr("4Gi", "4Gi", state="guaranteed")],
        single_host(16 * GI),
        ["h1"],
        "cr_exhausted",
        id="multiple-crs-full",
    ),
    pytest.param(
        [cr("8Gi", "4Gi")],
        single_host(16 * GI, slot(project=P, group=G, allocated=["8Gi"])),
        ["h1"],
        "slot_exhausted",
        id="slot-fully-allocated",
    ),
    pytest.param([cr("8Gi", "0")], single_host(16 * GI), ["h1"], "slot_exhausted", id="no-slots"),
    pytest.param(
        [cr("8Gi", "4Gi")],
        single_host(16 * GI, slot(project=P, group=G, allocated=["4Gi"])),
        ["h1"],
        "slot_blocked",
        id="free-slot-on-input-host",
    ),
    pytest.param(
        [cr("8Gi", "4Gi")],
        single_host(16 * GI, slot(project=P, group=G, allocated=["6Gi"])),
        ["h1"],
        "slot_blocked",
        id="overfill-slot-smaller-than-vm",
    ),
    pytest.param(
        [cr("8Gi", "4Gi")],
        single_host(8 * GI, slot(project=P, group=G, allocated=["6Gi"])),
        ["h1"],
        "slot_exhausted",
        id="overfill-but-host-too-full",
    ),
    pytest.param(
        [cr("8Gi")],
        single_host(16 * GI, slot(project="other-project", group=G)),
        ["h1"],
        "slot_exhausted",
        id="other-project-slot-ignored",
    ),
    pytest.param(
        [cr("8Gi")],
        single_host(16 * GI, slot(project=P, group=G)),
        ["h2"],
        "slot_exhausted",
        id="slot-not-on-an-input-host",
    ),
    pytest.param(
        [cr("8Gi")],
        single_host(16 * GI, slot(project=P, group=G)),
        [],
        "slot_exhausted",
        id="no-input-hosts",
    ),
]


@pytest.mark.parametrize(("crs", "ev", "hosts", "expected"), NO_HOST)
def test_classify_no_host_found(
    crs: list[CommittedResource], ev: SlotEvaluator, hosts: list[str], expected: str
) -> None:
    assert classify_no_host_found(crs, ev, hosts, P, G, VM) == expected


def test_classifier_results_are_members_that_read_as_plain_strings() -> None:
    # The classifiers return the enum the wire event carries; being a StrEnum it is still
    # the plain label string wherever one is expected (counter labels, logs, comparisons).
    result = classify_placement(evaluator(), [], [], P, G)
    assert result is CrSlot.NO_CR
    assert isinstance(result, str)
    assert (str(result), f"{result}", result) == ("no_cr", "no_cr", "no_cr")
    assert classify_no_host_found([], evaluator(), [], P, G, VM) is CrSlot.NO_CR


def test_cr_slot_values() -> None:
    assert {s.value for s in CrSlot} == {
        "no_cr",
        "slot_used",
        "slot_missed",
        "cr_exhausted",
        "slot_exhausted",
        "slot_blocked",
        "error",
        "payg",
        "skipped",
    }
