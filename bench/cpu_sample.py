"""CPU of every process of a benchmark, second by second (issue 11, background).

Run: ``.venv/bin/python bench/cpu_sample.py [--seconds 600] [--out FILE]`` next to a
benchmark (another shell), then read the lines or the summary printed at the end.

Measured: user + system CPU (cores) per second, from ``/proc/<pid>/stat``, of the dev
stack's servers (kube-apiserver, etcd, Kafka), the service (``python -m service run``),
the raw loop (``bench/raw_eos.py``) and the benchmark scripts, summed by role. On this
2-core machine a sum near 2 means every latency figure measured meanwhile includes
waiting for a CPU. The summary averages all seconds, then the seconds in which the service
and those in which the raw loop was busy.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from _common import cpu_by_role


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--out", default="-", help="file for the per-second lines (default: stdout)")
    args = ap.parse_args()
    sink = sys.stdout if args.out == "-" else open(args.out, "w")  # noqa: SIM115
    rows: list[dict[str, float]] = []
    me = os.getpid()  # the sampler itself is not part of what it measures
    prev, t_prev = cpu_by_role(skip=me), time.monotonic()
    deadline = t_prev + args.seconds
    try:
        while time.monotonic() < deadline:
            time.sleep(1.0)
            cur, now = cpu_by_role(skip=me), time.monotonic()
            row = {k: (v - prev.get(k, v)) / (now - t_prev) for k, v in cur.items()}
            rows.append(row)
            line = " ".join(f"{k}={v:.2f}" for k, v in sorted(row.items()))
            print(f"{time.strftime('%H:%M:%S')} {line}", file=sink, flush=True)
            prev, t_prev = cur, now
    except KeyboardInterrupt:
        pass
    for who in ("any", "service", "raw"):
        busy = rows if who == "any" else [r for r in rows if r.get(who, 0.0) > 0.1]
        if busy:
            roles = sorted({k for r in busy for k in r})
            avg = {k: sum(r.get(k, 0.0) for r in busy) / len(busy) for k in roles}
            parts = " ".join(f"{k}={v:.2f}" for k, v in avg.items())
            when = "over all" if who == "any" else f"while the {who} was busy,"
            print(f"{when} {len(busy)} s: {parts}, sum {sum(avg.values()):.2f}")
    if not rows:
        print("no samples: nothing measured", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
