"""BENCHMARKS.md's latency cells from ``bench_latency.py --out`` files, so that the table
says what the runs printed (nothing typed by hand).

Run: ``.venv/bin/python bench/latency_rows.py run1.json [run2.json]``

Prints one line per figure of the gate (each rate, the rate without placements, the
backlog): its name, then the Value cell, ``run 1: ...<br>run 2: ...``, with the service's
p50 / p99 and their per-repetition range beside its references', the ratios the goals
compare and whether each goal was met. With two files it then says which figures are
more than ``bench_latency.AGREE`` apart, and which of the goals' ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import bench_latency as gate


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


# The table's ranges are written with an en dash.
DASH = "\u2013"


def _latency(name: str, f: dict[str, float]) -> str:
    return (
        f"{name} {f['p50']:.1f} ({f['p50_min']:.1f}{DASH}{f['p50_max']:.1f}) / "
        f"{f['p99']:.1f} ({f['p99_min']:.1f}{DASH}{f['p99_max']:.1f})"
    )


def cell(key: str, modes: dict[str, dict[str, float]]) -> str:
    """One run's part of a figure's Value cell (the goals as the gate judges them)."""
    s = modes["service"]
    goals = gate.goal_ratios(key, modes)
    if key == "backlog":
        [(_, ratio, limit)] = goals
        return (
            f"service {s['cpu_us']:.1f} µs vs raw {modes['raw']['cpu_us']:.1f} µs: "
            f"**{ratio:.2f}** {_verdict(ratio <= limit)}"
        )
    if key.endswith("none"):
        r = modes["raw"]
        [(_, ratio, limit)] = goals
        return (
            f"{_latency('service', s)}; {_latency('raw', r)}: **{ratio:.2f}** "
            f"{_verdict(ratio <= limit)}; CPU per event at this rate "
            f"{s['cpu_us']:.0f} vs {r['cpu_us']:.0f} µs ({s['cpu_us'] / r['cpu_us']:.2f})"
        )
    verdicts = ", ".join(
        f"{what.split()[0]} **{ratio:.2f}** {_verdict(ratio <= limit)}"
        for what, ratio, limit in goals
    )
    return (
        f"{_latency('service', s)}; {_latency('bound', modes['bound'])}; "
        f"{_latency('raw', modes['raw'])}: {verdicts}; "
        f"service CPU {s['cpu_us']:.0f} µs per event"
    )


def rows(runs: list[dict[str, Any]]) -> list[str]:
    """``key | run 1: ...<br>run 2: ...`` per figure of the first run."""
    out = []
    for key in runs[0]["figures"]:
        parts = [
            f"run {i}: {cell(key, run['figures'][key])}"
            for i, run in enumerate(runs, 1)
            if key in run["figures"]
        ]
        out.append(f"{key} | " + "<br>".join(parts))
    return out


def agreement(now: dict[str, Any], before: dict[str, Any]) -> list[str]:
    """Which figures, and which of the goals' ratios, are more than AGREE apart."""
    off = gate.agreement(now, before)
    count = sum(
        name in f
        for modes in now["figures"].values()
        for f in modes.values()
        for name in ("p50", "p99", "cpu_us")
    )
    lines = [f"figures more than {gate.AGREE:g}x apart: {len(off)} of {count}"]
    lines += [f"  {line}" for line in off]
    ratio_lines = gate.ratio_agreement(now, before)
    apart = [line for line in ratio_lines if "DISAGREE" in line]
    lines.append(f"ratios more than {gate.AGREE:g}x apart: {len(apart)} of {len(ratio_lines)}")
    lines += [f"  {line}" for line in apart]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="bench_latency.py --out files, run 1 first")
    args = ap.parse_args()
    runs = [json.loads(Path(f).read_text()) for f in args.files]
    for line in rows(runs):
        print(line)
    if len(runs) == 2:
        print()
        for line in agreement(runs[1], runs[0]):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
