"""What a broker outage costs the service, per transactional retry back-off (issue 11).

Run: ``.venv/bin/python bench/bench_outage.py [--backoffs 10,5,2] [--down-s 20]`` on the
dev stack only: it SIGKILLs the dev stack's Kafka (``kafka.pid`` in
``$CRS_DEVSTACK_RUN_DIR``, default ``devstack/run``) and brings it back with
``devstack/up``. Nothing else may use the broker meanwhile.

Measured, for each ``CRS_TXN_RETRY_BACKOFF_MS``: the service (its own process, 4 input
partitions, so 4 transactional producers, idle and ready) has its broker killed; its CPU
(cores, ``/proc``) and the lines it logs while the broker is down for ``--down-s``, then
from the restart until it is ready again plus 10 s (the broker loading its coordinators).
The back-off is aiokafka's pace for every retry of those producers, so this is where a
short one could cost something.

Fails (exit 1) when the workload did not happen: the broker still accepting connections
after the kill, the service not ready within 120 s of the restart, or the 20
no-host-found events published after the recovery not all classified.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import time
from pathlib import Path

from _common import (
    OutputReader,
    WorkloadError,
    cpu_seconds,
    create_topics,
    delete_topics,
    devstack_pid,
    devstack_up,
    env_endpoints,
    free_port,
    load,
    no_host_found,
    publish,
    service_config,
    spawn_service,
    stop_process,
    topic_name,
    wait_group_stable,
    wait_http_ok,
)
from _verdict import finish


def accepts(bootstrap: str) -> bool:
    host, port = bootstrap.split(",")[0].rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except OSError:
        return False


def lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


async def one(backoff_ms: int, down_s: float) -> str:
    bootstrap, kubeconfig = env_endpoints()
    topics = {k: topic_name(f"outage-{k}") for k in ("input", "output", "dlq")}
    await create_topics(bootstrap, {t: 1 if k == "dlq" else 4 for k, t in topics.items()})
    port = free_port()
    cfg = service_config(
        bootstrap,
        kubeconfig,
        topics,
        "outage",
        CRS_HTTP_PORT=str(port),
        CRS_TXN_RETRY_BACKOFF_MS=str(backoff_ms),
    )
    log = f"/tmp/crs-bench-outage-{backoff_ms}.log"
    Path(log).write_bytes(b"")
    proc = spawn_service(cfg, log)
    try:
        await wait_http_ok(f"http://127.0.0.1:{port}/readyz", 120, proc)
        await wait_group_stable(bootstrap, cfg.group_id, 1, 60)
        await asyncio.sleep(3)  # every partition taken over, its producer started
        os.kill(devstack_pid("kafka"), signal.SIGKILL)
        await asyncio.sleep(0.5)
        if accepts(bootstrap):
            raise WorkloadError("the broker still accepts connections after SIGKILL")
        n0, c0, t0 = lines(log), cpu_seconds(proc.pid), time.monotonic()
        await asyncio.sleep(down_s)
        n1, c1, t1 = lines(log), cpu_seconds(proc.pid), time.monotonic()
        try:
            await devstack_up()
        except RuntimeError as exc:
            raise WorkloadError(str(exc)) from exc
        try:
            await wait_http_ok(f"http://127.0.0.1:{port}/readyz", 120, proc)
        except RuntimeError as exc:
            raise WorkloadError(f"not ready again after the restart: {exc}") from exc
        await asyncio.sleep(10)
        n2, c2, t2 = lines(log), cpu_seconds(proc.pid), time.monotonic()
        rng = random.Random(backoff_ms)
        records = [no_host_found(rng, 500) for _ in range(20)]
        reader = OutputReader(bootstrap, topics["output"], 4)
        await reader.start()
        try:
            await publish(bootstrap, topics["input"], records)
            if not await reader.wait_for([r[0] for r in records if r[0]], timeout_s=60):
                raise WorkloadError("events published after the recovery not all classified")
        finally:
            await reader.stop()
        return (
            f"{backoff_ms:>10} | {(c1 - c0) / (t1 - t0):10.3f} {n1 - n0:6d} | "
            f"{(c2 - c1) / (t2 - t1):10.3f} {n2 - n1:6d} {t2 - t1:5.0f} s   [{load()}]"
        )
    finally:
        stop_process(proc)
        if accepts(bootstrap):
            await delete_topics(bootstrap, list(topics.values()))


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backoffs", default="10,5,2")
    ap.add_argument("--down-s", type=float, default=20.0)
    args = ap.parse_args()
    print(f"broker SIGKILLed for {args.down_s:g} s, then restarted; service idle, 4 partitions")
    print(
        f"{'backoff ms':>10} | {'down cores':>10} {'lines':>6} | "
        f"{'recovery':>10} {'lines':>6} {'over':>7}"
    )
    for backoff in (int(b) for b in args.backoffs.split(",")):  # WorkloadError: exit 2
        print(await one(backoff, args.down_s), flush=True)
    return 0


if __name__ == "__main__":
    finish(lambda: asyncio.run(main()))
