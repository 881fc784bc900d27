"""Issue 7, benchmark 5: time to drain a backlog.

Run: ``.venv/bin/python bench/bench_catchup.py [--events 200000] [--partitions 4]
[--placements 0.05] [--hypervisors 10000] [--repetitions 3]``

Measured: the full service (``Runtime`` in-process, watch mode, exactly-once) started
on a pre-published backlog of ``--events`` outcomes: 95 % no-host-found (an active CR,
10 input hosts) and 5 % ``slot_used`` placements (one patch each, keyed by VM so the
default partitioner spreads them, as in production; targets among the first 1,000
hosts). Reported: time from the first record handed to the processor (or the end of the
cache's initial sync, if later) to the last batch committed, and events/s; the sync
time is printed separately. The backlog is published once; every repetition is a
fresh consumer group and transactional id, and the allocations written by the previous
repetition are cleared first, so each repetition does the same writes.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Iterator

from _common import (
    Cluster,
    Record,
    Timed,
    check_mix,
    check_workload,
    create_topics,
    delete_topics,
    env_endpoints,
    load,
    median,
    no_host_found,
    outcomes,
    publish,
    quiet_logging,
    running_service,
    sample_sum,
    service_config,
    slot_used,
    topic_name,
    wait_processed,
)
from _verdict import finish

TARGET_HOSTS = 1000


def backlog(
    rng: random.Random, n: int, n_hv: int, placements: float, made: list[int]
) -> Iterator[Record]:
    """The backlog; ``made[0]`` counts the slot_used placements in it."""
    for _ in range(n):
        if rng.random() < placements:
            made[0] += 1
            yield slot_used(rng, rng.randrange(min(TARGET_HOSTS, n_hv)), n_hv)
        else:
            yield no_host_found(rng, n_hv)


def check_drained(got: dict[str, float], written: float, n: int, placements: int) -> None:
    """The backlog as published: each placement slot_used with its allocation written,
    the rest no-host-found with an active CR, no dead letter."""
    check_workload(
        got.get("placement/slot_used") == placements == written,
        f"{placements} slot_used placements published, {got.get('placement/slot_used', 0):.0f}"
        f" classified slot_used, {written:.0f} allocations written",
    )
    check_mix(
        got,
        n,
        {
            "placement/slot_used": placements / n,
            "no_host_found/slot_exhausted|no_host_found/slot_blocked": 1 - placements / n,
        },
    )


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--placements", type=float, default=0.05)
    ap.add_argument("--hypervisors", type=int, default=10_000)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()
    bootstrap, kubeconfig = env_endpoints()
    quiet_logging()
    slots = [f"res-{h:05d}-0" for h in range(min(TARGET_HOSTS, args.hypervisors))]

    topics = {k: topic_name(f"cu-{k}") for k in ("input", "output", "dlq")}
    await create_topics(
        bootstrap, {t: args.partitions if k == "input" else 1 for k, t in topics.items()}
    )
    try:
        async with Cluster.connect(kubeconfig) as cluster:
            print(await cluster.ensure(args.hypervisors), flush=True)
            t = time.perf_counter()
            rng = random.Random(args.seed)
            made = [0]
            n = await publish(
                bootstrap,
                topics["input"],
                backlog(rng, args.events, args.hypervisors, args.placements, made),
            )
            placements = made[0]
            print(
                f"published a backlog of {n} events in {time.perf_counter() - t:.1f}s [{load()}]",
                flush=True,
            )
            runs: list[tuple[float, float, float]] = []
            for rep in range(args.repetitions):
                await cluster.clear_allocations(slots)
                timed = Timed()
                timed.install()
                try:
                    cfg = service_config(bootstrap, kubeconfig, topics, "cu")
                    started = time.perf_counter()
                    async with running_service(cfg) as (runtime, synced):
                        end = await wait_processed(runtime, n, timeout_s=1800)
                        written = sum(
                            s.value
                            for f in runtime.metrics.registry.collect()
                            for s in f.samples
                            if s.name == "crs_allocations_total" and s.labels["status"] == "written"
                        )
                        dead = sample_sum(runtime, "crs_dead_letters_total")
                        check_drained(outcomes(runtime), written, n, placements)
                finally:
                    timed.uninstall()
                drain = end - max(timed.first, synced)
                runs.append((drain, n / drain, synced - started))
                print(
                    f"  rep {rep}: drained {n} in {drain:.1f}s = {n / drain:.0f} events/s "
                    f"(cache sync {synced - started:.1f}s; allocations written {written:.0f},"
                    f" dead letters {dead:.0f})   [{load()}]",
                    flush=True,
                )
            await cluster.clear_allocations(slots)
    finally:
        await delete_topics(bootstrap, list(topics.values()))
    print()
    print(
        f"backlog {n} events ({args.placements:.0%} slot_used placements), "
        f"{args.partitions} partitions, {args.hypervisors} hypervisors"
    )
    print(
        f"median drain {median(r[0] for r in runs):.1f}s = "
        f"{median(r[1] for r in runs):.0f} events/s (runs: "
        f"{', '.join(f'{r[1]:.0f}' for r in runs)}); cache sync "
        f"{median(r[2] for r in runs):.1f}s   [{load()}]"
    )


if __name__ == "__main__":
    finish(lambda: asyncio.run(main()))
