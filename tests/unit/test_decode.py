"""from_k8s: the single decoding entry point for API-server and Nova JSON."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from service.model import (
    CommittedResource,
    Decision,
    DecisionResult,
    DecodeError,
    ExternalSchedulerRequest,
    Hypervisor,
    Knowledge,
    Reservation,
    encode_k8s,
    from_k8s,
    to_k8s,
)
from service.quantity import Quantity
from tests.upstream import nova_decision, upstream_nova_decision


@pytest.fixture(scope="module")
def example() -> dict[str, Any]:
    return nova_decision()


def test_nova_request_decodes(example: dict[str, Any]) -> None:
    req = from_k8s(example["spec"]["novaRaw"], ExternalSchedulerRequest)
    assert req.project_id == "7d4c2b1a0f9e48d6b5a3c2e1f0d9c8b7"
    assert req.context_project_id == ""  # the example strips the context: {}
    assert req.instance_uuid == "5c3e8a1d-7b2f-4e90-a6d4-0f9b1c2e3d47"
    assert req.flavor_name == "hana_c4_m7936"
    assert req.input_hosts == ["compute-az1b-017", "compute-az1b-042", "compute-az1b-108"]
    assert req.hosts[0].hypervisor_hostname == "node017"
    assert req.weights["compute-az1b-108"] == -60.0  # an integer in the JSON
    assert req.pipeline == "nova-external-scheduler"
    assert not hasattr(req, "vmware")  # not read, nor by the reference
    assert req.options.skip_committed_resource_tracking is False
    flavor = req.spec.data.flavor
    assert flavor is not None
    assert (flavor.data.memory_mb, flavor.data.vcpus) == (7936, 4)
    assert flavor.data.extra_specs is not None
    assert flavor.data.extra_specs["vmware:hw_version"] == "vmx-19"
    assert req.spec.data.scheduler_hints == {"domain_name": ["test-domain"]}
    assert req.spec.data.availability_zone == "test-az-1b"


def test_nova_request_decodes_from_bytes_identically(example: dict[str, Any]) -> None:
    raw = json.dumps(example["spec"]["novaRaw"]).encode()
    assert from_k8s(raw, ExternalSchedulerRequest) == from_k8s(
        example["spec"]["novaRaw"], ExternalSchedulerRequest
    )


def test_decision_result_decodes(example: dict[str, Any]) -> None:
    result = from_k8s(example["status"]["result"], DecisionResult)
    assert result.target_host == "compute-az1b-017"
    assert result.ordered_hosts == ["compute-az1b-017", "compute-az1b-042", "compute-az1b-108"]


# --- against upstream Cortex's example (CRS_UPSTREAM_EXAMPLES) ---------------------------


def test_upstream_nova_example_decodes() -> None:
    doc = upstream_nova_decision()
    raw, result = doc["spec"]["novaRaw"], doc["status"]["result"]
    data = raw["spec"]["nova_object.data"]
    req = from_k8s(raw, ExternalSchedulerRequest)
    assert req.project_id == data["project_id"]  # the sample strips the context
    assert req.instance_uuid == data["instance_uuid"]
    assert req.flavor_name == data["flavor"]["nova_object.data"]["name"]
    assert req.input_hosts == [h["host"] for h in raw["hosts"]]
    assert req.weights == {host: float(w) for host, w in raw["weights"].items()}
    assert from_k8s(json.dumps(raw).encode(), ExternalSchedulerRequest) == req
    decision = from_k8s(result, DecisionResult)
    assert decision.target_host == result["targetHost"]
    assert decision.ordered_hosts == result["orderedHosts"]


def _paths(value: Any, prefix: str = "") -> set[str]:
    """Every key path of a document; a list's items share one path (``[]``)."""
    if isinstance(value, dict):
        out = set()
        for key, item in value.items():
            path = f"{prefix}.{key}"
            out |= {path} | _paths(item, path)
        return out
    if isinstance(value, list):
        return set().union(*(_paths(item, prefix + "[]") for item in value))
    return set()


def test_project_example_has_every_field_of_the_upstream_one() -> None:
    """The project's fixture is modelled on upstream's: nothing upstream sends is missing."""
    # Upstream's step names and the hosts' names are keys of maps, not fields.
    maps = ("Weights.", "weights.", "activations.")

    def fields(doc: dict[str, Any]) -> set[str]:
        return {p for p in _paths(doc) if not any(m in p for m in maps)}

    assert fields(upstream_nova_decision()) - fields(nova_decision()) == set()


def test_decision_wire_names_are_camel_case() -> None:
    decision = Decision(
        name="d", intent="create", result=DecisionResult(target_host="h", ordered_hosts=["h"])
    )
    wire = to_k8s(decision)
    assert wire == {
        "result": {"targetHost": "h", "orderedHosts": ["h"]},
        "name": "d",
        "intent": "create",
    }
    assert from_k8s(encode_k8s(decision), Decision) == decision
    no_host = from_k8s({"result": {"targetHost": None}}, Decision)
    assert no_host.result.target_host is None
    assert no_host.result.ordered_hosts == []


def test_options_skip_flag() -> None:
    req = from_k8s(
        {
            "spec": {"nova_object.data": {"project_id": "p"}},
            "options": {"skip_committed_resource_tracking": True},
        },
        ExternalSchedulerRequest,
    )
    assert req.options.skip_committed_resource_tracking is True
    assert req.flavor_name == ""
    assert req.input_hosts == []


def test_project_id_prefers_context_like_the_reference() -> None:
    req = from_k8s(
        {"spec": {"nova_object.data": {"project_id": "owner"}}, "context": {"project_id": "ctx"}},
        ExternalSchedulerRequest,
    )
    assert req.project_id == "ctx"


def test_project_id_falls_back_to_spec_when_context_is_stripped() -> None:
    req = from_k8s(
        {"spec": {"nova_object.data": {"project_id": "owner"}}, "context": {}},
        ExternalSchedulerRequest,
    )
    assert req.project_id == "owner"


def test_project_id_from_context_alone() -> None:
    req = from_k8s(
        {"spec": {"nova_object.data": {}}, "context": {"project_id": "ctx"}},
        ExternalSchedulerRequest,
    )
    assert req.project_id == "ctx"
    assert req.context_project_id == "ctx"


QUANTITY_FORMS = [
    pytest.param(8589934592, id="int"),
    pytest.param("8Gi", id="binary-string"),
    pytest.param("8589934592", id="decimal-string"),
    pytest.param(" 8Gi ", id="padded-string"),
    pytest.param(8589934592.0, id="float"),
]


@pytest.mark.parametrize("memory", QUANTITY_FORMS)
def test_quantities_accept_int_and_string(memory: Any) -> None:
    hv = from_k8s(
        {"metadata": {"name": "h"}, "status": {"capacity": {"memory": memory}}}, Hypervisor
    )
    assert hv.status.capacity is not None
    assert hv.status.capacity["memory"] == Quantity.parse("8Gi")
    raw = json.dumps({"status": {"capacity": {"memory": memory}}}).encode()
    assert from_k8s(raw, Hypervisor).status.capacity == {"memory": Quantity.parse("8Gi")}


EFFECTIVE = [
    pytest.param({}, None, id="absent"),
    pytest.param({"effectiveCapacity": None}, None, id="null"),
    pytest.param({"effectiveCapacity": {}}, {}, id="empty-map"),
    pytest.param(
        {"effectiveCapacity": {"memory": "1Gi"}}, {"memory": Quantity.parse("1Gi")}, id="set"
    ),
]


@pytest.mark.parametrize(("status", "expected"), EFFECTIVE)
def test_effective_capacity_absent_null_and_empty_are_distinguished(
    status: dict[str, Any], expected: dict[str, Quantity] | None
) -> None:
    assert from_k8s({"status": status}, Hypervisor).status.effective_capacity == expected


BAD_FIELDS = [
    pytest.param(
        Reservation,
        {"spec": {"resources": {"memory": "8Gx"}}},
        "$.spec.resources[...]",
        id="quantity",
    ),
    pytest.param(Reservation, {"spec": {"targetHost": 5}}, "$.spec.targetHost", id="wrong-type"),
    pytest.param(
        Reservation,
        {"spec": {"committedResourceReservation": {"projectID": ["x"]}}},
        "$.spec.committedResourceReservation.projectID",
        id="nested",
    ),
    pytest.param(
        Reservation, {"metadata": {"labels": {"a": 1}}}, "$.metadata.labels[...]", id="label"
    ),
    pytest.param(CommittedResource, {"spec": {"amount": True}}, "$.spec.amount", id="bool-amount"),
    pytest.param(
        ExternalSchedulerRequest,
        {"spec": {"nova_object.data": {"flavor": {"nova_object.data": {"memory_mb": "x"}}}}},
        "$.spec.nova_object.data.flavor.nova_object.data.memory_mb",
        id="nova-dotted",
    ),
    # Go would decode a request without spec (every Go field is optional); the decision's
    # result is this service's own contract and stays required.
    pytest.param(Decision, {"name": "d"}, "$", id="missing-required"),
]


@pytest.mark.parametrize(("type_", "obj", "path"), BAD_FIELDS)
def test_bad_field_raises_decode_error_with_path(
    type_: type, obj: dict[str, Any], path: str
) -> None:
    with pytest.raises(DecodeError) as info:
        from_k8s(obj, type_)
    assert info.value.path == path
    with pytest.raises(DecodeError) as info_bytes:
        from_k8s(json.dumps(obj).encode(), type_)
    assert info_bytes.value.path == path


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param(b"{", id="truncated"),
        pytest.param(b"{'a': 1}", id="garbage"),
        pytest.param([1], id="list"),
    ],
)
def test_malformed_input_raises_only_decode_error(obj: Any) -> None:
    with pytest.raises(DecodeError) as info:
        from_k8s(obj, Reservation)
    assert info.value.path is None
    assert isinstance(info.value, ValueError)


def test_top_level_type_mismatch_has_root_path() -> None:
    with pytest.raises(DecodeError) as info:
        from_k8s(b"[1]", Reservation)
    assert info.value.path == "$"


def test_unknown_fields_are_ignored() -> None:
    res = from_k8s(
        {"apiVersion": "cortex.cloud/v1alpha1", "kind": "Reservation", "spec": {"whatever": 1}},
        Reservation,
    )
    assert res.spec.target_host == ""


def test_reservation_round_trip_writes_canonical_quantities() -> None:
    obj = {
        "metadata": {
            "name": "slot-1",
            "resourceVersion": "42",
            "labels": {"reservations.cortex.cloud/type": "committed-resource"},
        },
        "spec": {
            "type": "CommittedResourceReservation",
            "targetHost": "h1",
            "resources": {"memory": "8192Mi", "cpu": 4},
            "committedResourceReservation": {
                "projectID": "p",
                "resourceGroup": "g",
                "commitmentUUID": "c",
                "domainID": "d",
                "allocations": {
                    "vm-1": {
                        "creationTimestamp": "2026-01-01T00:00:00Z",
                        "resources": {"memory": 4294967296, "cpu": "2"},
                    }
                },
            },
        },
        "status": {"conditions": [{"type": "Ready", "status": "True"}], "host": "h1"},
    }
    res = from_k8s(obj, Reservation)
    assert res.name == "slot-1"
    assert res.metadata.resource_version == "42"
    crr = res.spec.committed_resource_reservation
    assert crr is not None
    assert (crr.project_id, crr.resource_group, crr.commitment_uuid, crr.domain_id) == (
        "p",
        "g",
        "c",
        "d",
    )
    wire = to_k8s(res)
    assert wire["spec"]["resources"] == {"memory": "8Gi", "cpu": "4"}
    alloc = wire["spec"]["committedResourceReservation"]["allocations"]["vm-1"]
    # A JSON integer is a DecimalSI quantity in Go, so it renders without a binary suffix.
    assert alloc == {
        "creationTimestamp": "2026-01-01T00:00:00Z",
        "resources": {"memory": "4294967296", "cpu": "2"},
    }
    assert from_k8s(encode_k8s(res), Reservation) == res


def test_knowledge_raw_is_kept_as_json() -> None:
    kn = from_k8s({"status": {"raw": {"features": [{"name": "g"}]}, "rawLength": 1}}, Knowledge)
    assert kn.status.raw == {"features": [{"name": "g"}]}


def test_models_are_frozen() -> None:
    res = from_k8s({"spec": {"targetHost": "h"}}, Reservation)
    with pytest.raises(AttributeError):
        res.spec.target_host = "x"  # type: ignore[misc]
    assert isinstance(res, msgspec.Struct)
