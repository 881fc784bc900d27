"""Issue 7, benchmark 4: peak RSS of the service process with a large cluster cached.

Run: ``.venv/bin/python bench/bench_memory.py [--hypervisors 10000] [--events 5000]
[--repetitions 3]``

Measured: the service as a real process (``python -m service run``, configured by
environment variables only: watch mode, exactly-once, JSON logs at INFO to a file),
with 10,000 hypervisors, 50,000 reservations and 1,001 CommittedResources in the API
server. ``VmRSS`` once ``/readyz`` answers 200 (the watch cache has synced), then a
stream of ``--events`` outcomes (60 % no-host-found, 35 % slot_missed, 5 % slot_used
patches) is published and, once ``/metrics`` counts them all, ``VmHWM`` (the peak RSS
over the process's life, from /proc/<pid>/status) and ``VmRSS`` again. A fresh
process per repetition; the report gives the median and the maximum (goal <= 600 MB).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from _common import (
    Cluster,
    Record,
    check_mix,
    create_topics,
    delete_topics,
    env_endpoints,
    load,
    median,
    no_host_found,
    outcomes,
    publish,
    service_config,
    slot_missed,
    slot_used,
    topic_name,
)
from _verdict import finish, goals

REPO = Path(__file__).resolve().parents[1]
MB = 1024 * 1024


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def scrape_processed(session: aiohttp.ClientSession, base: str) -> float:
    async with session.get(f"{base}/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("crs_events_total{", "crs_dead_letters_total{")):
            total += float(line.rsplit(" ", 1)[1])
    return total


# The stream of :func:`stream`: the RSS is only a figure for this one (a stream the
# service dead-letters never reaches the cache, the classifier or a patch).
MIX = {
    "no_host_found/slot_exhausted|no_host_found/slot_blocked": 0.6,
    "placement/slot_missed": 0.35,
    "placement/slot_used": 0.05,
}


def stream(rng: random.Random, n_hv: int, n: int) -> list[Record]:
    out = []
    for _ in range(n):
        x = rng.random()
        if x < 0.6:
            out.append(no_host_found(rng, n_hv, 20))
        elif x < 0.95:
            out.append(slot_missed(rng, n_hv, 20))
        else:
            out.append(slot_used(rng, rng.randrange(n_hv), n_hv))
    return out


async def one_run(
    bootstrap: str, kubeconfig: str, args: argparse.Namespace, rep: int
) -> dict[str, float]:
    topics = {k: topic_name(f"mem-{k}") for k in ("input", "output", "dlq")}
    await create_topics(bootstrap, {t: 4 if k == "input" else 1 for k, t in topics.items()})
    port = free_port()
    cfg = service_config(bootstrap, kubeconfig, topics, "mem", CRS_HTTP_PORT=str(port))
    env = {**os.environ, **cfg.to_env()}
    log_path = f"/tmp/crs-bench-memory-{rep}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(  # noqa: ASYNC220 (started once, not on a hot path)
            [sys.executable, "-m", "service", "run"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        async with aiohttp.ClientSession() as session:
            while True:
                assert proc.poll() is None, f"service exited; see {log_path}"
                assert time.monotonic() - started < 600, "not ready after 600 s"
                try:
                    async with session.get(f"{base}/readyz") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.5)
            ready_s = time.monotonic() - started
            synced = proc_status(proc.pid)
            records = stream(random.Random(args.seed + rep), args.hypervisors, args.events)
            await publish(bootstrap, topics["input"], records)
            while await scrape_processed(session, base) < len(records):
                assert proc.poll() is None, f"service exited; see {log_path}"
                assert time.monotonic() - started < 1200, "stream not processed"
                await asyncio.sleep(0.5)
            after = proc_status(proc.pid)
            async with session.get(f"{base}/metrics") as resp:
                check_mix(outcomes(await resp.text()), len(records), MIX)
        return {
            "ready_s": ready_s,
            "rss_synced": synced["VmRSS"] / MB,
            "rss_after": after["VmRSS"] / MB,
            "hwm": after["VmHWM"] / MB,
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        await delete_topics(bootstrap, list(topics.values()))


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hypervisors", type=int, default=10_000)
    ap.add_argument("--events", type=int, default=5000)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--seed", type=int, default=4)
    args = ap.parse_args()
    bootstrap, kubeconfig = env_endpoints()
    async with Cluster.connect(kubeconfig) as cluster:
        print(await cluster.ensure(args.hypervisors), flush=True)
        runs = []
        for rep in range(args.repetitions):
            r = await one_run(bootstrap, kubeconfig, args, rep)
            runs.append(r)
            print(
                f"  rep {rep}: ready in {r['ready_s']:.1f}s, RSS synced {r['rss_synced']:.0f} MB,"
                f" after stream {r['rss_after']:.0f} MB, peak (VmHWM) {r['hwm']:.0f} MB"
                f"   [{load()}]",
                flush=True,
            )
        await cluster.clear_allocations(f"res-{h:05d}-0" for h in range(args.hypervisors))
    print()
    print(f"{'':8} {'ready s':>8} {'RSS synced MB':>14} {'RSS after MB':>13} {'VmHWM MB':>9}")
    for label, agg in (("median", median), ("max", max)):
        print(
            f"{label:8} {agg(r['ready_s'] for r in runs):8.1f} "
            f"{agg(r['rss_synced'] for r in runs):14.0f} "
            f"{agg(r['rss_after'] for r in runs):13.0f} {agg(r['hwm'] for r in runs):9.0f}"
        )
    return goals({"goal peak RSS <= 600 MB": max(r["hwm"] for r in runs) <= 600}, f"[{load()}]")


if __name__ == "__main__":
    finish(lambda: asyncio.run(main()))
