"""Issue 11, benchmark 2: slot_used placements with the API server 20 ms away.

Run: ``.venv/bin/python bench/bench_placements.py [--events 600] [--one-way-ms 10]
[--partitions 1,4] [--repetitions 2] [--quick]``

Measured: events/s of slot_used placements, each one guarded merge patch of a
Reservation (a new allocation in the 1 TiB ``p-bench`` slot of its target host, a fresh
VM every event), with every request to kube-apiserver going through
``bench/delay_proxy.py`` (``--one-way-ms`` each way: 10 ms = a 20 ms round trip), for

* the service (``python -m service run``, its own process, defaults: watch mode,
  exactly-once) on input topics of 1 and of 4 partitions (records keyed by VM, as Nova
  publishes them): from the first record published until the group has committed the
  last one;
* a raw loop in this process, 8 workers through the same proxy, each doing a GET of the
  reservation and then the same guarded patch (``KubeClient.patch_allocation``: same
  body, content type and HTTP client as the service), re-reading on a 409. Work is
  split by target host, so no two workers write the same Reservation.

Why it is fair: the raw loop needs two round trips per event (GET + PATCH), the service
one (it reads its watch cache), so reaching 0.8 of raw needs real concurrency from the
service, which a partition processed one event at a time cannot give (at most
``partitions / round trip``). Both run on the same Reservations, whose allocations are
cleared before each run; raw and service alternate. The service is started, synced
(``/readyz``) and in its group before the first record is published, and the publish
time (a burst, well under a second) is inside the service's clock.

Fails (exit 1) when the workload did not happen: fewer or more allocations in the API
server than placements timed, an output missing or not ``written``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import uuid

import msgspec
from _common import (
    SELECTOR,
    Cluster,
    OutputReader,
    WorkloadError,
    apiserver_address,
    create_topics,
    delay_proxy_process,
    delete_topics,
    env_endpoints,
    free_port,
    load,
    median,
    proxied_kubeconfig,
    publish,
    service_config,
    slot_used,
    spawn_service,
    stop_process,
    topic_name,
    wait_committed,
    wait_group_stable,
    wait_http_ok,
)
from _verdict import finish, goals

from service.crs.ports import ConflictError
from service.k8s import KubeClient

WORKERS = 8
GOAL = 0.8


async def allocations_in(cluster: Cluster, names: set[str]) -> int:
    status, body = await cluster.call(
        "GET", cluster.url("reservations") + f"?labelSelector={SELECTOR}"
    )
    assert status == 200, (status, body[:300])
    total = 0
    for item in json.loads(body)["items"]:
        if item["metadata"]["name"] in names:
            crr = item["spec"].get("committedResourceReservation") or {}
            total += len(crr.get("allocations") or {})
    return total


async def raw_loop(kubeconfig: str, targets: list[int], rep: int) -> tuple[float, int]:
    """8 workers, GET + guarded PATCH per event; returns (events/s, 409s met)."""
    kube = await KubeClient.create(kubeconfig)
    conflicts = 0
    allocation = {
        "creationTimestamp": "2026-01-01T00:00:00Z",
        "resources": {"memory": "4Gi", "cpu": "2"},
    }
    work: list[list[tuple[str, str]]] = [[] for _ in range(WORKERS)]
    for i, h in enumerate(targets):
        work[h % WORKERS].append((f"res-{h:05d}-0", f"raw-{rep}-{i}-{uuid.uuid4()}"))

    async def worker(items: list[tuple[str, str]]) -> None:
        nonlocal conflicts
        for name, vm in items:
            while True:
                res = await kube.get_reservation(name)
                assert res is not None, name
                try:
                    await kube.patch_allocation(res, vm, allocation)
                    break
                except ConflictError:
                    conflicts += 1

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(items) for items in work))
        return len(targets) / (time.perf_counter() - t0), conflicts
    finally:
        await kube.close()


async def service_run(
    partitions: int, targets: list[int], args: argparse.Namespace, kubeconfig: str, rep: int
) -> float:
    bootstrap = args.bootstrap
    topics = {k: topic_name(f"pl{partitions}-{k}") for k in ("input", "output", "dlq")}
    await create_topics(bootstrap, {t: 1 if k == "dlq" else partitions for k, t in topics.items()})
    rng = random.Random(args.seed * 1000 + rep * 10 + partitions)
    records = [slot_used(rng, h, args.hypervisors) for h in targets]
    port = free_port()
    cfg = service_config(bootstrap, kubeconfig, topics, "pl", CRS_HTTP_PORT=str(port))
    log = f"/tmp/crs-bench-placements-{partitions}p-{rep}.log"
    proc = spawn_service(cfg, log)
    reader = OutputReader(bootstrap, topics["output"], partitions)
    try:
        await wait_http_ok(f"http://127.0.0.1:{port}/readyz", 120, proc)
        await wait_group_stable(bootstrap, cfg.group_id, 1, 60)
        t0 = time.perf_counter()
        await publish(bootstrap, topics["input"], records)
        end = await wait_committed(
            bootstrap, cfg.group_id, topics["input"], len(records), timeout_s=900, proc=proc
        )
        await reader.start()
        keys = [r[0] for r in records if r[0] is not None]
        if not await reader.wait_for(keys, timeout_s=30):
            raise WorkloadError(f"{len(set(keys) - set(reader.seen))} outputs missing")
        await asyncio.sleep(0.5)
        datas = [msgspec.json.decode(v)["data"] for v in reader.values]
        written = sum(d["cr_slot"] == "slot_used" and d["allocation"] == "written" for d in datas)
        if len(datas) != len(records) or written != len(records):
            raise WorkloadError(
                f"{len(datas)} outputs, {written} written, for {len(records)} placements"
            )
        return len(records) / (end - t0)
    finally:
        await reader.stop()
        stop_process(proc)
        await delete_topics(bootstrap, list(topics.values()))


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=600)
    ap.add_argument("--partitions", default="1,4")
    ap.add_argument("--one-way-ms", type=float, default=10.0)
    ap.add_argument("--hosts", type=int, default=400, help="distinct target hosts/slots")
    ap.add_argument("--repetitions", type=int, default=2)
    ap.add_argument("--hypervisors", type=int, default=500)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="200 events, 1 repetition")
    args = ap.parse_args()
    if args.quick:
        args.events, args.repetitions = 200, 1
    assert args.hosts <= args.hypervisors
    parts = [int(p) for p in args.partitions.split(",")]
    args.bootstrap, kubeconfig = env_endpoints()
    slots = {f"res-{h:05d}-0" for h in range(args.hosts)}
    raw: list[float] = []
    svc: dict[int, list[float]] = {p: [] for p in parts}
    async with Cluster.connect(kubeconfig) as cluster:
        print(await cluster.ensure(args.hypervisors))
        proxy_log = f"/tmp/crs-bench-placements-proxy-{uuid.uuid4().hex[:6]}.log"
        upstream = apiserver_address(kubeconfig)
        async with delay_proxy_process(upstream, args.one_way_ms, proxy_log) as proxy_port:
            far = proxied_kubeconfig(kubeconfig, proxy_port, f"{proxy_log}.kubeconfig")
            print(f"API server behind the delay proxy: +{args.one_way_ms:g} ms each way")
            # A WorkloadError ends the run (finish: exit 2).
            for rep in range(args.repetitions):
                rng = random.Random(args.seed * 1000 + rep)
                targets = [rng.randrange(args.hosts) for _ in range(args.events)]
                await cluster.clear_allocations(slots)
                rate, conflicts = await raw_loop(far, targets, rep)
                got = await allocations_in(cluster, slots)
                if got != len(targets):
                    raise WorkloadError(f"raw: {got} allocations for {len(targets)} events")
                raw.append(rate)
                print(
                    f"  rep {rep}: raw GET+PATCH x{WORKERS} {rate:6.1f} events/s "
                    f"(409s {conflicts})   [{load()}]",
                    flush=True,
                )
                for p in parts:
                    await cluster.clear_allocations(slots)
                    rate = await service_run(p, targets, args, far, rep)
                    got = await allocations_in(cluster, slots)
                    if got != len(targets):
                        raise WorkloadError(
                            f"service: {got} allocations for {len(targets)} placements"
                        )
                    svc[p].append(rate)
                    print(
                        f"  rep {rep}: service, {p} partition(s) {rate:6.1f} events/s   [{load()}]",
                        flush=True,
                    )
            await cluster.clear_allocations(slots)

    print()
    print(
        f"{args.events} slot_used placements over {args.hosts} slots, API server "
        f"+{args.one_way_ms:g} ms each way; events/s (median of {args.repetitions})"
    )
    print(f"{'':22} {'events/s':>9} {'service/raw':>12} {'runs':>20}")
    runs = " ".join(f"{x:.1f}" for x in raw)
    print(f"{'raw GET+PATCH x8':22} {median(raw):9.1f} {'':>12} {runs:>20}")
    goal = True
    for p in parts:
        ratios = [s / r for s, r in zip(svc[p], raw, strict=True)]
        goal = goal and median(ratios) >= GOAL
        print(
            f"{f'service, {p} partition(s)':22} {median(svc[p]):9.1f} {median(ratios):12.2f} "
            f"{' '.join(f'{x:.1f}' for x in svc[p]):>20}"
        )
    return goals({f"goal service >= {GOAL} x raw on every topic": goal}, f"[{load()}]")


if __name__ == "__main__":
    finish(lambda: asyncio.run(main()))
