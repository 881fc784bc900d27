"""Intent derivation from the ``_nova_check_type`` scheduler hint."""

from __future__ import annotations

from typing import Any

import pytest

from service.crs import derive_intent, intent_from_hints
from service.model import ExternalSchedulerRequest, from_k8s
from tests.upstream import nova_decision, upstream_nova_decision

_MISSING: Any = object()


def request(hints: Any = _MISSING) -> ExternalSchedulerRequest:
    data: dict[str, Any] = {"project_id": "p"}
    if hints is not _MISSING:
        data["scheduler_hints"] = hints
    return from_k8s({"spec": {"nova_object.data": data}}, ExternalSchedulerRequest)


CASES = [
    ({"_nova_check_type": "rebuild"}, "rebuild"),
    ({"_nova_check_type": "resize"}, "resize"),
    ({"_nova_check_type": "live_migrate"}, "live_migration"),
    ({"_nova_check_type": "evacuate"}, "evacuate"),
    ({"_nova_check_type": "reserve_for_failover"}, "reserve_for_failover"),
    ({"_nova_check_type": "reuse_failover_reservation"}, "reuse_failover_reservation"),
    ({"_nova_check_type": "reserve_for_committed_resource"}, "reserve_for_committed_resource"),
    ({"_nova_check_type": "capacity_probe"}, "capacity_probe"),
    ({"_nova_check_type": "something_else"}, "create"),
    ({"_nova_check_type": ""}, "create"),
    ({"_nova_check_type": "live_migration"}, "create"),  # the *intent* name is not a hint value
    ({"_nova_check_type": ["rebuild"]}, "rebuild"),
    ({"_nova_check_type": ["live_migrate"]}, "live_migration"),
    ({"_nova_check_type": ["evacuate"]}, "evacuate"),
    ({"_nova_check_type": ["unknown_type"]}, "create"),
    ({"_nova_check_type": ["resize", "rebuild"]}, "resize"),  # first element, as in Go
    ({"_nova_check_type": []}, "Unknown"),
    ({"_nova_check_type": [123]}, "Unknown"),
    ({"_nova_check_type": 123}, "Unknown"),
    ({"_nova_check_type": None}, "Unknown"),
    ({"_nova_check_type": {"a": "b"}}, "Unknown"),
    ({"domain_name": ["example-domain"]}, "Unknown"),
    ({}, "Unknown"),
    (None, "Unknown"),
    (_MISSING, "Unknown"),
]
IDS = [
    "string-rebuild",
    "string-resize",
    "string-live-migrate",
    "string-evacuate",
    "reserve-for-failover",
    "reuse-failover-reservation",
    "reserve-for-committed-resource",
    "capacity-probe",
    "other-string-is-create",
    "empty-string-is-create",
    "intent-name-is-create",
    "list-rebuild",
    "list-live-migrate",
    "list-evacuate",
    "list-other-is-create",
    "list-takes-first",
    "empty-list",
    "list-non-string",
    "int",
    "null",
    "dict",
    "key-missing",
    "hints-empty",
    "hints-null",
    "hints-absent",
]


@pytest.mark.parametrize(("hints", "expected"), CASES, ids=IDS)
def test_derive_intent(hints: Any, expected: str) -> None:
    assert derive_intent(request(hints)) == expected
    if hints is not _MISSING:
        assert intent_from_hints(hints) == expected


def test_example_without_check_type_is_unknown() -> None:
    req = from_k8s(nova_decision()["spec"]["novaRaw"], ExternalSchedulerRequest)
    assert req.spec.data.scheduler_hints == {"domain_name": ["test-domain"]}
    assert derive_intent(req) == "Unknown"


def test_upstream_example_has_no_check_type() -> None:
    req = from_k8s(upstream_nova_decision()["spec"]["novaRaw"], ExternalSchedulerRequest)
    assert derive_intent(req) == "Unknown"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        pytest.param("live_migration", "live_migration", id="known-given-wins"),
        pytest.param("create", "create", id="create-given"),
        pytest.param(None, "resize", id="absent-derived"),
        pytest.param("", "resize", id="empty-derived"),
        pytest.param("totally-new-op-4711", "resize", id="unknown-derived-not-a-label"),
    ],
)
def test_resolve_intent_trusts_only_known_values(given: str | None, expected: str) -> None:
    from service.crs.intent import resolve_intent

    request = from_k8s(
        {"spec": {"nova_object.data": {"scheduler_hints": {"_nova_check_type": "resize"}}}},
        ExternalSchedulerRequest,
    )
    assert resolve_intent(given, request) == expected
