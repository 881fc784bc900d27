"""The broker frozen under a running replica, on the real dev stack (issue 11).

SIGSTOP keeps the broker's connections open and silent, the failure no client notices
by itself. aiokafka shields the EndTxn of a transaction being committed, so a commit the
service gave up on (its own timeout, the shutdown budget) may still land once the broker
resumes: the engine must neither commit those outputs a second time nor lose or double
their counts.

* SIGTERM while the broker is frozen: the stop's commits hang until the shutdown budget
  (``CRS_SHUTDOWN_TIMEOUT_S``) cuts them short, and the process still ends within it (a
  pod's terminationGracePeriodSeconds). The broker resumes while the replica is still
  closing, so anything it would commit a second time could reach the broker. A second
  replica then takes the rest over: every input exactly once across output and
  dead-letter topics (read_committed), no VM in two slots.
* A freeze longer than ``CRS_COMMIT_TIMEOUT_S`` mid-stream: the commits in flight time
  out, whether they land or not is up to the broker; every input exactly once, and the
  replica's counters count each classified event and dead letter exactly once. (A
  commit that timed out lands when the broker reads its EndTxn before the re-acquiring
  producer's InitProducerId: in 3 of 4 runs here, log event ``commit_found_landed``;
  the engine that did not count those failed this test in 2 of 6 runs, 114 and 148
  events uncounted.)

The unit tests in ``tests/unit/engine/`` (a commit cut short is never committed
again; close() leaves the group after its commit is cut short; a commit that timed out
but landed is counted on take-over) cover the same paths with a fake consumer; these are
their end-to-end counterparts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from typing import Any

import pytest
from aiokafka.admin import NewPartitions

from tests import e2e
from tests.conftest import DevStack
from tests.integration import test_engine_faults as faults
from tests.integration import test_service_resilience as resilience

pytestmark = pytest.mark.integration

SHUTDOWN_S = 8.0
# What the deployment's terminationGracePeriodSeconds adds to CRS_SHUTDOWN_TIMEOUT_S for
# the clean-up after the budget (tests/unit/test_packaging.py requires it).
GRACE_MARGIN_S = 25.0

replicas = faults.replicas  # the fixture: replica processes, resumed and stopped at teardown


async def backlog_under_way(
    devstack: DevStack,
    api: Any,
    new_topic: Any,
    replicas: faults.Replicas,
    monkeypatch: pytest.MonkeyPatch,
    seed: int,
    **settings: str,
) -> tuple[dict[str, str], faults.Workload]:
    """Replica "a" (``settings``) working through a backlog of 2,400 mixed events; returns
    (topics, workload) once 300 outputs are committed."""
    hosts = await faults.seed(api, hosts=8, slots_per_host=1, slot_memory="4Ti")
    topics = faults.topics_for(monkeypatch, await resilience.service_topics(new_topic))
    w = faults.mixed(hosts, 2400, seed=seed)
    boot = devstack.kafka_bootstrap
    replicas.spawn("a", topics, **settings)
    await faults.wait_group(boot, f"g-{topics['input']}", 1, timeout_s=60)
    await e2e.publish(boot, topics["input"], w.records)

    await faults.first_outputs(boot, topics, replicas)
    return topics, w


async def sigterm_with_the_broker_frozen(
    devstack: DevStack, replicas: faults.Replicas, *, resume_when_logged: str | None
) -> float:
    """SIGTERM replica "a" with the broker frozen; the broker resumes once "a" has logged
    ``resume_when_logged`` (None: once "a" has ended, or gave up waiting for it). Seconds
    until "a" ended."""
    broker = int((devstack.run_dir / "kafka.pid").read_text())
    a = replicas.procs["a"]
    log = replicas.log_dir / "a.log"
    os.kill(broker, signal.SIGSTOP)
    try:
        a.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        if resume_when_logged is not None:
            # Resumed on the replica's own word, not on a timer: a signal handled late on
            # a busy machine moved the budget's cut past a timer's resume.
            deadline = signalled + SHUTDOWN_S + GRACE_MARGIN_S
            while not e2e.log_events(log, resume_when_logged):
                assert a.poll() is None, f"ended without {resume_when_logged}"
                assert time.monotonic() < deadline, f"never logged {resume_when_logged}"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # into the clean-up that follows
        else:
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(a.wait, SHUTDOWN_S + GRACE_MARGIN_S + 10)
    finally:
        os.kill(broker, signal.SIGCONT)
    if resume_when_logged is not None:
        a.wait(timeout=SHUTDOWN_S + 20)
    return time.monotonic() - signalled


async def the_second_replica_finishes_exactly_once(
    devstack: DevStack,
    clean_k8s: Any,
    replicas: faults.Replicas,
    topics: dict[str, str],
    w: faults.Workload,
) -> None:
    """Replica "b" takes the rest over: every input once across output and dead letters,
    no VM in two slots, the group's offsets at the ends."""
    boot = devstack.kafka_bootstrap
    replicas.spawn("b", topics)
    partitions = resilience.PARTITIONS
    ends, outputs, dead = await faults.results(boot, topics, partitions, w, replicas, 120)
    codes = replicas.stop_all()
    faults.check_exactly_once(outputs, dead, ends, w, replicas)
    await faults.check_allocations(clean_k8s, w)
    assert await e2e.committed_offsets(boot, f"g-{topics['input']}", topics["input"]) == ends
    assert codes["b"] == 0, f"exit codes {codes}\n{replicas.logs()}"


async def test_sigterm_with_the_broker_frozen_mid_commit_ends_in_budget_and_commits_nothing_twice(
    devstack: DevStack,
    clean_k8s: Any,
    new_topic: Any,
    replicas: faults.Replicas,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topics, w = await backlog_under_way(
        devstack,
        clean_k8s,
        new_topic,
        replicas,
        monkeypatch,
        21,
        CRS_SHUTDOWN_TIMEOUT_S=str(SHUTDOWN_S),
    )
    # runtime.py gives the consume loop 70 % of the budget to finish and commit, then
    # cancels it (the commit cut short) and closes the clients in what is left. The
    # broker resumes after that cut, while the replica is still closing its clients.
    took = await sigterm_with_the_broker_frozen(
        devstack, replicas, resume_when_logged="shutdown_abandoning_in_flight_work"
    )
    code = replicas.procs["a"].returncode
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
    await the_second_replica_finishes_exactly_once(devstack, clean_k8s, replicas, topics, w)


async def test_sigterm_with_the_broker_frozen_throughout_ends_within_the_grace_period(
    devstack: DevStack,
    clean_k8s: Any,
    new_topic: Any,
    replicas: faults.Replicas,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worst case of a stop: the broker never answers again while the replica stops.
    Past the budget every close step (producers, LeaveGroup, the consumer) waits out its
    own bound; the kubelet kills the pod at the grace period, so the process must have
    ended by then, with nothing committed twice by the next owner."""
    topics, w = await backlog_under_way(
        devstack,
        clean_k8s,
        new_topic,
        replicas,
        monkeypatch,
        23,
        CRS_SHUTDOWN_TIMEOUT_S=str(SHUTDOWN_S),
    )
    a = replicas.procs["a"]
    took = await sigterm_with_the_broker_frozen(devstack, replicas, resume_when_logged=None)
    log = (replicas.log_dir / "a.log").read_text(errors="replace")
    assert a.poll() is not None, f"still running {took:.1f} s after SIGTERM\n{log[-3000:]}"
    assert "shutdown_abandoning_in_flight_work" in log, log[-3000:]  # the budget ran out
    print(f"stopped {took:.1f} s after SIGTERM with the broker frozen (budget {SHUTDOWN_S} s)")
    assert took <= SHUTDOWN_S + GRACE_MARGIN_S, f"stopped after {took:.1f} s\n{log[-3000:]}"
    assert a.returncode == 0, f"exit code {a.returncode}\n{log[-3000:]}"
    del replicas.procs["a"]
    await the_second_replica_finishes_exactly_once(devstack, clean_k8s, replicas, topics, w)


@pytest.mark.parametrize("then", ["taken over", "rebalanced"])
async def test_a_freeze_past_the_commit_timeout_counts_and_commits_each_event_once(
    devstack: DevStack,
    clean_k8s: Any,
    new_topic: Any,
    replicas: faults.Replicas,
    monkeypatch: pytest.MonkeyPatch,
    then: str,
) -> None:
    """Commits cut short by CRS_COMMIT_TIMEOUT_S while the broker is frozen may land all
    the same; each such partition is taken over again after a back-off ("taken over"),
    or first revoked and given back by a rebalance ("rebalanced": the input topic grows
    a partition right after the freeze, the back-off is 10 s). Either way each event is
    committed once and counted once."""
    partitions = resilience.PARTITIONS
    port = e2e.free_port()
    rebalanced = then == "rebalanced"
    extra = {"CRS_RETRY_BACKOFF_S": "10", "CRS_RETRY_BACKOFF_MAX_S": "10"} if rebalanced else {}
    extra |= {"CRS_METADATA_MAX_AGE_S": "1"} if rebalanced else {}
    # A session far longer than the freeze: the replica must stay the partitions' owner,
    # so that its own take-overs find what its timed-out commits did.
    topics, w = await backlog_under_way(
        devstack,
        clean_k8s,
        new_topic,
        replicas,
        monkeypatch,
        22,
        CRS_COMMIT_TIMEOUT_S="2",
        CRS_HTTP_PORT=str(port),
        CRS_SESSION_TIMEOUT_MS="30000",
        **extra,
    )
    boot = devstack.kafka_bootstrap
    broker = int((devstack.run_dir / "kafka.pid").read_text())
    os.kill(broker, signal.SIGSTOP)
    try:
        await asyncio.sleep(5.0)  # past the commit timeout, inside the session timeout
    finally:
        os.kill(broker, signal.SIGCONT)
    if rebalanced:
        admin = await faults.admin_client(boot)
        try:
            await admin.create_partitions({topics["input"]: NewPartitions(partitions + 1)})
        finally:
            await admin.close()
    ends, outputs, dead = await faults.results(boot, topics, partitions, w, replicas, 120)
    log = (replicas.log_dir / "a.log").read_text(errors="replace")
    # The workload did what the test is about: commits timed out during the freeze.
    timed_out = [x for x in log.splitlines() if "commit_failed" in x and "TimeoutError" in x]
    assert timed_out, log[-3000:]
    placements = sum(1 for r in outputs if e2e.data_of(r)["kind"] == "placement")
    expected = {
        "crs_events_total": len(outputs),
        "crs_dead_letters_total": len(dead),
        "cortex_nova_placement_total": placements,
    }
    # A landed commit is counted when its partition is taken over again, a back-off
    # after the broker answered: wait for the counters, not only for the offsets.
    deadline = time.monotonic() + 30
    while (counted := await e2e.counter_sums(port, *expected)) != expected:
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    log = (replicas.log_dir / "a.log").read_text(errors="replace")
    codes = replicas.stop_all()
    faults.check_exactly_once(outputs, dead, ends, w, replicas)
    await faults.check_allocations(clean_k8s, w)
    landed = log.count("commit_found_landed")
    assert counted == expected, f"landed after a timeout: {landed}"
    if rebalanced:  # the workload did what the variant is about: a revoke of everything
        events = [json.loads(x) for x in log.splitlines() if x.startswith("{")]
        revokes = [e for e in events if e.get("event") == "partitions_revoking"]
        assert any(len(e["partitions"]) == partitions for e in revokes), revokes
    print(f"{then}: {len(timed_out)} commits timed out, {landed} found landed")
    assert codes == {"a": 0}, replicas.logs()


def _revokes(replicas: faults.Replicas, name: str) -> int:
    text = (replicas.log_dir / f"{name}.log").read_text(errors="replace")
    return text.count('"event":"partitions_revoking"')


async def test_a_broker_outage_during_a_rebalance_is_no_reason_to_restart(
    devstack: DevStack,
    clean_k8s: Any,
    new_topic: Any,
    replicas: faults.Replicas,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """aiokafka's getmany() waits for the new assignment without limit once a rebalance
    has begun: a broker gone at that moment held the consume loop for the whole outage,
    and /healthz ("the loop has not turned for CRS_LIVENESS_BOUND_S") had the pod
    restarted, though the process was only waiting, as it rightly does outside a
    rebalance (found by review). A third member, frozen, holds the rebalance open for
    its session timeout, so the broker can be frozen inside it."""
    await faults.seed(clean_k8s, hosts=2, slots_per_host=1, slot_memory="4Ti")
    topics = faults.topics_for(monkeypatch, await resilience.service_topics(new_topic))
    group = f"g-{topics['input']}"
    boot = devstack.kafka_bootstrap
    port = e2e.free_port()
    bound = 15.0
    replicas.spawn(
        "a",
        topics,
        CRS_HTTP_PORT=str(port),
        CRS_LIVENESS_BOUND_S=str(bound),
        CRS_RETRY_BACKOFF_MAX_S="1",
    )
    await faults.wait_group(boot, group, 1, timeout_s=60)
    # A session long enough to outlast b's start-up and the whole freeze: with the usual
    # 6 s, c could be evicted before b joined, the rebalance would then end at once and
    # the broker be frozen outside it.
    replicas.spawn("c", topics, CRS_SESSION_TIMEOUT_MS="90000")
    await faults.wait_group(boot, group, 2, timeout_s=60)
    assert (await e2e.http_get(port, "/healthz"))[0] == 200
    os.kill(replicas.procs["c"].pid, signal.SIGSTOP)  # holds the next rebalance open
    before = _revokes(replicas, "a")
    replicas.spawn("b", topics)
    deadline = time.monotonic() + 30
    while _revokes(replicas, "a") == before:
        assert time.monotonic() < deadline, replicas.logs()
        await asyncio.sleep(0.05)
    broker = int((devstack.run_dir / "kafka.pid").read_text())
    os.kill(broker, signal.SIGSTOP)
    seen: list[int | None] = []
    bodies: list[str] = []
    try:
        frozen_until = time.monotonic() + bound + 15
        while time.monotonic() < frozen_until:
            status, body = await e2e.http_get(port, "/healthz")
            seen.append(status)
            bodies.append(body)
            await asyncio.sleep(0.5)
    finally:
        os.kill(broker, signal.SIGCONT)
    os.kill(replicas.procs["c"].pid, signal.SIGCONT)
    assert 503 not in seen, f"/healthz during the outage: {seen}\n{replicas.logs()}"
    assert seen.count(200) >= len(seen) - 2, seen  # (a probe may time out on a busy host)
    # The workload did what the test is about: the loop sat in the group wait past the bound.
    assert any("waiting for the Kafka group" in b for b in bodies), (bodies[-3:], seen)
    # And the replica comes back by itself: the group settles, /readyz is OK again.
    await faults.wait_group(boot, group, 3, timeout_s=120)
    deadline = time.monotonic() + 60
    while (await e2e.http_get(port, "/readyz"))[0] != 200:
        assert time.monotonic() < deadline, replicas.logs()
        await asyncio.sleep(0.5)
    assert (await e2e.http_get(port, "/healthz"))[0] == 200
    replicas.assert_running()
