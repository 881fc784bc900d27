"""What the API server alone costs for the placements' writes (issue 11, background).

Run: ``.venv/bin/python bench/probe_patch.py [--rate 100] [--seconds 30]`` (with
``bench/cpu_sample.py`` in another shell to see the API server's CPU meanwhile)

Measured: latency of merge PATCHes adding one allocation to the benchmark's placement
slots (``res-<host>-0`` of ``--hosts`` hosts), sent at a fixed rate from this process
without any Kafka or service work, per second and overall (p50/p99/max). It is the
write half of ``bench_latency.py``'s placements, so it separates what the API server
needs for them from what the service adds.

Fails (exit 1) when the workload did not happen: a PATCH not answered 200, or the slots
not holding every allocation written.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
import uuid
from collections import defaultdict

from _common import MERGE, Cluster, env_endpoints, load, pct


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=100.0, help="PATCHes per second")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--hosts", type=int, default=400)
    ap.add_argument("--hypervisors", type=int, default=500)
    args = ap.parse_args()
    _, kubeconfig = env_endpoints()
    names = [f"res-{h:05d}-0" for h in range(args.hosts)]
    rng = random.Random(7)
    allocation = {
        "creationTimestamp": "2026-12-03T00:00:00Z",
        "resources": {"memory": "4Gi", "cpu": "2"},
    }
    async with Cluster.connect(kubeconfig) as cluster:
        print(await cluster.ensure(args.hypervisors))  # the benchmarks' cluster, seeded once
        await cluster.clear_allocations(names)
        written: dict[str, set[str]] = defaultdict(set)
        timings: list[tuple[float, float, int]] = []  # (sent at, seconds, status)

        async def one(at: float, name: str, vm: str) -> None:
            body = {"spec": {"committedResourceReservation": {"allocations": {vm: allocation}}}}
            started = time.monotonic()
            status, _ = await cluster.call("PATCH", cluster.url("reservations", name), body, MERGE)
            timings.append((at, time.monotonic() - started, status))
            written[name].add(vm)

        tasks = []
        t0 = time.monotonic()
        n = int(args.rate * args.seconds)
        for i in range(n):
            wait = t0 + i / args.rate - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            vm = str(uuid.UUID(int=rng.getrandbits(128)))
            tasks.append(asyncio.create_task(one(time.monotonic() - t0, rng.choice(names), vm)))
        await asyncio.gather(*tasks)
        missing = 0
        for name, vms in written.items():
            missing += len(vms - set(await cluster.allocations(name)))
        await cluster.clear_allocations(names)
    per_second: dict[int, list[float]] = defaultdict(list)
    for at, seconds, _ in timings:
        per_second[int(at)].append(seconds)
    print(f"{n} PATCHes at {args.rate:g}/s over {args.hosts} slots; ms per second of sending")
    for second in sorted(per_second):
        v = per_second[second]
        print(f"  {second:4d}s  p50 {pct(v, 0.5) * 1e3:6.1f}  max {max(v) * 1e3:7.1f}")
    all_s = [s for _, s, _ in timings]
    print(
        f"overall p50 {pct(all_s, 0.5) * 1e3:.1f} ms, p99 {pct(all_s, 0.99) * 1e3:.1f} ms, "
        f"max {max(all_s) * 1e3:.1f} ms   [{load()}]"
    )
    bad = sum(status != 200 for _, _, status in timings)
    if bad or missing or len(timings) != n:
        print(f"WORKLOAD FAILED: {bad} PATCHes not 200, {missing} allocations missing")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
