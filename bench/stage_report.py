"""Per-stage latency of the service's records, from ``bench/stage_trace`` output.

Run: ``PYTHONPATH=bench/stage_trace CRS_TRACE_OUT=/tmp/trace .venv/bin/python
bench/bench_latency.py --modes service --rates 20 --none-rate 0 --backlog 0 --seconds 20
--repetitions 1``, then ``.venv/bin/python bench/stage_report.py /tmp/trace``.

For each record (placements, those whose decision took over 2 ms, apart from the rest):
publish to fetch, fetch to deciding, deciding, decision to its commit's start, the
commit, and publish to the commit's end; p50 / p90 / p99 in ms. Then the transactions
opened ahead, the API requests, the EndTxn requests and the Kafka requests by type.
Exits 2 when the trace holds no record (the tracer did not run: PYTHONPATH or
CRS_TRACE_OUT missing).
"""

from __future__ import annotations

import glob
import json
import sys
from typing import Any

STAGES = ("fetch", "queue", "decide", "to_commit", "commit", "total")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))] * 1000


def main() -> int:
    prefix = sys.argv[1]
    events: list[list[Any]] = []
    for path in glob.glob(f"{prefix}.*"):
        with open(path) as f:
            events += json.load(f)
    records: dict[tuple[int, int], dict[str, float]] = {}
    sends: dict[int, list[list[Any]]] = {}
    for e in events:
        if e[0] == "fetched":
            records.setdefault((e[1], e[2]), {}).update(published=e[3], fetched=e[4])
        elif e[0] == "decided":
            records.setdefault((e[1], e[2]), {}).update(started=e[3], decided=e[4])
        elif e[0] == "sent":
            sends.setdefault(e[1], []).append(e)
    for commits in sends.values():
        commits.sort(key=lambda c: c[3])
    rows: list[tuple[list[float], bool]] = []
    for (partition, offset), r in records.items():
        if len(r) < 4:
            continue
        # The commit that carried it: the first to start after its decision and to end
        # above its offset.
        commit = next(
            (c for c in sends.get(partition, []) if c[2] > offset and c[3] >= r["decided"]),
            None,
        )
        if commit is None:
            continue
        stages = [
            r["fetched"] - r["published"],
            r["started"] - r["fetched"],
            r["decided"] - r["started"],
            commit[3] - r["decided"],
            commit[4] - commit[3],
            commit[4] - r["published"],
        ]
        rows.append((stages, r["decided"] - r["started"] > 0.002))
    if not rows:
        print(f"no traced record under {prefix}.*", file=sys.stderr)
        return 2
    for label, subset in (
        ("all", rows),
        ("placements (decided in over 2 ms)", [r for r in rows if r[1]]),
        ("the rest", [r for r in rows if not r[1]]),
    ):
        if not subset:
            continue
        print(f"{label}: {len(subset)} records; ms p50 / p90 / p99")
        for i, stage in enumerate(STAGES):
            values = [s[i] for s, _ in subset]
            print(
                f"  {stage:10s} {pct(values, 0.5):7.2f} {pct(values, 0.9):7.2f}"
                f" {pct(values, 0.99):7.2f}"
            )
    commits = [c for cs in sends.values() for c in cs]
    print(f"commits: {len(commits)}, of them opened ahead: {sum(bool(c[5]) for c in commits)}")
    for kind, label in (
        ("opened_ahead", "opening ahead"),
        ("api_request", "API requests"),
        ("end_txn", "EndTxn"),
    ):
        spans = [e[4] - e[3] for e in events if e[0] == kind]
        if spans:
            print(f"{label}: {len(spans)}, ms p50 {pct(spans, 0.5):.2f} p90 {pct(spans, 0.9):.2f}")
    for e in events:
        if e[0] == "produced_ahead":
            print(
                f"outputs produced ahead: {e[1]['published']:.0f} published,"
                f" {e[1]['discarded']:.0f} discarded"
            )
        if e[0] == "kafka_requests":
            traced = len(records)
            print(f"Kafka requests for {traced} records ({len(commits)} commits):")
            for name, n in sorted(e[1].items(), key=lambda kv: -kv[1]):
                print(f"  {name:28s} {n:7d}  {n / max(traced, 1):6.2f} per record")
    return 0


if __name__ == "__main__":
    sys.exit(main())
