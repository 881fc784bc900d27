"""Issue 14: how fast the probes tell the truth, with the default settings.

Run (dev stack up, its env sourced): ``.venv/bin/python bench/bench_health.py``

The service runs as a real process with the defaults (``CRS_READINESS_BOUND_S=30``,
``CRS_METADATA_MAX_AGE_S=15``, JSON logs to a file). Measured, each against the real
dev stack:

1. API server frozen (SIGSTOP, connections half-open): seconds until ``/readyz`` is 503
   and its reason; after SIGCONT, seconds until 200.
2. Kafka broker frozen (SIGSTOP): the same.
3. Kafka broker killed for ``--outage-s`` (48 s, as in the issue), then restarted by
   devstack/up: library (aiokafka) log lines and ERROR lines during the outage.
4. An input topic created after the service started: seconds from its first record to
   that record being processed.

Fails (exit 2, bench/_verdict.py) if a condition does not happen: a probe that never
turns, a topic never consumed, an outage that logs nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import aiohttp
from _common import (
    REPO_DIR,
    create_topics,
    delete_topics,
    devstack_pid,
    devstack_up,
    env_endpoints,
    free_port,
    load,
)
from _verdict import WorkloadError, finish


async def readyz(port: int) -> tuple[int, str]:
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/readyz", timeout=aiohttp.ClientTimeout(5)) as r,
        ):
            return r.status, (await r.json())["detail"]
    except (aiohttp.ClientError, TimeoutError) as exc:
        return 0, type(exc).__name__


async def until(port: int, status: int, timeout_s: float) -> tuple[float, str]:
    start = time.monotonic()
    while True:
        code, detail = await readyz(port)
        if code == status:
            return time.monotonic() - start, detail
        if time.monotonic() - start > timeout_s:
            raise WorkloadError(f"/readyz did not become {status} within {timeout_s}s ({detail})")
        await asyncio.sleep(0.25)


async def freeze(name: str, port: int) -> None:
    pid = devstack_pid(name)
    os.kill(pid, signal.SIGSTOP)
    try:
        took, detail = await until(port, 503, 120)
    finally:
        os.kill(pid, signal.SIGCONT)
    back, _ = await until(port, 200, 120)
    print(f"{name} frozen: /readyz 503 after {took:.1f} s ({detail!r}); 200 again {back:.1f} s "
          "after SIGCONT")  # fmt: skip


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--outage-s", type=float, default=48.0)
    args = parser.parse_args()
    bootstrap, kubeconfig = env_endpoints()
    tag = uuid.uuid4().hex[:8]
    topics = {
        "input": f"health-in-{tag}",
        "output": f"health-out-{tag}",
        "dlq": f"health-dlq-{tag}",
    }
    await create_topics(bootstrap, {topics["output"]: 1, topics["dlq"]: 1})  # input: later
    port = free_port()
    log_path = Path(f"/tmp/bench-health-{tag}.log")
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "KUBECONFIG": kubeconfig,
        "CRS_INPUT_TOPIC": topics["input"],
        "CRS_OUTPUT_TOPIC": topics["output"],
        "CRS_DLQ_TOPIC": topics["dlq"],
        "CRS_GROUP_ID": f"g-{tag}",
        "CRS_HTTP_PORT": str(port),
    }
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "service", "run", cwd=REPO_DIR, env=env, stdout=log, stderr=log
        )
    try:
        await until(port, 200, 60)
        print(load())
        # 4. a topic created after start (the service subscribed to it before it existed)
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic
        from aiokafka.errors import TopicAlreadyExistsError

        await asyncio.sleep(3)
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topics["input"], 1, 1)])
        except TopicAlreadyExistsError:
            pass
        finally:
            await admin.close()
        from aiokafka import AIOKafkaProducer

        producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
        await producer.start()
        await producer.send_and_wait(topics["input"], b"not json", key=b"late")
        await producer.stop()
        published = time.monotonic()
        async with aiohttp.ClientSession() as session:
            while True:
                async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
                    text = await r.text()
                if 'crs_dead_letters_total{code="not_json"} 1.0' in text:
                    break
                if time.monotonic() - published > 120:
                    raise WorkloadError("the topic created after start was never consumed")
                await asyncio.sleep(0.25)
        print(f"topic created after start: its first record processed "
              f"{time.monotonic() - published:.1f} s after it was published")  # fmt: skip

        await freeze("kube-apiserver", port)
        await freeze("kafka", port)

        before = len(log_path.read_text().splitlines())
        os.kill(devstack_pid("kafka"), signal.SIGKILL)
        killed = time.monotonic()
        took, detail = await until(port, 503, 120)
        await asyncio.sleep(max(0.0, args.outage_s - (time.monotonic() - killed)))
        try:
            await devstack_up()
        except RuntimeError as exc:
            raise WorkloadError(str(exc)) from exc
        outage = time.monotonic() - killed
        lines = log_path.read_text().splitlines()[before:]
        library = [x for x in lines if '"logger":"aiokafka' in x]
        errors = [x for x in lines if '"level":"error"' in x]
        repeated = sum(json.loads(x).get("repeated", 0) for x in library)
        if not library:
            raise WorkloadError("the outage logged nothing from the Kafka client")
        print(f"broker killed for {outage:.0f} s: /readyz 503 after {took:.1f} s ({detail!r}); "
              f"{len(lines)} log lines, {len(library)} from aiokafka, {len(errors)} at ERROR; "
              f"{repeated} identical library lines collapsed into those")  # fmt: skip
        back, _ = await until(port, 200, 120)
        print(f"ready again {back:.1f} s after devstack/up returned")
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 60)
        await delete_topics(bootstrap, list(topics.values()))
    print(f"service log: {log_path}")


if __name__ == "__main__":
    finish(lambda: asyncio.run(main()))
