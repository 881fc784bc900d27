"""Render prometheusrule.yaml (Prometheus Operator) from the plain rules file rules.yaml,
and the Helm chart's charts/crs-consumer/alerts/crs-consumer.alerts.yaml.

    python deploy/monitoring/render.py                       # rewrite prometheusrule.yaml
    python deploy/monitoring/render.py --runbook-base URL    # absolute runbook links
    python deploy/monitoring/render.py --check               # exit 1 if it is out of date

rules.yaml is the source: promtool checks and unit-tests it; the PrometheusRule carries
the same groups, so what is tested is what is deployed. The chart's copy has the same
groups with each configurable threshold (an alert with `threshold` under the chart's
values alerts.rules) replaced by the placeholder ${threshold}, which the chart fills from
its values; the default must be the number rules.yaml compares against, once.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
CHART = HERE.parents[1] / "charts" / "crs-consumer"
CHART_RULES = CHART / "alerts" / "crs-consumer.alerts.yaml"
CHART_HEADER = (
    "# Generated from deploy/monitoring/rules.yaml by deploy/monitoring/render.py; edit that.\n"
    "# ${threshold}: the alert's alerts.rules.<name>.threshold of the chart's values.\n"
)
PLACEHOLDER = "${threshold}"
HEADER = (
    "# Generated from rules.yaml by deploy/monitoring/render.py; edit rules.yaml, not this.\n"
    "# Needs the Prometheus Operator's CRDs; an overlay adds the label its Prometheus selects.\n"
)


class _Dumper(yaml.SafeDumper):
    """Multi-line expressions as literal blocks, as they are written in rules.yaml."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(rules: dict[str, Any], runbook_base: str = "") -> str:
    groups = rules["groups"]
    if runbook_base:
        for group in groups:
            for rule in group["rules"]:
                ann = rule.get("annotations", {})
                if "runbook_url" in ann:
                    ann["runbook_url"] = runbook_base.rstrip("/") + "/" + ann["runbook_url"]
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "crs-consumer",
            "labels": {
                "app.kubernetes.io/name": "crs-consumer",
                "app.kubernetes.io/part-of": "cortex",
            },
        },
        "spec": {"groups": groups},
    }
    return HEADER + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=200)


def chart_thresholds() -> dict[str, float]:
    """alerts.rules.<alert>.threshold of the chart's default values."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    rules = values["alerts"]["rules"] or {}
    return {name: entry["threshold"] for name, entry in rules.items() if "threshold" in entry}


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def render_chart(rules: dict[str, Any], thresholds: dict[str, float]) -> str:
    """The chart's rule file: rules.yaml's groups, thresholds as placeholders."""
    doc = copy.deepcopy(rules)
    found = set()
    for group in doc["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert")
            if name not in thresholds:
                continue
            # The number right after a comparison, not part of a longer number.
            pattern = r"((?:[<>]=?|[=!]=)\s*)" + re.escape(_number(thresholds[name])) + r"(?![\w.])"
            expr, count = re.subn(pattern, lambda m: m.group(1) + PLACEHOLDER, rule["expr"])
            if count != 1:
                raise SystemExit(
                    f"{name}: the chart's default threshold {thresholds[name]} must be compared "
                    f"against exactly once in its rules.yaml expr (found {count})"
                )
            rule["expr"] = expr
            found.add(name)
    missing = set(thresholds) - found
    if missing:
        raise SystemExit(f"thresholds for alerts not in rules.yaml: {sorted(missing)}")
    return CHART_HEADER + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=200)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runbook-base", default="", help="prefix for runbook_url")
    parser.add_argument("--check", action="store_true", help="only compare, do not write")
    args = parser.parse_args()
    source = (HERE / "rules.yaml").read_text()
    outputs = {
        HERE / "prometheusrule.yaml": render(yaml.safe_load(source), args.runbook_base),
        CHART_RULES: render_chart(yaml.safe_load(source), chart_thresholds()),
    }
    if args.check:
        stale = [p.name for p, text in outputs.items() if p.read_text() != text]
        if stale:
            print(f"{', '.join(stale)} stale: run deploy/monitoring/render.py", file=sys.stderr)
            return 1
        return 0
    for target, text in outputs.items():
        target.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
