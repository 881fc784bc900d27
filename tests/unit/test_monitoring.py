"""The alerting rules, the PrometheusRule, the chart's alert values, the kustomize base,
the runbooks and the dashboard agree.

``promtool check rules`` and ``promtool test rules`` run on the shipped files; every
alert must have a unit test that fires it and one where it stays quiet, and a runbook
section its ``runbook_url`` points at. The dashboard's queries only use metrics the
service registers or recording rules of rules.yaml.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.prometheus import MONITORING, REPO, promtool

RULES = MONITORING / "rules.yaml"
CHART_VALUES = REPO / "charts" / "crs-consumer" / "values.yaml"


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _alerts() -> list[dict[str, Any]]:
    return [r for r in _rules() if "alert" in r]


@pytest.mark.promtool
def test_promtool_checks_the_rules_file() -> None:
    proc = promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in proc.stdout


@pytest.mark.promtool
def test_promtool_checks_the_prometheusrule_groups(tmp_path: Path) -> None:
    doc = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    assert doc["kind"] == "PrometheusRule"
    extracted = tmp_path / "groups.yaml"
    extracted.write_text(yaml.safe_dump({"groups": doc["spec"]["groups"]}))
    proc = promtool("check", "rules", str(extracted))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert doc["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_prometheusrule_is_rendered_from_the_rules_file() -> None:
    proc = subprocess.run(
        [sys.executable, str(MONITORING / "render.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.promtool
def test_promtool_unit_tests_pass() -> None:
    proc = promtool("test", "rules", "tests.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    tests = yaml.safe_load((MONITORING / "tests.yaml").read_text())["tests"]
    fired: set[str] = set()
    quiet: set[str] = set()
    for test in tests:
        for case in test.get("alert_rule_test", []):
            (fired if case["exp_alerts"] else quiet).add(case["alertname"])
    names = {a["alert"] for a in _alerts()}
    assert names - fired == set(), "alerts without a test that fires them"
    assert names - quiet == set(), "alerts without a test where they stay quiet"
    required = {
        "CrsConsumerLagGrowing",
        "CrsNoEventsProcessed",
        "CrsDeadLetters",
        "CrsRetriesExhausted",
        "CrsNotReady",
        "CrsWatchStale",
        "CrsCommitFailures",
        "CrsProducerFenced",
        "CrsAllocationFailures",
        "CrsNoPartitionsOwned",
    }
    assert required <= names


def test_no_partitions_owned_uses_the_services_own_series() -> None:
    families = _registered_families()
    (alert,) = [a for a in _alerts() if a["alert"] == "CrsNoPartitionsOwned"]
    for name in re.findall(r"\b(crs_\w+)", alert["expr"]):
        assert name in families, name
    assert "crs_assigned_partitions" in alert["expr"]
    assert "crs_ready" in alert["expr"]


def test_every_alert_has_its_one_entry_in_the_charts_values() -> None:
    """The chart's alerts.rules: one entry per alert (its Cortex `context`, its `for:`,
    its threshold), with rules.yaml's values as defaults, so the chart's default render
    is what promtool tests here."""
    values = yaml.safe_load(CHART_VALUES.read_text())["alerts"]
    entries = values["rules"]
    alerts = {a["alert"]: a for a in _alerts()}
    assert set(entries) == set(alerts), "alerts.rules must have exactly one entry per alert"
    for name, alert in alerts.items():
        entry = entries[name]
        assert set(entry) <= {"for", "threshold", "labels", "enabled"}, name
        assert entry["labels"].get("context"), f"{name}: no context label"
        assert entry["for"] == alert.get("for", "0s"), name
    assert set(values["ruleLabels"]) == {"service", "support_group", "dashboard"}
    dash = json.loads((MONITORING / "dashboard.json").read_text())
    assert values["ruleLabels"]["dashboard"].split("/")[0] == dash["uid"]


def test_the_kustomize_base_ships_the_rules() -> None:
    """The dashboard's recording-rule panels need the rules where the base is deployed."""
    from tests.unit.test_packaging import NAMESPACE, kustomize_build

    (rule,) = [d for d in kustomize_build(REPO / "deploy") if d["kind"] == "PrometheusRule"]
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    records = {r["record"] for g in rule["spec"]["groups"] for r in g["rules"] if "record" in r}
    assert {"crs:events:rate5m", "crs:placement_slot_used:ratio5m"} <= records


def _anchors(markdown: str) -> set[str]:
    out = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_every_alert_links_a_runbook_section_with_the_five_parts() -> None:
    runbooks = (REPO / "docs" / "runbooks.md").read_text()
    anchors = _anchors(runbooks)
    sections = dict(re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", runbooks, flags=re.M | re.S))
    for alert in _alerts():
        ann = alert["annotations"]
        assert set(ann) >= {"summary", "description", "runbook_url"}, alert["alert"]
        path, _, anchor = ann["runbook_url"].partition("#")
        assert path == "docs/runbooks.md"
        assert anchor == alert["alert"].lower(), alert["alert"]
        assert anchor in anchors, alert["alert"]
        body = sections[alert["alert"]]
        for part in ("Symptom", "Likely causes", "What to check", "How to fix", "Redrive"):
            assert f"**{part}**" in body, (alert["alert"], part)
        assert alert["labels"]["severity"] in {"warning", "critical"}


def _registered_families() -> set[str]:
    from prometheus_client import generate_latest

    from service.app.config import Config
    from service.app.runtime import Runtime

    text = generate_latest(Runtime(Config.load(env={})).metrics.registry).decode()
    return set(re.findall(r"^# TYPE (\S+) ", text, flags=re.M))


def _dashboard_exprs() -> list[str]:
    dash = json.loads((MONITORING / "dashboard.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_dashboard_queries_use_existing_metrics_and_recording_rules() -> None:
    families = _registered_families()
    records = {r["record"] for r in _rules() if "record" in r}
    names: set[str] = set()
    for expr in _dashboard_exprs():
        # drop label matchers and strings, then take identifiers followed by { or [
        bare = re.sub(r'"[^"]*"', "", expr)
        names |= set(re.findall(r"([a-zA-Z_:][\w:]*)\s*[{\[]", bare))
    assert names
    for name in names:
        base = re.sub(r"_(total|bucket|count|sum|info)$", "", name)
        assert name in records or base in families or name in families, name


def test_dashboard_covers_the_required_views() -> None:
    dash = json.loads((MONITORING / "dashboard.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    joined = "\n".join(_dashboard_exprs())
    for needle in (
        "crs:events:rate5m",  # events by kind x cr_slot
        "ratio5m",  # CR coverage
        "crs_consumer_lag",
        "crs:dead_letters:rate5m",
        "crs:processing_seconds:p99_5m",
        "crs_patch_conflicts_total",
        "crs:k8s_requests:rate5m",
        "crs_ready",
    ):
        assert needle in joined, needle
