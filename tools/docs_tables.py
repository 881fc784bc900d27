"""Regenerate the documentation's tables from the code: ``python tools/docs_tables.py``.

The tables the code defines are written between ``<!-- BEGIN generated: NAME -->`` and
``<!-- END generated: NAME -->`` in the docs pages:

* ``settings`` (docs/operators/configuration.md): every setting of ``Config``
  (``SETTINGS``), in declaration order, with its variable, flag and default;
* ``metrics`` (docs/operators/monitoring.md): every series the service registers, with
  its type and labels;
* ``alerts`` (docs/operators/monitoring.md): every alert of deploy/monitoring/rules.yaml
  with its severity, summary and runbook section.

A row's meaning is prose a person wrote: for a setting or metric already in the table it
is kept (a setting's must still contain the help text of its declaration); a new one
starts from its help text or the metric's description. ``--check`` changes nothing and
exits 1 when a page is not what this would write (tests/unit/test_readme.py runs it).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
CONFIGURATION = DOCS / "operators" / "configuration.md"
MONITORING = DOCS / "operators" / "monitoring.md"
RULES = REPO / "deploy" / "monitoring" / "rules.yaml"


def _block(text: str, name: str) -> tuple[int, int]:
    """Where the generated block ``name`` starts and ends (its content, markers excluded)."""
    begin = f"<!-- BEGIN generated: {name} -->\n"
    end = f"<!-- END generated: {name} -->"
    start = text.find(begin)
    stop = text.find(end)
    if start < 0 or stop < start:
        raise SystemExit(f"no generated block '{name}' (markers '{begin.strip()}' ... '{end}')")
    return start + len(begin), stop


def _existing_rows(content: str) -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    for line in content.splitlines():
        m = re.match(r"^\| `([^`]+)` \|(.*)\|$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return rows


def settings_table(current: str) -> str:
    sys.path.insert(0, str(REPO))
    from service.app.config import SETTINGS

    old = _existing_rows(current)
    lines = ["| Variable | Flag | Default | Meaning |", "|---|---|---|---|"]
    for s in SETTINGS:
        default = "*(unset)*" if s.default is None else f"`{s.default}`"
        meaning = old.get(s.env, ["", "", ""])[-1]
        if s.help.replace("`", "") not in meaning.replace("`", ""):
            meaning = s.help.rstrip(".") + "."
        lines.append(f"| `{s.env}` | `{s.flag}` | {default} | {meaning} |")
    return "\n".join(lines) + "\n"


def service_metrics() -> dict[str, tuple[str, tuple[str, ...], str]]:
    """name -> (type, label names, description) of every series the service registers."""
    sys.path.insert(0, str(REPO))
    from service.app.config import Config
    from service.app.runtime import Runtime

    runtime = Runtime(Config.load(env={}))  # builds the registry; no I/O until start()
    out: dict[str, tuple[str, tuple[str, ...], str]] = {}
    for c in list(runtime.metrics.registry._collector_to_names):
        if not hasattr(c, "_name"):
            continue  # the standard process/platform/GC collectors, documented in prose
        suffix = {"counter": "_total", "info": "_info"}.get(c._type, "")
        labels = tuple(c._labelnames)
        if c._type == "info":  # an info's labels are its keys, set when it is filled
            labels = tuple(next(iter(c.collect())).samples[0].labels)
        out[c._name + suffix] = (c._type, labels, c._documentation)
    return out


def metrics_table(current: str) -> str:
    metrics = service_metrics()
    old = _existing_rows(current)
    # Rows keep the order a person gave them; new series follow in registry order.
    names = [n for n in old if n in metrics] + [n for n in metrics if n not in old]
    lines = ["| Metric | Type | Labels | Meaning |", "|---|---|---|---|"]
    for name in names:
        kind, labels, doc = metrics[name]
        meaning = old[name][-1] if name in old and old[name][-1] else doc.rstrip(".") + "."
        label_cell = ", ".join(f"`{label}`" for label in labels)
        lines.append(f"| `{name}` | {kind} | {label_cell} | {meaning} |".replace("|  |", "| |"))
    return "\n".join(lines) + "\n"


def alerts() -> list[dict[str, object]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def alerts_table(current: str) -> str:
    lines = ["| Alert | Severity | Fires when | Runbook |", "|---|---|---|---|"]
    for rule in alerts():
        ann = rule["annotations"]
        assert isinstance(ann, dict)
        labels = rule.get("labels", {})
        assert isinstance(labels, dict)
        path, _, anchor = str(ann["runbook_url"]).partition("#")
        link = f"[runbook](../{Path(path).relative_to('docs').as_posix()}#{anchor})"
        # Alertmanager fills {{ $labels.x }} in; the table names the label instead.
        summary = re.sub(r"\{\{ \$labels\.(\w+) \}\}", r"*\1*", str(ann["summary"]))
        summary = summary.replace("|", "\\|")
        lines.append(f"| `{rule['alert']}` | {labels.get('severity', '')} | {summary} | {link} |")
    return "\n".join(lines) + "\n"


GENERATED = {
    CONFIGURATION: {"settings": settings_table},
    MONITORING: {"metrics": metrics_table, "alerts": alerts_table},
}


def regenerate(page: Path) -> str:
    text = page.read_text()
    for name, make in GENERATED[page].items():
        start, stop = _block(text, name)
        # Blank lines around the table: the markers are HTML blocks of their own.
        text = text[:start] + "\n" + make(text[start:stop]) + "\n" + text[stop:]
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 on drift")
    args = parser.parse_args(argv)
    stale = []
    for page in GENERATED:
        text = regenerate(page)
        if text != page.read_text():
            stale.append(page.relative_to(REPO).as_posix())
            if not args.check:
                page.write_text(text)
    if stale:
        verb = "out of date (run: python tools/docs_tables.py)" if args.check else "rewritten"
        print(f"{', '.join(stale)}: {verb}", file=sys.stderr)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    raise SystemExit(main())
