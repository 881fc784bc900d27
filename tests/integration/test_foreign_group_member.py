"""A foreign member in the service's consumer group, on the real dev stack (issue 11).

Kafka lets any client join a group by its id: another application configured with the
service's group id by mistake, a client with a different (or broken) assignor, a tool.
When such a member leads a rebalance it decides every member's assignment, and
aiokafka decodes the bytes it is handed outside its error handling: bytes it cannot
decode end its group coordination task for good. From then on every ``getmany()``
raises the same error, the member is gone from the group once its session expires, and
nothing in aiokafka ever joins it again, even after the foreign member has left. Found
by reading aiokafka's coordinator; reproduced here before the fix: the replica stayed
up, never fetched again and held its readiness at "fetching from Kafka fails", which
restarts nothing.

The service now treats an ended coordination as the end of its Kafka clients: it commits
whatever work it still holds (here none: the rejoin revoked its partitions first), says
why (``kafka_client_ended``, /readyz), closes its parts and starts them afresh in
the same process, as a failed start-up is, backing off while the new client's group
coordination keeps ending (``kafka_client_restarting``): the foreign leader is still
there. Once it has left, the replica processes the rest.

The foreign member here is a few lines over aiokafka's protocol classes: it joins with
valid consumer metadata, so the service's leader gives it partitions, heartbeats, and
when it leads a rebalance hands every other member undecodable assignment bytes. It
becomes the leader the only way a test controls: the replica is frozen (SIGSTOP) past
its session timeout, so the foreign member is alone in the group, and resumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import Any

import pytest
from aiokafka.client import AIOKafkaClient, CoordinationType
from aiokafka.coordinator.protocol import ConsumerProtocolMemberMetadata
from aiokafka.protocol.group import (
    HeartbeatRequest,
    JoinGroupRequest,
    LeaveGroupRequest,
    SyncGroupRequest,
)

from tests import e2e
from tests.conftest import DevStack
from tests.integration import test_engine_faults as faults
from tests.integration import test_service_resilience as resilience

pytestmark = pytest.mark.integration

replicas = faults.replicas  # the fixture: replica processes, resumed and stopped at teardown

UNDECODABLE = b"\xff\xff\xff"  # not a ConsumerProtocolMemberAssignment
MEMBER_ID_REQUIRED = 79


class ForeignMember:
    """A group member speaking the consumer protocol by hand (see the module)."""

    def __init__(self, bootstrap: str, group: str, topic: str) -> None:
        self.bootstrap, self.group, self.topic = bootstrap, group, topic
        self.member_id = ""
        self.generation = -1
        self.led: list[int] = []  # generations it led
        self.errors: list[int] = []
        self._client: AIOKafkaClient | None = None
        self._node: Any = None
        self._beat: asyncio.Task[None] | None = None

    async def join(self) -> None:
        self._client = AIOKafkaClient(bootstrap_servers=self.bootstrap)
        await self._client.bootstrap()
        self._node = await self._client.coordinator_lookup(CoordinationType.GROUP, self.group)
        await self._join()
        self._beat = asyncio.create_task(self._heartbeats())

    async def _join(self) -> None:
        assert self._client is not None
        metadata = ConsumerProtocolMemberMetadata(0, [self.topic], b"").encode()
        while True:
            protocols = [("roundrobin", metadata)]
            request = JoinGroupRequest(
                self.group, 6000, 10000, self.member_id, None, "consumer", protocols
            )
            joined = await self._client.send(self._node, request)
            if joined.error_code == MEMBER_ID_REQUIRED:
                self.member_id = joined.member_id
                continue
            assert joined.error_code == 0, joined
            break
        self.member_id, self.generation = joined.member_id, joined.generation_id
        assignments: list[tuple[str, bytes]] = []
        if joined.leader_id == self.member_id:
            self.led.append(self.generation)
            assignments = [
                (m[0], b"" if m[0] == self.member_id else UNDECODABLE) for m in joined.members
            ]
        request = SyncGroupRequest(self.group, self.generation, self.member_id, None, assignments)
        synced = await self._client.send(self._node, request)
        if synced.error_code:
            self.errors.append(synced.error_code)

    async def _heartbeats(self) -> None:
        assert self._client is not None
        while True:
            await asyncio.sleep(0.5)
            request = HeartbeatRequest(self.group, self.generation, self.member_id)
            answer = await self._client.send(self._node, request)
            if answer.error_code:  # a rebalance, or the generation moved on: join again
                self.errors.append(answer.error_code)
                await self._join()

    async def leave(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(BaseException):
                await self._beat
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.send(self._node, LeaveGroupRequest(self.group, self.member_id))
            await self._client.close()


def initial_lists(log: Any) -> list[dict[str, Any]]:
    """The watch caches' initial LISTs (a relist after an expired watch is not one)."""
    return [e for e in e2e.log_events(log, "informer_listed") if e["initial"]]


async def test_a_foreign_leader_ending_the_kafka_client_restarts_it_not_stalls_it(
    devstack: DevStack,
    clean_k8s: Any,
    new_topic: Any,
    replicas: faults.Replicas,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    partitions = resilience.PARTITIONS
    hosts = await faults.seed(clean_k8s, hosts=4, slots_per_host=2, slot_memory="4Ti")
    topics = faults.topics_for(monkeypatch, await resilience.service_topics(new_topic))
    group = f"g-{topics['input']}"
    boot = devstack.kafka_bootstrap
    port = e2e.free_port()
    w = faults.mixed(hosts, 2400, seed=31)
    replicas.spawn(
        "a", topics, CRS_HTTP_PORT=str(port), CRS_RETRY_BACKOFF_S="0.5", CRS_RETRY_BACKOFF_MAX_S="4"
    )
    await faults.wait_group(boot, group, 1, timeout_s=60)
    await e2e.publish(boot, topics["input"], w.records)
    await faults.first_outputs(boot, topics, replicas)

    # What the restarts must keep: the Kubernetes side (no new LIST of the cluster per
    # restart: a foreign member in the group would otherwise make every replica re-read
    # every Reservation every few seconds) and the counters (a restart is not a reset).
    a_log = replicas.log_dir / "a.log"
    listed = len(initial_lists(a_log))
    assert listed, replicas.logs()
    counted = (await e2e.counter_sums(port, "crs_events_total"))["crs_events_total"]
    assert counted > 0

    foreign = ForeignMember(boot, group, topics["input"])
    await foreign.join()
    try:
        await faults.wait_group(boot, group, 2, timeout_s=30)
        a = replicas.procs["a"]
        os.kill(a.pid, signal.SIGSTOP)
        try:  # past the 6 s session: the foreign member is left alone, and leads
            deadline = time.monotonic() + 30
            while not foreign.led:
                assert time.monotonic() < deadline, f"never led, errors {foreign.errors}"
                await asyncio.sleep(0.2)
        finally:
            os.kill(a.pid, signal.SIGCONT)
        # The replica rejoins and the foreign leader hands it undecodable bytes: aiokafka's
        # coordination ends. Before, the replica stayed up without ever fetching again.
        deadline = time.monotonic() + 45
        while not e2e.log_events(a_log, "kafka_client_restarting"):
            if time.monotonic() > deadline:
                failures = len(e2e.log_events(a_log, "fetch_failed"))
                raise AssertionError(
                    f"no restart 45 s after the coordination ended ({failures} fetch_failed)"
                    f"\n{replicas.logs()}"
                )
            replicas.assert_running()
            await asyncio.sleep(0.2)
        # While the foreign leader stays, each fresh client meets it again: restarts back
        # off instead of turning hot, and /readyz names the error most of the time (in
        # between: the fresh client waiting for its assignment, which is ready as any
        # member without partitions is; measured 43 of 48 answers naming it).
        answers: list[tuple[int | None, str]] = []
        until = time.monotonic() + 12
        while time.monotonic() < until:
            answers.append(await e2e.http_get(port, "/readyz"))
            await asyncio.sleep(0.25)
        replicas.assert_running()
        naming = [s for s, b in answers if "Unexpected error during coordination" in b]
        assert set(naming) == {503}, answers
        # A probe may time out on a busy machine; most must be answered all the same.
        answered = [s for s, _ in answers if s is not None]
        assert len(answered) >= len(answers) * 3 / 4, answers
        assert len(naming) > len(answered) / 2, answers
        sums = await e2e.counter_sums(port, "crs_events_total", "crs_kafka_client_restarts_total")
        restarts = len(e2e.log_events(a_log, "kafka_client_restarting"))
        assert 2 <= sums["crs_kafka_client_restarts_total"] <= restarts, (sums, restarts)
        assert sums["crs_events_total"] >= counted, (sums, counted)
        assert len(initial_lists(a_log)) == listed, replicas.logs()
    finally:
        await foreign.leave()
    ended = e2e.log_events(a_log, "kafka_client_ended")
    restarting = e2e.log_events(a_log, "kafka_client_restarting")
    assert ended, replicas.logs()
    assert "Unexpected error during coordination" in ended[0]["error"], ended
    # Backing off, not turning hot: consecutive restarts counted, each delay the
    # start-up's back-off (CRS_RETRY_BACKOFF_S doubling, at most CRS_RETRY_BACKOFF_MAX_S) with equal
    # jitter, so at least half of it.
    assert len(restarting) >= 2, restarting
    assert [e["restarts"] for e in restarting] == list(range(1, len(restarting) + 1))
    for e in restarting:
        full = min(0.5 * 2 ** (e["restarts"] - 1), 4.0)
        assert full / 2 <= e["retry_in_s"] <= full, restarting

    # The same process processes the rest: every input exactly once.
    ends, outputs, dead = await faults.results(boot, topics, partitions, w, replicas, 120)
    codes = replicas.stop_all()
    faults.check_exactly_once(outputs, dead, ends, w, replicas)
    await faults.check_allocations(clean_k8s, w)
    assert await e2e.committed_offsets(boot, group, topics["input"]) == ends
    assert codes == {"a": 0}, replicas.logs()
