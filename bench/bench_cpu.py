"""Issue 11, benchmark 3: CPU per no-host-found event, service vs. the raw EOS loop.

Run: ``.venv/bin/python bench/bench_cpu.py [--events 20000] [--partitions 4]
[--repetitions 3] [--quick]``

Measured: user + system CPU time (``/proc/<pid>/stat``) of the consuming process per
event, for

* the service (``python -m service run``, defaults: watch mode, exactly-once, batch 500,
  JSON logging at INFO rendered to /dev/null) on no-host-found outcomes of projects
  with an active commitment (all 10 input hosts are queried: the worst case);
* the raw aiokafka EOS pass-through loop (``bench/raw_eos.py``): fetch, one transaction
  per batch, one record produced per record consumed.

Why it is fair: both are separate processes, started, synced and in their group before
the CPU counter is read; the counter is read again when the group has committed every
record, so start-up (imports, the watch cache's initial LIST) is not counted, and the
publisher and the checks run in this process, outside the figure. Same broker, a fresh
topic of ``--partitions`` partitions and a fresh group per run, raw and service
alternating. Complements ``bench_throughput.py`` (in-process, events/s).

Fails (exit 1) when the workload did not happen: an output missing or duplicated, or a
service output that is not a no-host-found classification.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
import uuid

import msgspec
from _common import (
    Cluster,
    OutputReader,
    WorkloadError,
    cpu_seconds,
    create_topics,
    delete_topics,
    env_endpoints,
    free_port,
    load,
    median,
    no_host_found,
    publish,
    raw_eos_args,
    service_config,
    spawn,
    spawn_service,
    stop_process,
    topic_name,
    wait_committed,
    wait_group_stable,
    wait_http_ok,
)
from _verdict import finish, goals

GOAL = 1.5


async def one_run(
    who: str, args: argparse.Namespace, bootstrap: str, kubeconfig: str, rep: int
) -> tuple[float, float]:
    """(CPU µs per event, events/s) of one run."""
    topics = {k: topic_name(f"cpu-{who}-{k}") for k in ("input", "output", "dlq")}
    await create_topics(
        bootstrap, {t: 1 if k == "dlq" else args.partitions for k, t in topics.items()}
    )
    rng = random.Random(args.seed * 1000 + rep)
    records = [no_host_found(rng, args.hypervisors) for _ in range(args.events)]
    reader = OutputReader(bootstrap, topics["output"], args.partitions)
    proc = None
    try:
        if who == "service":
            port = free_port()
            cfg = service_config(bootstrap, kubeconfig, topics, "cpu", CRS_HTTP_PORT=str(port))
            group = cfg.group_id
            proc = spawn_service(cfg, "/dev/null")
            await wait_http_ok(f"http://127.0.0.1:{port}/readyz", 120, proc)
        else:
            group = f"g-raw-{uuid.uuid4().hex[:8]}"
            raw_args = raw_eos_args(bootstrap, topics["input"], topics["output"], group)
            proc = spawn(raw_args, None, "/dev/null")
        await wait_group_stable(bootstrap, group, 1, 60)
        await asyncio.sleep(1.0)  # let start-up work (first lag update, GC) settle
        cpu0, t0 = cpu_seconds(proc.pid), time.perf_counter()
        await publish(bootstrap, topics["input"], records)
        end = await wait_committed(
            bootstrap, group, topics["input"], len(records), timeout_s=600, proc=proc
        )
        cpu = cpu_seconds(proc.pid) - cpu0
        await reader.start()
        keys = [r[0] for r in records if r[0] is not None]
        if not await reader.wait_for(keys, timeout_s=60):
            raise WorkloadError(f"{who}: {len(set(keys) - set(reader.seen))} outputs missing")
        await asyncio.sleep(0.5)
        if reader.count != len(records):
            raise WorkloadError(f"{who}: {reader.count} outputs for {len(records)} inputs")
        if who == "service":
            # The worst case: an active CR, so every input host was looked at.
            data = [msgspec.json.decode(v)["data"] for v in reader.values]
            kinds = {(d["kind"], d["cr_slot"]) for d in data}
            worst = {("no_host_found", "slot_exhausted"), ("no_host_found", "slot_blocked")}
            if not kinds <= worst:
                raise WorkloadError(f"service classified the stream as {kinds}")
        return cpu / len(records) * 1e6, len(records) / (end - t0)
    finally:
        await reader.stop()
        if proc is not None:
            stop_process(proc)
        await delete_topics(bootstrap, list(topics.values()))


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--hypervisors", type=int, default=500)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="5,000 events, 1 repetition")
    args = ap.parse_args()
    if args.quick:
        args.events, args.repetitions = 5000, 1
    bootstrap, kubeconfig = env_endpoints()
    async with Cluster.connect(kubeconfig) as cluster:
        print(await cluster.ensure(args.hypervisors))
    raw: list[float] = []
    svc: list[float] = []
    for rep in range(args.repetitions):  # a WorkloadError ends the run (finish: exit 2)
        for who, into in (("raw", raw), ("service", svc)):
            cpu, rate = await one_run(who, args, bootstrap, kubeconfig, rep)
            into.append(cpu)
            print(
                f"  rep {rep}: {who:8} {cpu:6.0f} CPU µs/event  ({rate:6.0f} events/s)"
                f"   [{load()}]",
                flush=True,
            )
    ratios = [s / r for s, r in zip(svc, raw, strict=True)]
    print()
    print(f"{args.events} no-host-found events, {args.partitions} partitions; CPU µs per event")
    print(f"{'':8} {'raw EOS loop':>13} {'service':>8} {'service/raw':>12}")
    print(f"{'median':8} {median(raw):13.0f} {median(svc):8.0f} {median(ratios):12.2f}")
    print(
        f"runs: raw {' '.join(f'{x:.0f}' for x in raw)}; service "
        f"{' '.join(f'{x:.0f}' for x in svc)}; ratio {' '.join(f'{x:.2f}' for x in ratios)}"
    )
    return goals({f"goal service <= {GOAL} x raw CPU per event": median(ratios) <= GOAL}, load())


if __name__ == "__main__":
    finish(lambda: asyncio.run(main()))
