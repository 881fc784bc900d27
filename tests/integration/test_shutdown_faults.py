"""A graceful stop meeting a broker in trouble, on the real dev stack (issue 11).

SIGTERM reaches a replica while the broker is frozen (SIGSTOP: its connections stay
open and silent), so the commits of the stop hang until the shutdown budget
(``CRS_SHUTDOWN_TIMEOUT_S``) cuts them short. aiokafka shields the EndTxn of a
transaction being committed, so such a commit may still land once the broker resumes;
the engine must then commit none of those outputs again, and the process must still end
within its budget (a pod's terminationGracePeriodSeconds). The broker resumes while the
replica is still closing, so anything it would commit a second time could reach the
broker. A second replica then takes the rest over: every input exactly once across
output and dead-letter topics (read_committed), no VM in two slots.

The unit tests in ``tests/unit/test_engine.py`` (a commit cut short is never committed
again; close() leaves the group after its commit is cut short) cover the same paths
with a fake consumer; this is their end-to-end counterpart.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest

from tests import e2e
from tests.conftest import DevStack
from tests.integration import test_engine_faults as faults
from tests.integration import test_service_resilience as resilience

pytestmark = pytest.mark.integration

SHUTDOWN_S = 8.0
# runtime.py: the consume loop gets 70 % of the budget to finish and commit; past that
# it is cancelled (the commit cut short) and the clients are closed in what is left.
CUT_AT_S = SHUTDOWN_S * 0.7

replicas = faults.replicas  # the fixture: replica processes, resumed and stopped at teardown


async def test_sigterm_with_the_broker_frozen_mid_commit_ends_in_budget_and_commits_nothing_twice(
    devstack: DevStack,
    clean_k8s: Any,
    new_topic: Any,
    replicas: faults.Replicas,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    partitions = resilience.PARTITIONS
    hosts = await faults.seed(clean_k8s, hosts=8, slots_per_host=1, slot_memory="4Ti")
    topics = faults.topics_for(monkeypatch, await resilience.service_topics(new_topic))
    w = faults.mixed(hosts, 2400, seed=21)
    group = f"g-{topics['input']}"
    boot = devstack.kafka_bootstrap
    replicas.spawn("a", topics, CRS_SHUTDOWN_TIMEOUT_S=str(SHUTDOWN_S))
    await faults.wait_group(boot, group, 1, timeout_s=60)
    await e2e.publish(boot, topics["input"], w.records)

    async def partway() -> bool:
        replicas.assert_running()
        return await resilience.count_committed(boot, topics["output"]) >= 300

    await resilience.wait_for(partway, 60, "the first outputs")
    broker = int((devstack.run_dir / "kafka.pid").read_text())
    a = replicas.procs["a"]
    os.kill(broker, signal.SIGSTOP)
    try:
        a.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        # Resumed after the budget has cut the stop's commits short, while the replica
        # is still closing its clients (the rest of the budget).
        await asyncio.sleep(CUT_AT_S + 0.8)
    finally:
        os.kill(broker, signal.SIGCONT)
    code = a.wait(timeout=SHUTDOWN_S + 20)
    took = time.monotonic() - signalled
    log = (replicas.log_dir / "a.log").read_text(errors="replace")
    # The workload did what the test is about: the stop's commit was cut short.
    assert "shutdown_abandoning_in_flight_work" in log, (
        f"the stop's commit was not cut short by the budget\n{log[-3000:]}"
    )
    # The budget plus the one bounded wait the runtime gives a cancelled loop to end (2 s)
    # and a second of scheduling on a busy machine.
    assert took <= SHUTDOWN_S + 3.0, f"stopped {took:.1f} s after SIGTERM\n{log[-3000:]}"
    assert code == 0, f"exit code {code}\n{log[-3000:]}"
    del replicas.procs["a"]  # ended as it should: no longer one of the running replicas

    replicas.spawn("b", topics)
    ends = await faults.wait_all_committed(boot, group, topics["input"], partitions, 120, replicas)
    outputs = await e2e.read_all(
        boot, topics["output"], len(w.records) - w.poison, partitions=partitions, timeout_s=30
    )
    dead = await e2e.read_all(boot, topics["dlq"], w.poison, timeout_s=15)
    codes = replicas.stop_all()
    faults.check_exactly_once(outputs, dead, ends, w)
    await faults.check_allocations(clean_k8s, w)
    assert await faults.committed_offsets(boot, group, topics["input"]) == ends
    assert codes["b"] == 0, f"exit codes {codes}\n{replicas.logs()}"
