"""The invariant monitor's tick (gauge and bounded log line) and the audit's one-shot
index; the audit against the API server is in tests/integration/test_invariants.py."""

from __future__ import annotations

from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Gauge

from service.app.audit import LOG_NAMES, report
from service.crs.invariants import KINDS, InvariantIndex, Kind, audit, parse_rfc3339
from service.model import Reservation, from_k8s
from tests import factories as f


def res(name: str, allocations: dict[str, Any], host: str = "hv-1") -> Reservation:
    return from_k8s(f.reservation(name, host=host, allocations=allocations), Reservation)


def gauge() -> Gauge:
    return Gauge("v", "v", ["kind"], registry=CollectorRegistry())


def values(g: Gauge) -> dict[str, float]:
    return {s.labels["kind"]: s.value for s in next(iter(g.collect())).samples}


def test_the_tick_sets_every_kind_and_logs_a_bounded_line_only_when_the_set_changes() -> None:
    index = InvariantIndex(grace_s=0)
    g = gauge()
    with structlog.testing.capture_logs() as logs:
        report(index, g)
        assert values(g) == dict.fromkeys(map(str, KINDS), 0)
        assert logs == []
        for i in range(LOG_NAMES + 5):
            index.put(res(f"r-{i:02d}", {f"vm-{i}": f.allocation("1Gi")}, host=""))
        report(index, g)
        report(index, g)  # nothing changed: no second line
    assert values(g)["allocation_without_host"] == LOG_NAMES + 5
    (line,) = logs
    assert line["event"] == "allocation_invariant_violations"
    assert line["log_level"] == "warning"
    assert (line["kind"], line["count"], line["more"]) == ("allocation_without_host", 15, 5)
    assert len(line["objects"]) == LOG_NAMES
    assert line["objects"][0].startswith("r-00: 1 allocations, no targetHost")
    with structlog.testing.capture_logs() as logs:
        for i in range(LOG_NAMES + 5):
            index.remove(f"r-{i:02d}")
        report(index, g)
    assert [(x["kind"], x["count"], x["log_level"]) for x in logs] == [
        ("allocation_without_host", 0, "info")
    ]


def test_the_tick_alone_reports_a_duplicate_once_the_grace_has_passed() -> None:
    now = [0.0]
    index = InvariantIndex(grace_s=10, clock=lambda: now[0])
    g = gauge()
    index.put(res("a", {"vm-1": f.allocation("1Gi")}))
    index.put(res("b", {"vm-1": f.allocation("1Gi")}))
    report(index, g)
    assert values(g)["vm_in_multiple_slots"] == 0
    now[0] = 10.0
    with structlog.testing.capture_logs() as logs:
        report(index, g)
    assert values(g)["vm_in_multiple_slots"] == 1
    assert logs[0]["objects"] == ["vm-1: a, b"]


def test_audit_counts_the_grace_from_the_timestamps_and_includes_undecodable_ones() -> None:
    now = parse_rfc3339("2026-01-01T01:00:00Z")
    assert now is not None
    old, fresh = "2026-01-01T00:00:00Z", "2026-01-01T00:59:00Z"
    index = audit(
        [
            res("a", {"vm-old": f.allocation("1Gi", ts=old), "vm-new": f.allocation("1Gi")}),
            res("b", {"vm-old": f.allocation("1Gi", ts=old)}),
            res("c", {"vm-new": f.allocation("1Gi", ts=fresh)}),
        ],
        [("d", "$.spec.committedResourceReservation.allocations[...].resources[...]")],
        grace_s=900,
        now=now,
    )
    assert [v.object for v in index.violations(Kind.VM_IN_MULTIPLE_SLOTS)] == ["vm-old"]
    assert [v.object for v in index.violations(Kind.ALLOCATION_MALFORMED)] == ["d"]


def test_every_kind_is_at_zero_from_the_start_in_watch_mode_and_absent_in_list_mode() -> None:
    from prometheus_client import generate_latest

    from service.app.config import Config
    from service.app.runtime import Runtime

    def series(mode: str) -> list[str]:
        registry = Runtime(Config.load(env={"CRS_K8S_READ_MODE": mode})).metrics.registry
        text = generate_latest(registry).decode()
        return [
            line
            for line in text.splitlines()
            if line.startswith("crs_allocation_invariant_violations{")
        ]

    assert sorted(series("watch")) == sorted(
        f'crs_allocation_invariant_violations{{kind="{k}"}} 0.0' for k in KINDS
    )
    assert series("list") == []  # no monitor without the watch cache: no claim of 0
