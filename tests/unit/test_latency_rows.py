"""bench/latency_rows.py (BENCHMARKS.md's latency cells from the gate's --out files) and
the gate's figures (bench/bench_latency.py)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def _lat(p50: float, p99: float, cpu: float) -> dict[str, float]:
    return {
        "p50": p50,
        "p99": p99,
        "p50_min": p50 - 1,
        "p50_max": p50 + 1,
        "p99_min": p99 - 2,
        "p99_max": p99 + 2,
        "cpu_us": cpu,
    }


def _run(service_p50: float, backlog_service: float) -> dict[str, object]:
    return {
        "figures": {
            "20/s half": {
                "raw": _lat(8.0, 13.0, 3000),
                "bound": _lat(10.0, 18.0, 3100),
                "service": _lat(service_p50, 19.0, 3500),
            },
            "200/s none": {"raw": _lat(20.0, 45.0, 1500), "service": _lat(19.0, 44.0, 1800)},
            "backlog": {"raw": {"cpu_us": 60.0}, "service": {"cpu_us": backlog_service}},
        },
        "args": {},
    }


def _rows(tmp_path: Path, *runs: dict[str, object]) -> str:
    files = []
    for i, run in enumerate(runs, 1):
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps(run))
        files.append(str(path))
    return subprocess.run(
        [sys.executable, str(REPO / "bench" / "latency_rows.py"), *files],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_each_figure_gets_both_runs_ratios_and_verdicts(tmp_path: Path) -> None:
    # Run 1: p50 9.5 of the bound's 10.0 (met), p99 19.0 / 18.0 = 1.06 (met); backlog
    # 84 / 60 = 1.40 (missed). Run 2: p50 10.5 (1.05, missed); backlog 72 / 60 (met).
    out = _rows(tmp_path, _run(9.5, 84.0), _run(10.5, 72.0))
    lines = out.splitlines()
    half = next(line for line in lines if line.startswith("20/s half | "))
    one, two = half.removeprefix("20/s half | ").split("<br>")
    dash = "\u2013"  # the table's en dash
    assert one.startswith(f"run 1: service 9.5 (8.5{dash}10.5) / 19.0 (17.0{dash}21.0); bound 10.0")
    assert "p99 **1.06** met, p50 **0.95** met" in one
    assert "p50 **1.05** **missed**" in two
    none = next(line for line in lines if line.startswith("200/s none | "))
    assert "**0.98** met; CPU per event at this rate 1800 vs 1500 µs (1.20)" in none
    backlog = next(line for line in lines if line.startswith("backlog | "))
    assert "run 1: service 84.0 µs vs raw 60.0 µs: **1.40** **missed**" in backlog
    assert "run 2: service 72.0 µs vs raw 60.0 µs: **1.20** met" in backlog
    # The backlog's service CPU is 84 vs 72 (1.17, within 1.2x); the 20/s p50 9.5 vs 10.5
    # too: nothing apart, and no goal ratio either.
    assert "figures more than 1.2x apart: 0 of 17" in lines
    assert "ratios more than 1.2x apart: 0 of" in out


def test_figures_apart_are_named(tmp_path: Path) -> None:
    out = _rows(tmp_path, _run(9.5, 60.0), _run(9.5, 90.0))
    assert "figures more than 1.2x apart: 1 of 17" in out
    assert "  backlog service cpu_us: 90.0 vs 60.0 earlier" in out
    assert "backlog cpu_us service/raw: 1.50 vs 1.00 earlier (DISAGREE)" in out


def test_one_run_prints_its_cells_only(tmp_path: Path) -> None:
    out = _rows(tmp_path, _run(9.5, 60.0))
    assert "<br>" not in out
    assert "apart" not in out
    assert out.count("run 1: ") == 3


def test_the_gate_reports_each_kinds_p50(monkeypatch: pytest.MonkeyPatch) -> None:
    # Half placements: the pooled p50 lies between the kinds, so each kind's own p50 is
    # in the figures too (which kind moved).
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # bench/ is scripts, not a package
    gate = importlib.import_module("bench_latency")
    fast = [0.005 + i * 0.0001 for i in range(10)]  # no-host-found: 5.0-5.9 ms
    slow = [0.010 + i * 0.0001 for i in range(10)]  # placements: 10.0-10.9 ms
    run = gate.Run(
        lat=fast + slow, kinds=[False] * 10 + [True] * 10, cpu_per_event=0.002, txn_per_event=0.5
    )
    f = gate.figures([run, run])
    assert f["others_p50"] == pytest.approx(5.5)  # nearest rank of 20
    assert f["placements_p50"] == pytest.approx(10.5)
    assert 5.9 <= f["p50"] <= 10.0
    assert f["cpu_us"] == pytest.approx(2000)
    assert f["txn_per_event"] == pytest.approx(0.5)
    none = gate.figures(
        [gate.Run(lat=fast, kinds=[False] * 10, cpu_per_event=0.002, txn_per_event=1)]
    )
    assert "placements_p50" not in none
    assert "others_p50" not in none


def test_the_gates_goals_per_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    # One place says what each figure's goals compare (the gate's verdict and the table).
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    gate = importlib.import_module("bench_latency")
    figures = _run(9.5, 84.0)["figures"]
    assert isinstance(figures, dict)
    assert gate.goal_ratios("20/s half", figures["20/s half"]) == [
        ("p99 service/bound", pytest.approx(19.0 / 18.0), 1.1),
        ("p50 service/bound", pytest.approx(0.95), 1.0),
    ]
    assert gate.goal_ratios("200/s none", figures["200/s none"]) == [
        ("p99 service/raw", pytest.approx(44.0 / 45.0), 1.0)
    ]
    assert gate.goal_ratios("backlog", figures["backlog"]) == [
        ("CPU/event service/raw", pytest.approx(1.4), 1.3)
    ]
