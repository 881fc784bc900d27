"""Render prometheusrule.yaml (Prometheus Operator) from the plain rules file rules.yaml,
and the Helm chart's charts/crs-consumer/alerts/crs-consumer.alerts.yaml (a copy of it).

    python deploy/monitoring/render.py                       # rewrite prometheusrule.yaml
    python deploy/monitoring/render.py --runbook-base URL    # absolute runbook links
    python deploy/monitoring/render.py --check               # exit 1 if it is out of date

rules.yaml is the source: promtool checks and unit-tests it; the PrometheusRule carries
the same groups, so what is tested is what is deployed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
CHART_RULES = HERE.parents[1] / "charts" / "crs-consumer" / "alerts" / "crs-consumer.alerts.yaml"
CHART_HEADER = (
    "# Copied from deploy/monitoring/rules.yaml by deploy/monitoring/render.py; edit that.\n"
)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runbook-base", default="", help="prefix for runbook_url")
    parser.add_argument("--check", action="store_true", help="only compare, do not write")
    args = parser.parse_args()
    source = (HERE / "rules.yaml").read_text()
    outputs = {
        HERE / "prometheusrule.yaml": render(yaml.safe_load(source), args.runbook_base),
        CHART_RULES: CHART_HEADER + source,
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
