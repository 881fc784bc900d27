"""Reference parity on messy input: Go's null rule, and the quantity text written.

The reference decodes everything with Go's ``encoding/json``: a ``null`` struct field is
the field's zero value (the same as leaving it out), a ``null`` list element or map value
is the zero value of the element type. The property tests put ``null`` at every position
of a generated flavor-groups Knowledge and of a generated Nova outcome, one position per
example, and check that the classification equals the one of the document with the key
left out (fields) or with the zero value in its place (elements, map values), and, for the
entries that add nothing a request can hit (a null feature or flavor), the one of the
original document. docs/semantics.md states each rule.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.crs import Recorder, SlotEvaluator
from service.crs.ports import Snapshot
from service.model import (
    CommittedResource,
    ExternalSchedulerRequest,
    Hypervisor,
    Knowledge,
    Reservation,
    from_k8s,
)
from service.quantity import Quantity, format_binary_si, format_decimal_si
from service.stream.codec import INPUT_TYPE, Poison, decode_input
from tests import factories as fx
from tests import nova

P = "p1"
GROUPS = ("ga", "gb", "gc", "gd")
HOSTS = ("h0", "h1", "h2")
FLAVOR_NAMES = ("f-small", "f-medium", "f-large", "f-huge", "f-odd")
PAYG = "f-not-in-any-group"

# gc's commitment is exhausted and gd has none, so every classification branch is reached.
_HYPERVISORS = [from_k8s(fx.hypervisor(h, memory="256Gi"), Hypervisor) for h in HOSTS]
_RESERVATIONS = [
    from_k8s(fx.reservation(f"slot-{g}-{h}", host=h, project=P, group=g, memory=mem), Reservation)
    for g in GROUPS
    for h, mem in (("h0", "32Gi"), ("h2", "200Gi"))
]
_COMMITMENTS = [
    from_k8s(
        fx.committed_resource(f"cr-{g}", project=P, group=g, amount=amount, used=used),
        CommittedResource,
    )
    for g, amount, used in (("ga", "100Gi", "0"), ("gb", "100Gi", "0"), ("gc", "10Gi", "10Gi"))
]


class _State:
    """A fixed cluster; writes are recorded, not applied (every event sees the same data)."""

    def __init__(self, knowledge: Knowledge | None) -> None:
        self.knowledge = knowledge
        self.writes: list[tuple[str, str, dict[str, object]]] = []

    async def snapshot(self, hosts: Collection[str], project_id: str) -> Snapshot:
        return Snapshot(
            evaluator=SlotEvaluator.from_objects(_HYPERVISORS, _RESERVATIONS),
            committed_resources=_COMMITMENTS,
            knowledge=self.knowledge,
        )

    async def reservations_on_host(self, host: str) -> Sequence[Reservation]:
        return [r for r in _RESERVATIONS if r.spec.target_host == host]

    async def get_reservation(self, name: str) -> Reservation | None:
        return next((r for r in _RESERVATIONS if r.name == name), None)

    async def patch_allocation(
        self, reservation: Reservation, instance_uuid: str, allocation: dict[str, object]
    ) -> Reservation:
        self.writes.append((reservation.name, instance_uuid, allocation))
        return reservation


def _key(outcome: Any) -> tuple[Any, ...]:
    return (
        outcome.kind,
        outcome.cr_slot,
        outcome.flavor_group,
        outcome.target_host,
        outcome.vm_memory_bytes,
        outcome.reservation,
        outcome.allocation,
    )


# --- document positions and their null / reference variants --------------------------

# Maps (Go map[string]T): a null value is a present entry holding the zero value.
_MAP_KEYS = frozenset({"labels", "annotations", "extraSpecs", "extra_specs", "weights"})
# map[string]any: a null value is a nil interface, and so is anything inside it.
_ANY_KEYS = frozenset({"scheduler_hints"})
_STRING_LISTS = frozenset({"orderedHosts", "nova_object.changes", "ignore_hosts", "force_hosts"})


def _zero_like(value: Any) -> Any:
    """The JSON of Go's zero value for the type ``value`` has."""
    if isinstance(value, dict):
        return {}
    if isinstance(value, list):
        return []
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return 0
    if isinstance(value, str):
        return ""
    return None


def _positions(doc: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], str]]:
    """Every (path, kind) where a null can go: a field, a map value, a list element, or a
    new list element inserted at an index."""
    in_any = any(p in _ANY_KEYS for p in path if isinstance(p, str))
    if isinstance(doc, dict):
        parent = path[-1] if path else None
        for key, value in doc.items():
            if in_any:
                kind = "any"
            elif parent in _MAP_KEYS:
                kind = "map"
            else:
                kind = "field"
            yield (*path, key), kind
            yield from _positions(value, (*path, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield (*path, i), "any" if in_any else "item"
            yield from _positions(value, (*path, i))
        for i in range(len(doc) + 1):
            yield (*path, i), "any-insert" if in_any else "insert"


def _item_zero(path: tuple[Any, ...], container: list[Any]) -> Any:
    if container:
        return _zero_like(container[0])
    return "" if path[-2] in _STRING_LISTS else {}


def _variants(doc: Any, path: tuple[Any, ...], kind: str) -> tuple[Any, Any]:
    """(document with null at ``path``, the document Go's rule says it equals)."""
    with_null, reference = copy.deepcopy(doc), copy.deepcopy(doc)
    *parents, last = path
    a, b = with_null, reference
    for p in parents:
        a, b = a[p], b[p]
    if kind in ("insert", "any-insert"):
        zero = None if kind == "any-insert" else _item_zero(path, b)
        a.insert(last, None)
        b.insert(last, zero)
    elif kind == "field":
        a[last] = None
        del b[last]
    elif kind == "any":
        a[last] = None
        b[last] = None  # nil either way; the property is "decodes and classifies"
    else:  # a map value or a list element: present, with the zero value
        a[last] = None
        b[last] = _zero_like(b[last])
    return with_null, reference


# --- the Knowledge payload ------------------------------------------------------------


@st.composite
def _flavor(draw: st.DrawFn) -> dict[str, Any]:
    memory_mb = draw(st.sampled_from([2048, 4096, 16384, 65536]))
    out = {
        "name": draw(st.sampled_from(FLAVOR_NAMES)),
        "vcpus": draw(st.integers(1, 64)),
        "memoryMB": memory_mb,
        "diskGB": 64,
    }
    if draw(st.booleans()):
        out["extraSpecs"] = {"hw_version": "v2"}
    return out


@st.composite
def _feature(draw: st.DrawFn, name: str) -> dict[str, Any]:
    flavors = draw(st.lists(_flavor(), min_size=1, max_size=3))
    by_mem = sorted(flavors, key=lambda f: f["memoryMB"])
    shape = draw(st.sampled_from(["fixed", "variable", "none", "inconsistent"]))
    ratios = {
        "fixed": {"ramCoreRatio": 4096},
        "variable": {"ramCoreRatioMin": 2048, "ramCoreRatioMax": 16384},
        "none": {},
        "inconsistent": {"ramCoreRatioMin": 2048},
    }[shape]
    return {
        "name": name,
        "flavors": flavors,
        "largestFlavor": by_mem[-1],
        "smallestFlavor": by_mem[0],
        **ratios,
    }


@st.composite
def _knowledge_doc(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(GROUPS), min_size=1, max_size=4, unique=True))
    features = [draw(_feature(n)) for n in names]
    return {
        "metadata": {"name": "flavor-groups", "labels": {"app": "cortex"}},
        "status": {
            "conditions": [{"type": "Ready", "status": "True", "reason": "Extracted"}],
            "raw": {"features": features},
            "rawLength": len(features),
        },
    }


def _requested_flavors(doc: dict[str, Any]) -> list[str]:
    names = {f["name"] for g in doc["status"]["raw"]["features"] for f in g["flavors"]}
    return [*sorted(names), PAYG]


async def _classify_knowledge(doc: Any, flavors: Sequence[str]) -> list[tuple[Any, ...]]:
    # Through the bytes path, as the informer decodes what the API server sends.
    knowledge = from_k8s(json.dumps(doc).encode(), Knowledge)
    recorder = Recorder(_State(knowledge))
    out = []
    for i, name in enumerate(flavors):
        body = nova.request(f"vm-{i}", project_id=P, flavor_name=name, hosts=["h1", "h0"])
        request = nova.parse_request(body)
        placed = await recorder.record(nova.decision("h0", ["h1", "h0"]), request)
        not_placed = await recorder.record(nova.decision(None), request)
        out += [_key(placed), _key(not_placed)]
    return out


def _knowledge_case(doc: dict[str, Any], path: tuple[Any, ...], kind: str) -> None:
    flavors = _requested_flavors(doc)
    with_null, reference = _variants(doc, path, kind)
    got = asyncio.run(_classify_knowledge(with_null, flavors))
    assert got == asyncio.run(_classify_knowledge(reference, flavors)), (path, kind)
    if kind == "insert" and path[-2] in ("features", "flavors"):
        # A null feature is a group named "" without flavors, a null flavor one named ""
        # with 0 MiB: neither is reachable by a request that names a flavor.
        assert got == asyncio.run(_classify_knowledge(doc, flavors)), path


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_knowledge_doc(), data=st.data())
def test_null_anywhere_in_the_knowledge_is_gos_zero_value(
    doc: dict[str, Any], data: st.DataObject
) -> None:
    path, kind = data.draw(st.sampled_from(list(_positions(doc))), label="position")
    _knowledge_case(doc, path, kind)


def test_every_knowledge_position_is_covered_once() -> None:
    # The property test samples; this walks every position of one rich payload.
    features = [
        {
            "name": "ga",
            "flavors": [
                {"name": "f-small", "vcpus": 2, "memoryMB": 4096, "extraSpecs": {"a": "b"}},
                {"name": "f-large", "vcpus": 8, "memoryMB": 16384, "diskGB": 64},
            ],
            "largestFlavor": {"name": "f-large", "vcpus": 8, "memoryMB": 16384},
            "smallestFlavor": {"name": "f-small", "vcpus": 2, "memoryMB": 4096},
            "ramCoreRatio": 2048,
            "ramCoreRatioMin": 2048,
            "ramCoreRatioMax": 2048,
        },
        {
            "name": "gb",
            "flavors": [{"name": "f-medium", "vcpus": 4, "memoryMB": 8192, "ephemeralGB": 0}],
            "largestFlavor": {"name": "f-medium", "vcpus": 4, "memoryMB": 8192},
            "smallestFlavor": {"name": "f-medium", "vcpus": 4, "memoryMB": 8192},
            "ramCoreRatioMin": 1024,
            "ramCoreRatioMax": 4096,
        },
    ]
    doc = {
        "metadata": {"name": "flavor-groups", "labels": {"app": "cortex"}},
        "status": {
            "conditions": [{"type": "Ready", "status": "True"}],
            "raw": {"features": features},
            "rawLength": 2,
        },
    }
    positions = list(_positions(doc))
    assert len(positions) > 60
    for path, kind in positions:
        _knowledge_case(doc, path, kind)


def test_the_issue_examples_resolve_the_valid_groups() -> None:
    """The four shapes from the issue: the valid groups still classify (no cr_slot=error)."""
    good = {
        "name": "ga",
        "flavors": [{"name": "f-small", "vcpus": 2, "memoryMB": 4096}],
        "largestFlavor": {"name": "f-small", "vcpus": 2, "memoryMB": 4096},
        "smallestFlavor": {"name": "f-small", "vcpus": 2, "memoryMB": 4096},
    }
    messy = [
        good,
        None,
        {"name": "gb", "flavors": None, "largestFlavor": None, "smallestFlavor": None},
        {"name": "gc", "flavors": [None, {"name": "f-large", "vcpus": 8, "memoryMB": 16384}]},
    ]
    doc = fx.knowledge(messy)
    got = asyncio.run(_classify_knowledge(doc, ["f-small", "f-large"]))
    # f-small: slot_used on h0 (ga has a commitment and a slot), slot_blocked without host.
    assert [k[1:3] for k in got] == [
        ("slot_used", "ga"),
        ("slot_blocked", "ga"),
        ("no_cr", "gc"),  # gc's commitment is used up
        ("cr_exhausted", "gc"),
    ]


def test_null_smallest_flavor_invalidates_a_ratio_group_like_go() -> None:
    # Go decodes it as a zero flavor, and Validate() rejects fixed/variable groups whose
    # smallest flavor has 0 MiB: the group is skipped (PAYG), the rest still resolves.
    feature = {
        "name": "ga",
        "flavors": [{"name": "f-small", "vcpus": 2, "memoryMB": 4096}],
        "smallestFlavor": None,
        "ramCoreRatio": 2048,
    }
    other = {"name": "gb", "flavors": [{"name": "f-large", "vcpus": 8, "memoryMB": 16384}]}
    got = asyncio.run(_classify_knowledge(fx.knowledge([feature, other]), ["f-small", "f-large"]))
    assert [k[1] for k in got] == ["payg", "payg", "slot_used", "slot_blocked"]


def test_a_null_flavor_is_the_flavor_named_empty() -> None:
    # The documented consequence of the zero value: a request without a flavor name finds
    # it (0 MiB, 0 vCPUs), exactly as the reference's FindFlavorInGroups does.
    doc = fx.knowledge([{"name": "gb", "flavors": [None]}])
    got = asyncio.run(_classify_knowledge(doc, [""]))
    assert [k[1:3] for k in got[:2]] == [("slot_used", "gb"), ("slot_blocked", "gb")]
    assert got[0][4] == 0  # vm_memory_bytes


TYPE_ERRORS = [
    pytest.param({"features": [{"name": 5}]}, id="name-not-a-string"),
    pytest.param({"features": [{"flavors": [{"vcpus": -1}]}]}, id="negative-uint64"),
    pytest.param({"features": [{"flavors": [{"memoryMB": 1.5}]}]}, id="fraction-uint64"),
    # encoding/json refuses a number that does not fit the Go field's width.
    pytest.param({"features": [{"flavors": [{"memoryMB": 2**64}]}]}, id="overflow-uint64"),
    pytest.param({"features": [{"ramCoreRatio": 2**64}]}, id="overflow-ratio"),
    pytest.param({"features": [{"flavors": {"name": "x"}}]}, id="flavors-not-a-list"),
    pytest.param({"features": [{"ramCoreRatio": "4"}]}, id="ratio-not-a-number"),
    pytest.param({"features": [7]}, id="feature-not-an-object"),
]


@pytest.mark.parametrize("raw", TYPE_ERRORS)
def test_type_mismatches_still_fail_the_lookup_as_in_go(raw: dict[str, Any]) -> None:
    doc = {
        "metadata": {"name": "flavor-groups"},
        "status": {"conditions": [{"type": "Ready", "status": "True"}], "raw": raw},
    }
    got = asyncio.run(_classify_knowledge(doc, ["f-small"]))
    assert [k[1:3] for k in got] == [("error", "unknown"), ("error", "unknown")]


# --- CRDs read by the evaluator -------------------------------------------------------


def test_null_quantities_and_allocations_decode_as_go_zero_values() -> None:
    res = from_k8s(
        json.dumps(
            {
                "metadata": {"name": "r", "labels": None},
                "spec": {
                    "targetHost": None,
                    "resources": {"memory": "8Gi", "cpu": None},
                    "committedResourceReservation": {
                        "projectID": None,
                        "allocations": {"vm-1": None, "vm-2": {"resources": {"memory": None}}},
                    },
                },
                "status": {"conditions": [None, {"type": "Ready", "status": "True"}]},
            }
        ).encode(),
        Reservation,
    )
    assert res.spec.target_host == ""
    assert res.spec.resources is not None
    assert res.spec.resources["cpu"] == Quantity.from_int(0)
    crr = res.spec.committed_resource_reservation
    assert crr is not None
    assert crr.project_id == ""
    # A null allocation is still an allocation (Go keeps the map key): the VM is "present".
    assert crr.allocations is not None
    assert set(crr.allocations) == {"vm-1", "vm-2"}
    assert crr.allocations["vm-1"].resources == {}
    cr = from_k8s({"spec": {"amount": None, "projectID": P}}, CommittedResource)
    assert cr.spec.amount == Quantity.from_int(0)
    hv = from_k8s({"status": {"effectiveCapacity": None, "capacity": None}}, Hypervisor)
    assert hv.status.effective_capacity is None


# --- the Nova outcome -----------------------------------------------------------------

KNOWLEDGE = from_k8s(
    fx.knowledge(
        [
            fx.flavor_group("ga", [fx.flavor("f-small", 4096, 2), fx.flavor("f-large", 16384, 8)]),
            fx.flavor_group("gc", [fx.flavor("f-medium", 8192, 4)]),
            fx.flavor_group("gd", [fx.flavor("f-huge", 65536, 16)]),
        ]
    ),
    Knowledge,
)


@st.composite
def _outcome_data(draw: st.DrawFn) -> dict[str, Any]:
    hosts = draw(st.lists(st.sampled_from(HOSTS), min_size=0, max_size=3, unique=True))
    hints = draw(
        st.sampled_from(
            [None, {"_nova_check_type": "rebuild"}, {"_nova_check_type": ["live_migrate"]}]
        )
    )
    request = nova.request(
        "vm-1",
        project_id=P,
        flavor_name=draw(st.sampled_from(["f-small", "f-large", "f-medium", "f-huge", PAYG])),
        hosts=hosts,
        hints=hints,
        skip_cr_tracking=draw(st.sampled_from([None, False, True])),
        context_project_id=draw(st.sampled_from([None, ""])),
    )
    target = draw(st.sampled_from([None, "h0", "h1"]))
    ordered = draw(st.lists(st.sampled_from(HOSTS), max_size=3, unique=True))
    decision = nova.decision_dict(target, ordered, intent=draw(st.sampled_from([None, "create"])))
    return {"decision": decision, "request": request}


def _classify_outcome(data: Any) -> tuple[Any, ...]:
    """What the service does with the event: decode it (as the consumer does), record it."""
    event = {
        "specversion": "1.0",
        "id": "e-1",
        "source": "test",
        "type": INPUT_TYPE,
        "data": data,
    }
    try:
        decoded = decode_input(json.dumps(event).encode(), None, max_bytes=1 << 20)
    except Poison as exc:
        return ("dead-letter", exc.code)
    outcome = asyncio.run(
        Recorder(_State(KNOWLEDGE)).record(decoded.data.decision, decoded.data.request)
    )
    return (*_key(outcome), outcome.intent, outcome.project_id, outcome.instance_uuid)


def _outcome_case(data: dict[str, Any], path: tuple[Any, ...], kind: str) -> None:
    with_null, reference = _variants(data, path, kind)
    assert _classify_outcome(with_null) == _classify_outcome(reference), (path, kind)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_outcome_data(), choice=st.data())
def test_null_anywhere_in_the_nova_outcome_is_gos_zero_value(
    data: dict[str, Any], choice: st.DataObject
) -> None:
    path, kind = choice.draw(st.sampled_from(list(_positions(data))), label="position")
    _outcome_case(data, path, kind)


def test_every_nova_request_position_is_covered_once() -> None:
    data = {
        "decision": nova.decision_dict("h0", ["h0", "h1"], intent="create", name="d"),
        "request": nova.request(
            "vm-1",
            project_id=P,
            flavor_name="f-small",
            hosts=["h0", "h1"],
            hints={"_nova_check_type": ["rebuild"]},
            skip_cr_tracking=False,
        ),
    }
    positions = list(_positions(data))
    assert len(positions) > 70
    for path, kind in positions:
        _outcome_case(data, path, kind)


def test_null_hosts_and_weights_are_empty_as_in_go() -> None:
    body = nova.request("vm-1", project_id=P, flavor_name="f-small", hosts=["h0"])
    body["hosts"] = None
    body["weights"] = None
    got = _classify_outcome({"decision": nova.decision_dict(None), "request": body})
    # No input host to try: the commitment has room but no host was offered.
    assert got[:3] == ("no_host_found", "slot_exhausted", "ga")
    body["hosts"] = [None, {"host": "h0", "hypervisor_hostname": None}]
    body["weights"] = {"h0": None}
    got = _classify_outcome({"decision": nova.decision_dict(None), "request": body})
    assert got[:3] == ("no_host_found", "slot_blocked", "ga")
    request = from_k8s(body, ExternalSchedulerRequest)
    assert request.input_hosts == ["", "h0"]
    assert request.weights == {"h0": 0.0}


def test_type_mismatches_in_the_request_are_still_dead_lettered() -> None:
    body = nova.request("vm-1", project_id=P, flavor_name="f-small")
    body["hosts"] = [{"host": 7}]
    assert _classify_outcome({"decision": nova.decision_dict(None), "request": body})[0] == (
        "dead-letter"
    )
    body = nova.request("vm-1", project_id=P, flavor_name="f-small")
    body["spec"]["nova_object.data"]["flavor"]["nova_object.data"]["vcpus"] = -2  # uint64
    assert _classify_outcome({"decision": nova.decision_dict(None), "request": body})[0] == (
        "dead-letter"
    )


@pytest.mark.parametrize("field", ["live", "rebuild", "resize", "vmware"])
@pytest.mark.parametrize("number", ["1e309", "-1e309", "123456789012345678901234567890"])
def test_fields_the_reference_does_not_declare_are_skipped_unread(field: str, number: str) -> None:
    # encoding/json skips an undeclared field's value (any valid JSON); msgspec refused a
    # number beyond a double in it ("Number out of range"): a dead letter. Found by review.
    body = nova.request("vm-1", project_id=P, flavor_name="f-small", hosts=["h0"])
    body[field] = "HUGE"
    event = {"specversion": "1.0", "id": "e-1", "source": "t", "type": INPUT_TYPE}
    event["data"] = {"decision": nova.decision_dict(None), "request": body}
    value = json.dumps(event).replace('"HUGE"', number).encode()
    decoded = decode_input(value, None, max_bytes=1 << 20)
    outcome = asyncio.run(
        Recorder(_State(KNOWLEDGE)).record(decoded.data.decision, decoded.data.request)
    )
    assert outcome.kind == "no_host_found"


# encoding/json refuses a number wider than the Go field (UnmarshalTypeError): uint64
# flavor sizes and num_instances, int (64-bit) swap and id.
OVERFLOWS = [
    ("flavor", "memory_mb", 2**64),
    ("flavor", "vcpus", 2**64),
    ("flavor", "root_gb", 2**64),
    ("flavor", "ephemeral_gb", 2**64),
    ("flavor", "swap", 2**63),
    ("flavor", "swap", -(2**63) - 1),
    ("flavor", "id", 2**63),
    ("spec", "num_instances", 2**64),
]


@pytest.mark.parametrize("fits", [False, True], ids=["beyond", "widest"])
@pytest.mark.parametrize(("where", "field", "value"), OVERFLOWS)
def test_numbers_wider_than_the_go_field_are_dead_lettered(
    where: str, field: str, value: int, fits: bool
) -> None:
    body = nova.request("vm-1", project_id=P, flavor_name="f-small")
    spec = body["spec"]["nova_object.data"]
    widest = value - 1 if value > 0 else value + 1
    (spec["flavor"]["nova_object.data"] if where == "flavor" else spec)[field] = (
        widest if fits else value
    )
    got = _classify_outcome({"decision": nova.decision_dict(None), "request": body})[0]
    assert got == ("no_host_found" if fits else "dead-letter")


# --- written quantities ---------------------------------------------------------------

# Each row checked against k8s.io/apimachinery v0.36.3:
# resource.NewQuantity(n, resource.DecimalSI).String() / (n, resource.BinarySI).
DECIMAL_SI = [
    (0, "0"),
    (1, "1"),
    (2, "2"),
    (10, "10"),
    (64, "64"),
    (128, "128"),
    (999, "999"),
    (1000, "1k"),
    (1500, "1500"),
    (12000, "12k"),
    (100000, "100k"),
    (1200000, "1200k"),
    (2000000, "2M"),
    (10**18, "1E"),
    (2**63 - 1, "9223372036854775807"),
    (-1000, "-1k"),
    (-1500, "-1500"),
]
BINARY_SI = [
    (0, "0"),
    (1000, "1k"),  # below 1024 Go switches to DecimalSI
    (1023, "1023"),
    (1024, "1Ki"),
    (1536, "1536"),
    (4 * 2**30, "4Gi"),
    (1536 * 2**20, "1536Mi"),
    (100000 * 2**20, "100000Mi"),
    (-2048, "-2Ki"),
]


@pytest.mark.parametrize(("n", "text"), DECIMAL_SI)
def test_decimal_si_text_is_gos(n: int, text: str) -> None:
    assert format_decimal_si(n) == text
    assert Quantity.parse(text) == Quantity.from_int(n)


@pytest.mark.parametrize(("n", "text"), BINARY_SI)
def test_binary_si_text_is_gos(n: int, text: str) -> None:
    assert format_binary_si(n) == text


@pytest.mark.parametrize(("vcpus", "cpu"), [(2, "2"), (1500, "1500"), (100000, "100k")])
def test_the_allocation_is_written_in_canonical_form(vcpus: int, cpu: str) -> None:
    knowledge = from_k8s(
        fx.knowledge([fx.flavor_group("ga", [fx.flavor("f-big", 4096, vcpus)])]), Knowledge
    )
    state = _State(knowledge)
    request = nova.parse_request(nova.request("vm-1", project_id=P, flavor_name="f-big"))
    outcome = asyncio.run(Recorder(state).record(nova.decision("h0"), request))
    assert outcome.cr_slot == "slot_used"
    [(_, _, allocation)] = state.writes
    assert allocation["resources"] == {"memory": "4Gi", "cpu": cpu}


def test_a_null_allocation_means_the_vm_is_already_recorded() -> None:
    # Go keeps the map key with a zero allocation: the idempotency check finds the VM.
    slot = fx.reservation("slot-ga-h0", host="h0", project=P, group="ga", memory="32Gi")
    slot["spec"]["committedResourceReservation"]["allocations"] = {"vm-1": None}
    decoded = from_k8s(json.dumps(slot).encode(), Reservation)
    others = [r for r in _RESERVATIONS if r.name != "slot-ga-h0"]

    class _WithNullAllocation(_State):
        async def snapshot(self, hosts: Collection[str], project_id: str) -> Snapshot:
            return Snapshot(
                evaluator=SlotEvaluator.from_objects(_HYPERVISORS, [decoded, *others]),
                committed_resources=_COMMITMENTS,
                knowledge=self.knowledge,
            )

    state = _WithNullAllocation(KNOWLEDGE)
    request = nova.parse_request(nova.request("vm-1", project_id=P, flavor_name="f-small"))
    outcome = asyncio.run(Recorder(state).record(nova.decision("h0"), request))
    assert (outcome.cr_slot, outcome.allocation, outcome.reservation) == (
        "slot_used",
        "already_present",
        "slot-ga-h0",
    )
    assert state.writes == []
