"""Issue 7, benchmark 3: per-event latency of the full service, small vs. large cluster.

Run: ``.venv/bin/python bench/bench_scale.py [--events 4000] [--warmup 500]
[--repetitions 3] [--small 100] [--large 10000]``

Measured: for a small cluster (100 hypervisors, 500 reservations) and a large one
(10,000 hypervisors, 50,000 reservations; 1,001 CommittedResources in both), the
per-event latency of the service (``Runtime`` in-process, watch mode, exactly-once):
the time of each ``Processor.process`` call, timed directly by wrapping it, i.e. from
the consume loop handing the record over to the outcome record existing (decode,
snapshot, classify, encode, log line). Not the ``crs_processing_seconds`` histogram:
its buckets (1 ms, 2.5 ms, ...) are far coarser than the ~0.1-0.3 ms measured. The
stream is read-only (no patches, so the figure is the cache and classifier, not the
API server's write latency): 60 % no-host-found of a project with an active CR, 40 %
placements classified slot_missed, 20 candidate hosts each, drawn from the whole
cluster. After ``--warmup`` events, the rest is cut into ``--repetitions`` equal chunks
(in processing order); the report gives the median over chunks of each chunk's median
and p99, and their ratio large/small (goal <= 1.3).

Also: API reads per event in steady state, from the service's own
``crs_k8s_requests_total`` (verbs list and get) read before publishing and after the
last event, asserted to be 0; the seeding time of the large cluster (concurrent creates,
then status writes) and the cache's initial sync time.

Fairness: the small cluster is the first hosts of the large one (same objects, same
CRs, same event shapes); the stream is published only after the cache has synced, so
no event waits for the initial LIST. The sizes cannot alternate (the cluster is in
the API server), so the small one runs first; the load is printed next to each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

from _common import (
    RES_PER_HOST,
    Cluster,
    Record,
    Timed,
    check_mix,
    check_workload,
    create_topics,
    delete_topics,
    env_endpoints,
    k8s_reads,
    load,
    median,
    no_host_found,
    outcomes,
    pct,
    publish,
    quiet_logging,
    running_service,
    service_config,
    slot_missed,
    topic_name,
    wait_processed,
)
from _verdict import finish, goals

# The stream the figures describe (see the module docstring): read-only, no patch.
MIX = {
    "no_host_found/slot_exhausted|no_host_found/slot_blocked": 0.6,
    "placement/slot_missed": 0.4,
}


def stream(rng: random.Random, n_hv: int, n: int) -> list[Record]:
    return [
        no_host_found(rng, n_hv, 20) if rng.random() < 0.6 else slot_missed(rng, n_hv, 20)
        for _ in range(n)
    ]


async def measure(
    bootstrap: str, kubeconfig: str, n_hv: int, args: argparse.Namespace
) -> dict[str, Any]:
    topics = {k: topic_name(f"sc-{k}") for k in ("input", "output", "dlq")}
    await create_topics(bootstrap, {t: 4 if k == "input" else 1 for k, t in topics.items()})
    records = stream(random.Random(args.seed), n_hv, args.events)
    timed = Timed()
    timed.install()
    try:
        cfg = service_config(bootstrap, kubeconfig, topics, "sc")
        started = time.perf_counter()
        async with running_service(cfg) as (runtime, synced):
            sync_s = synced - started
            before = k8s_reads(runtime)
            await publish(bootstrap, topics["input"], records)
            await wait_processed(runtime, len(records), timeout_s=900)
            after = k8s_reads(runtime)
            check_mix(outcomes(runtime), len(records), MIX)
    finally:
        timed.uninstall()
        await delete_topics(bootstrap, list(topics.values()))
    spans = [b - a for a, b in timed.spans[args.warmup :]]
    size = len(spans) // args.repetitions
    chunks = [spans[i * size : (i + 1) * size] for i in range(args.repetitions)]
    reads = sum(after.get(v, 0) - before.get(v, 0) for v in ("list", "get"))
    return {
        "median": [median(c) for c in chunks],
        "p99": [pct(c, 0.99) for c in chunks],
        "reads": reads,
        "sync_s": sync_s,
        "load": load(),
    }


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=4000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--small", type=int, default=100, help="hypervisors of the small cluster")
    ap.add_argument("--large", type=int, default=10_000, help="hypervisors of the large one")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--measure", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    bootstrap, kubeconfig = env_endpoints()
    quiet_logging()
    if args.measure:  # the child: measure the cluster as it is, print one JSON line
        print(json.dumps(await measure(bootstrap, kubeconfig, args.measure, args)))
        return 0

    sizes = [n for n in (args.small, args.large) if n]  # --small 0: the large one only
    async with Cluster.connect(kubeconfig) as cluster:
        if await cluster.marker() == args.large:
            sizes.reverse()  # already seeded large: measure it first, then wipe to small
    results = {}
    for n_hv in sizes:
        async with Cluster.connect(kubeconfig) as cluster:
            seeded = await cluster.ensure(n_hv)
        print(seeded, f"  [{load()}]", flush=True)
        # A fresh process per size: the seeding's garbage must not fragment the heap the
        # cache is then built in (that alone cost the large cluster ~30 %).
        child = await asyncio.create_subprocess_exec(
            sys.executable, __file__, *sys.argv[1:], "--measure", str(n_hv),
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await child.communicate()
        # The child checked its workload (exit 2, reason on stderr) before printing.
        check_workload(child.returncode == 0, f"measuring {n_hv} hypervisors failed")
        r = results[n_hv] = json.loads(out.decode().strip().splitlines()[-1])
        print(
            f"  {n_hv} HV: cache synced in {r['sync_s']:.1f}s; per-event median "
            f"{[round(x * 1e6) for x in r['median']]} µs, p99 "
            f"{[round(x * 1e6) for x in r['p99']]} µs; API list+get during the stream: "
            f"{r['reads']:.0f}   [{r['load']}]",
            flush=True,
        )

    if not args.small:
        return 0
    s, lg = results[args.small], results[args.large]
    med_s, med_l = median(s["median"]), median(lg["median"])
    p99_s, p99_l = median(s["p99"]), median(lg["p99"])
    ratios = [b / a for a, b in zip(s["median"], lg["median"], strict=True)]
    print()
    print(f"{'cluster':>28} {'median µs':>10} {'p99 µs':>8} {'reads/event':>12} {'sync s':>7}")
    for n_hv, r, m, p in ((args.small, s, med_s, p99_s), (args.large, lg, med_l, p99_l)):
        label = f"{n_hv} HV / {n_hv * RES_PER_HOST} res"
        print(
            f"{label:>28} {m * 1e6:10.0f} {p * 1e6:8.0f} "
            f"{float(r['reads']) / args.events:12.3f} {r['sync_s']:7.1f}"
        )
    print(
        f"ratio large/small: median {med_l / med_s:.2f} (per chunk "
        f"{', '.join(f'{x:.2f}' for x in ratios)}), p99 {p99_l / p99_s:.2f}"
    )
    return goals(
        {
            "goal ratio <= 1.3": med_l / med_s <= 1.3,
            "steady-state API reads per event = 0": s["reads"] == 0 and lg["reads"] == 0,
        },
        f"[{load()}]",
    )


if __name__ == "__main__":
    finish(lambda: asyncio.run(main()))
