"""The README and the docs stay true to the code: settings, metrics, alerts, codes, links.

The README is the front door; the facts live in docs/ (the MkDocs site). The
configuration table (docs/operators/configuration.md) must list every setting declared by
``Config`` (``SETTINGS``), in declaration order, with its flag, default and meaning; the
metrics table (docs/operators/monitoring.md) every series the service registers (with its
labels, in order), the alert table every alert of the rules; the dead-letter table
(docs/consumers/events.md) every code the service can write. ``tools/docs_tables.py``
(``make docs-tables``) writes those tables and must find nothing to change. Relative links
and their anchors must resolve, and the layering claim (the pure logic imports no I/O
library) must hold.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from service.app.config import SETTINGS, Config
from service.stream.codec import OUTPUT_REJECTED, POISON_CODES

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
PROCESSOR_CODES = ("retries_exhausted", "k8s_error", "internal_error")


def section(title: str) -> str:
    """The text of the README section ``## title`` (up to the next ``## ``)."""
    text = README.read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README has no section '## {title}'"
    return match.group(1)


def page(name: str) -> str:
    """A docs page's text up to its first ``## `` section (the page's own part)."""
    return re.split(r"^## ", (DOCS / name).read_text(), maxsplit=1, flags=re.M)[0]


def table_rows(text: str) -> dict[str, list[str]]:
    """Rows of the markdown tables in ``text`` whose first cell is a `code` name."""
    rows: dict[str, list[str]] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^\| `([^`]+)` \|(.*)\|$", line)
        is_header = i + 1 < len(lines) and lines[i + 1].startswith("|---")
        if m and not is_header:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return rows


def test_quickstart_is_exactly_two_commands() -> None:
    block = re.search(r"```sh\n(.*?)```", section("Quickstart"), re.S)
    assert block
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    assert [c for c in commands if c] == ["make demo", "make test"]


def test_make_demo_brings_the_dev_stack_up_first() -> None:
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^demo:.*?\n((?:\t.*\n|[^\n]*\\\n)+)", makefile, re.M)
    assert recipe, "no demo target"
    lines = recipe.group(1)
    assert lines.index("devstack/up") < lines.index("crs-consumer-demo demo")
    assert "/env" in lines


def test_configuration_table_lists_every_setting() -> None:
    rows = table_rows((DOCS / "operators" / "configuration.md").read_text())
    assert list(rows) == [s.env for s in SETTINGS], "docs table and Config's fields differ"
    for s in SETTINGS:
        flag, default, meaning = rows[s.env]
        assert flag == f"`{s.flag}`", s.env
        assert default == ("*(unset)*" if s.default is None else f"`{s.default}`"), s.env
        assert s.help.replace("`", "") in meaning.replace("`", ""), s.env


def test_configuration_defaults_in_the_table_are_accepted() -> None:
    # The documented defaults are what Config.load really produces from an empty env.
    config = Config.load(env={})
    for s in SETTINGS:
        value = getattr(config, s.field)
        assert (value is None) == (s.default is None), s.env


def _service_metrics() -> dict[str, tuple[str, ...]]:
    """Every series name the running service registers, with its label names."""
    from service.app.runtime import Runtime

    runtime = Runtime(Config.load(env={}))  # builds the registry; no I/O until start()
    registry = runtime.metrics.registry
    collectors = list(registry._collector_to_names)
    out: dict[str, tuple[str, ...]] = {}
    for c in collectors:
        if not hasattr(c, "_name"):
            continue  # the standard process/platform/GC collectors, documented in prose
        suffix = {"counter": "_total", "info": "_info"}.get(c._type, "")
        labels = tuple(c._labelnames)
        if c._type == "info":  # an info's labels are its keys, set when it is filled
            labels = tuple(next(iter(c.collect())).samples[0].labels)
        out[c._name + suffix] = labels
    return out


def test_standard_collectors_are_exposed_and_documented() -> None:
    from prometheus_client import generate_latest

    from service.app.runtime import Runtime

    text = generate_latest(Runtime(Config.load(env={})).metrics.registry).decode()
    doc = page("operators/monitoring.md")
    for family in ("process_resident_memory_bytes", "python_info", "python_gc_objects_collected"):
        assert family in text, family
        assert f"`{family.split('_')[0]}_" in doc, family


def test_metrics_table_lists_every_metric_with_its_labels() -> None:
    exposed = _service_metrics()
    assert "cortex_nova_placement_total" in exposed
    assert "crs_k8s_requests_total" in exposed
    rows = table_rows(page("operators/monitoring.md"))
    metric_rows = {k: v for k, v in rows.items() if not k.startswith("/")}
    assert set(metric_rows) == set(exposed), "docs metrics table and the registry differ"
    for name, labels in exposed.items():
        kind, label_cell, meaning = metric_rows[name]
        assert kind in {"counter", "gauge", "histogram", "info"}, name
        assert re.findall(r"`([^`]+)`", label_cell) == list(labels), name
        assert meaning, name


def test_dead_letter_codes_are_all_documented() -> None:
    processor = (REPO / "service" / "stream" / "processor.py").read_text()
    for code in PROCESSOR_CODES:
        assert f'"{code}"' in processor, f"{code} is no longer a processor code"
    rows = table_rows(page("consumers/events.md"))
    assert set(rows) == set(POISON_CODES) | set(PROCESSOR_CODES) | {OUTPUT_REJECTED}


MARKDOWN = [
    README,
    REPO / "BENCHMARKS.md",
    REPO / "bench" / "README.md",
    REPO / "schemas" / "README.md",
    *sorted(DOCS.rglob("*.md")),
]


def _without_code(markdown: str) -> str:
    return re.sub(r"^(```|~~~).*?^\1", "", markdown, flags=re.M | re.S)


def _anchors(markdown: str) -> set[str]:
    """The heading anchors of a page, as GitHub and MkDocs' toc both make them."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", _without_code(markdown), flags=re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return out


def test_the_readme_is_a_front_door() -> None:
    # What it is, the two commands, the operator path and links; the rest is in docs/.
    assert len(README.read_text().splitlines()) <= 250
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)", README.read_text()))
    pages = {p.relative_to(REPO).as_posix() for p in DOCS.rglob("*.md")}
    # The site's home and the page that includes BENCHMARKS.md have README counterparts.
    assert pages - linked == {"docs/index.md", "docs/maintainers/benchmarks.md"}


@pytest.mark.parametrize("doc", [p.relative_to(REPO).as_posix() for p in MARKDOWN])
def test_relative_links_and_their_anchors_resolve(doc: str) -> None:
    path = REPO / doc
    links = re.findall(r"\]\(([^)\s]+)\)", _without_code(path.read_text()))
    for link in links:
        if re.match(r"^[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        dest = path.parent / target if target else path
        assert dest.exists(), f"{doc}: broken link {link}"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest.read_text()), f"{doc}: no anchor in {link}"


def test_the_charts_pointer_to_the_access_page_resolves() -> None:
    chart = yaml.safe_load((REPO / "charts" / "crs-consumer" / "Chart.yaml").read_text())
    path, _, anchor = chart["annotations"]["crs.cortex.cloud/access-doc"].partition("#")
    assert path.startswith("docs/"), path
    assert anchor in _anchors((REPO / path).read_text())


def test_pointers_into_the_docs_from_charts_and_manifests_resolve() -> None:
    # Runbook links of the alert rules (deploy/monitoring, the chart's alerts/), the
    # chart's annotations and the comments that send an operator to a page.
    files = [
        f
        for top in ("charts", "deploy")
        for f in sorted((REPO / top).rglob("*"))
        if f.is_file() and f.suffix in {".yaml", ".yml", ".tpl", ".env", ".json", ".md"}
    ]
    seen = 0
    for f in files:
        for path, anchor in re.findall(r"\b(docs/[\w/.-]+\.md)(?:#([\w-]+))?", f.read_text()):
            seen += 1
            target = REPO / path
            assert target.exists(), f"{f.relative_to(REPO)}: {path} does not exist"
            if anchor:
                assert anchor in _anchors(target.read_text()), f"{f.relative_to(REPO)}: #{anchor}"
    assert seen >= 3 * 17  # every alert's runbook_url in three rule files, and the comments


def test_the_generated_tables_are_current() -> None:
    # Settings, metrics and alerts tables are what tools/docs_tables.py writes from the
    # code and the rules; a new setting, metric or alert needs `make docs-tables`.
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "docs_tables.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr


def test_pure_logic_imports_no_io_library() -> None:
    code = (
        "import sys, service.crs, service.model, service.quantity\n"
        "bad = sorted(m for m in sys.modules\n"
        "             if m.split('.')[0] in ('aiokafka', 'kubernetes_asyncio', 'aiohttp'))\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert result.stdout.strip() == ""


def test_acl_table_is_the_services_required_acls() -> None:
    from service.app.kafka_access import required_acls

    text = (DOCS / "operators" / "access.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| `([^`]+)` \| (\w+) \| `(\w+)` \|", text, re.M)
    documented = {(kind, name, pattern, op) for kind, name, pattern, op in rows}
    acls = required_acls(Config.load(env={}))
    required = {(a.resource_type, a.name, a.pattern, a.operation) for a in acls}
    assert documented == required
    # The CLI and Strimzi examples grant the same five.
    assert text.count("kafka-acls.sh --bootstrap-server") == len(required)
    assert text.count("- {resource: {type:") == len(required)
