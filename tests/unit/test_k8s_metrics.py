"""The Kubernetes request metrics: refusal series that exist before the first refusal."""

from __future__ import annotations

import yaml
from prometheus_client import CollectorRegistry

from service.k8s import K8sMetrics
from service.k8s.client import CALLS
from tests.conftest import REPO


def test_the_declared_calls_are_what_the_clusterrole_grants() -> None:
    # The refusal series are created for CALLS; a call the Role grants but CALLS lacks
    # would get its series only with its first (possibly refused) answer.
    role = yaml.safe_load((REPO / "deploy" / "clusterrole.yaml").read_text())
    granted = {
        (verb, resource)
        for rule in role["rules"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert set(CALLS) == granted
    assert len(CALLS) == len(set(CALLS))


def test_a_first_call_refused_is_an_increase_from_zero() -> None:
    registry = CollectorRegistry()
    metrics = K8sMetrics(registry)
    metrics.expect([("patch", "reservations")])
    labels = {"verb": "patch", "kind": "reservations", "code": "403"}
    assert registry.get_sample_value("crs_k8s_requests_total", labels) == 0.0
    metrics.observe("patch", "reservations", 403, 0.01)
    assert registry.get_sample_value("crs_k8s_requests_total", labels) == 1.0


def test_a_call_not_declared_gets_its_refusal_series_with_its_first_answer() -> None:
    registry = CollectorRegistry()
    metrics = K8sMetrics(registry)
    metrics.observe("delete", "reservations", 200, 0.01)
    for code in ("401", "403"):
        labels = {"verb": "delete", "kind": "reservations", "code": code}
        assert registry.get_sample_value("crs_k8s_requests_total", labels) == 0.0
    assert (
        registry.get_sample_value(
            "crs_k8s_requests_total", {"verb": "get", "kind": "reservations", "code": "403"}
        )
        is None
    )
