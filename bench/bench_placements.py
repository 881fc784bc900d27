"""Issue 7, benchmark 2: slot_used placements against the API-server limit.

Run: ``.venv/bin/python bench/bench_placements.py [--events 3000] [--partitions 8]
[--hosts 400] [--repetitions 3] [--hypervisors 500]``

Measured: events/s of the full service (``Runtime`` in-process, watch mode,
exactly-once) on a stream of ``slot_used`` placements, each of which is one guarded
merge patch of a Reservation (a new allocation in the 1 TiB ``p-bench`` slot of its
target host; a fresh VM every event), and events/s of a raw loop doing, for the same
(reservation, VM) sequence, a GET and then the same guarded patch (merge patch with
``metadata.resourceVersion``, built by the service's own ``KubeClient.patch_allocation``,
so body, content type and HTTP client are the service's).

Why it is fair: the service can have one request in flight per partition (a batch's
partitions run concurrently, each partition's records in order), so the raw loop runs
exactly one worker per partition, each taking its partition's events in offset order.
Events are published with an explicit partition (target host modulo partitions), so a
reservation is only ever written from one partition, for both (no 409s by design; any
that happen are counted). Both alternate (raw, service, raw, ...) on the same
reservations, whose allocations are cleared before each repetition so every repetition
patches objects of the same size. The raw loop does two requests per event (GET +
PATCH) because that is the plain read-modify-write; the service reads from its watch
cache, so it needs only the PATCH: beating raw is possible and expected. Clocks: as in
bench_throughput (first record handed over to last batch committed; raw: first GET to
last PATCH).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from _common import (
    Cluster,
    Timed,
    create_topics,
    delete_topics,
    env_endpoints,
    host,
    load,
    median,
    publish,
    quiet_logging,
    running_service,
    sample_sum,
    service_config,
    slot_used,
    topic_name,
    wait_processed,
)

from service.k8s import KubeClient
from service.stream.consumer import StreamService


async def raw_loop(kubeconfig: str, work: list[list[tuple[str, str]]]) -> tuple[float, int]:
    """One worker per partition: GET the reservation, then the guarded patch. events/s."""
    kube = await KubeClient.create(kubeconfig)
    conflicts = 0
    allocation = {
        "creationTimestamp": "2026-01-01T00:00:00Z",
        "resources": {"memory": "4Gi", "cpu": "2"},
    }

    async def worker(items: list[tuple[str, str]]) -> None:
        nonlocal conflicts
        for name, vm in items:
            res = await kube.get_reservation(name)
            assert res is not None, name
            try:
                await kube.patch_allocation(res, vm, allocation)
            except Exception:  # a 409 would be a bug of the plan; count it, go on
                conflicts += 1

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(items) for items in work))
        n = sum(len(items) for items in work)
        return n / (time.perf_counter() - t0), conflicts
    finally:
        await kube.close()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=3000)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--hosts", type=int, default=400, help="distinct target hosts/slots")
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--hypervisors", type=int, default=500)
    ap.add_argument("--seed", type=int, default=2)
    args = ap.parse_args()
    assert args.hosts <= args.hypervisors
    bootstrap, kubeconfig = env_endpoints()
    quiet_logging()
    slots = [f"res-{h:05d}-0" for h in range(args.hosts)]

    async with Cluster.connect(kubeconfig) as cluster:
        print(await cluster.ensure(args.hypervisors))
        raw: list[float] = []
        svc: list[float] = []
        for rep in range(args.repetitions):
            rng = random.Random(args.seed * 1000 + rep)
            targets = [rng.randrange(args.hosts) for _ in range(args.events)]
            # Raw: per-partition work lists with fresh VMs.
            work: list[list[tuple[str, str]]] = [[] for _ in range(args.partitions)]
            for h in targets:
                work[h % args.partitions].append((f"res-{h:05d}-0", f"raw-{rep}-{rng.random()}"))
            await cluster.clear_allocations(slots)
            rate, conflicts = await raw_loop(kubeconfig, work)
            raw.append(rate)
            print(
                f"  rep {rep}: raw GET+PATCH {rate:7.0f} events/s  conflicts {conflicts}"
                f"   [{load()}]",
                flush=True,
            )

            await cluster.clear_allocations(slots)
            topics = {k: topic_name(f"pl-{k}") for k in ("input", "output", "dlq")}
            await create_topics(
                bootstrap, {t: args.partitions if k == "input" else 1 for k, t in topics.items()}
            )
            try:
                records = [
                    slot_used(rng, h, args.hypervisors, partition=h % args.partitions)
                    for h in targets
                ]
                await publish(bootstrap, topics["input"], records)
                timed = Timed()
                timed.install()
                parts_per_batch: list[int] = []
                orig_batch = StreamService._process_batch

                async def counting(
                    self_: StreamService,
                    batch: Any,
                    _seen: list[int] = parts_per_batch,
                    _orig: Any = orig_batch,
                ) -> None:
                    _seen.append(len(batch))
                    await _orig(self_, batch)

                StreamService._process_batch = counting  # type: ignore[method-assign]
                try:
                    cfg = service_config(bootstrap, kubeconfig, topics, "pl")
                    async with running_service(cfg) as (runtime, synced):
                        end = await wait_processed(runtime, len(records), timeout_s=900)
                        written = sample_sum(runtime, "crs_allocations_total")
                        conflicts = int(sample_sum(runtime, "crs_patch_conflicts_total"))
                        slot_used_n = sum(
                            s.value
                            for f in runtime.metrics.registry.collect()
                            for s in f.samples
                            if s.name == "crs_allocations_total" and s.labels["status"] == "written"
                        )
                finally:
                    timed.uninstall()
                    StreamService._process_batch = orig_batch  # type: ignore[method-assign]
                t0 = max(timed.first, synced)
                rate = len(records) / (end - t0)
                svc.append(rate)
                # Mean requests in flight = total time inside process() / wall time.
                in_flight = sum(b - a for a, b in timed.spans) / (end - t0)
                print(
                    f"  rep {rep}: service      {rate:7.0f} events/s  conflicts {conflicts}"
                    f"  written {slot_used_n:.0f}/{written:.0f}; mean in flight {in_flight:.1f},"
                    f" partitions per batch {median(parts_per_batch):.0f}"
                    f" ({len(parts_per_batch)} batches)   [{load()}]",
                    flush=True,
                )
            finally:
                await delete_topics(bootstrap, list(topics.values()))
        await cluster.clear_allocations(slots)

    ratios = [s / r for s, r in zip(svc, raw, strict=True)]
    print()
    print(
        f"{args.partitions} partitions = {args.partitions} concurrent requests, "
        f"{args.events} events over {args.hosts} slots ({host(0)}..)"
    )
    print(f"{'':10} {'raw GET+PATCH':>16} {'service':>10} {'service/raw':>12}")
    print(f"{'median':10} {median(raw):16.0f} {median(svc):10.0f} {median(ratios):12.2f}")
    print(
        f"{'runs':10} {' '.join(f'{x:.0f}' for x in raw):>16} "
        f"{' '.join(f'{x:.0f}' for x in svc):>10} "
        f"{' '.join(f'{x:.2f}' for x in ratios):>12}"
    )
    goal = median(ratios) >= 0.8
    print(f"goal service >= 0.8 x raw: {'met' if goal else 'MISSED'}   [{load()}]")


if __name__ == "__main__":
    asyncio.run(main())
