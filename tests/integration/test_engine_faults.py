"""Acceptance of the stream engine under faults (issue 11), on the real dev stack.

Replicas run as separate OS processes (``python -m service run``) and are frozen with
SIGSTOP, the way a GC pause, CPU starvation or a VM freeze stops a process while its
sockets stay open. What they produced is read back with a ``read_committed`` reader and
the group's committed offsets, never taken from the service's own counters.

Settings the tests assume the engine honours (passed as environment variables to every
replica; an engine that ignores them runs with its defaults):

* ``CRS_SESSION_TIMEOUT_MS`` (6000: the broker's minimum), so a frozen replica is
  evicted quickly. The frozen-replica test does not depend on the value: it holds the
  replica stopped until the group has evicted it.
* ``CRS_TRANSACTIONAL_ID_PREFIX``, the same for every replica of a group, as in a
  Deployment: fencing must come from what the replicas share (partition-bound ids).

The input is a mix of the three kinds of event that matter to the engine: no-host-found
outcomes and placements of a project without commitment (both decided from the watch
cache, no API call) and ``slot_used`` placements (one guarded PATCH each), plus a few
poison records for the dead-letter topic.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord, TopicPartition

from service.quantity import parse_quantity
from tests import e2e
from tests import factories as f
from tests.conftest import DevStack
from tests.integration import test_service_resilience as resilience

pytestmark = pytest.mark.integration

GiB = 1024**3
VM_BYTES = 4 * GiB  # m1.small in flavor group g1
NO_CR_PROJECT = "p-none"  # has no CommittedResource: placements are no_cr, no API call

NO_HOST_FOUND = "no_host_found"
NO_CR = "no_cr_placement"
SLOT_USED = "slot_used_placement"
NEEDS_NO_API = (NO_HOST_FOUND, NO_CR)


# --------------------------------------------------------------------------- cluster


async def seed(api: Any, *, hosts: int, slots_per_host: int, slot_memory: str) -> list[str]:
    """Hosts with ``slots_per_host`` p1 slots each; p1 has a large active commitment."""
    names = [f"hv-{i}" for i in range(hosts)]
    for name in names:
        await f.create(api, f.hypervisor(name, memory="8Ti"))
        for s in range(slots_per_host):
            await f.create(api, f.reservation(f"slot-{name}-{s}", host=name, memory=slot_memory))
    await f.create(api, f.knowledge([f.flavor_group("g1", [f.flavor("m1.small", 4096, 2)])]))
    await f.create(api, f.committed_resource("cr-p1", project="p1", amount="1000Ti", used="0"))
    return names


async def reservations(api: Any) -> dict[str, dict[str, Any]]:
    from kubernetes_asyncio import client

    listed = await client.CustomObjectsApi(api).list_cluster_custom_object(*f.RES)
    return {item["metadata"]["name"]: item for item in listed["items"]}


# --------------------------------------------------------------------------- events


@dataclass
class Workload:
    records: list[Any] = field(default_factory=list)
    kind_of: dict[str, str] = field(default_factory=dict)  # instance uuid -> kind of event
    poison: int = 0

    def add(self, kind: str, hosts: list[str], rng: random.Random) -> None:
        target = rng.choice(hosts)
        others = [target, *rng.sample(hosts, min(2, len(hosts)))]
        if kind == NO_HOST_FOUND:
            vm, decision, request = e2e.outcome(None, others)
        elif kind == NO_CR:
            vm, decision, request = e2e.outcome(target, others, project=NO_CR_PROJECT)
        else:
            vm, decision, request = e2e.outcome(target, [target])
        self.records.append(e2e.good_record(vm, decision, request))
        self.kind_of[vm] = kind

    def add_poison(self, rng: random.Random) -> None:
        self.records.append((f"poison-{rng.random()}".encode(), b"{not json", []))
        self.poison += 1


def mixed(hosts: list[str], n: int, seed: int, *, poison_every: int = 100) -> Workload:
    """``n`` events: a third each of no-host-found, no-CR and slot_used placements,
    and one poison record every ``poison_every``."""
    rng = random.Random(seed)
    w = Workload()
    kinds = (NO_HOST_FOUND, NO_CR, SLOT_USED)
    for i in range(n):
        if poison_every and i % poison_every == poison_every - 1:
            w.add_poison(rng)
        else:
            w.add(kinds[i % 3], hosts, rng)
    return w


# --------------------------------------------------------------------------- replicas


@dataclass
class Replicas:
    """Service processes of one test; all are resumed and stopped at teardown."""

    devstack: DevStack
    log_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def spawn(self, name: str, topics: dict[str, str], **settings: str) -> None:
        # Every replica shares the prefix (as the replicas of one Deployment do); the
        # pod name plays no part in the transactional ids.
        cfg = e2e.config(
            self.devstack,
            topics,
            **{
                "CRS_SESSION_TIMEOUT_MS": "6000",
                "CRS_TRANSACTIONAL_ID_PREFIX": f"tx-{topics['input']}",
                **settings,
            },
        )
        self.procs[name] = e2e.spawn(cfg, str(self.log_dir / f"{name}.log"))

    async def synced(self, name: str, timeout_s: float = 60) -> None:
        """Wait until replica ``name``'s watch cache has listed every kind once: a test
        that freezes the API server before that tests a replica that cannot decide
        anything (the consumer joins its group before the first sync)."""
        log = self.log_dir / f"{name}.log"
        deadline = time.monotonic() + timeout_s
        while True:
            lines = log.read_text(errors="replace").splitlines()
            listed = {
                json.loads(x)["kind"]
                for x in lines
                if '"event":"informer_listed"' in x and '"initial":true' in x
            }
            if len(listed) == 4:  # hypervisors, reservations, committedresources, knowledges
                return
            assert time.monotonic() < deadline, f"{name} not synced: {listed}\n{self.logs()}"
            self.assert_running()
            await asyncio.sleep(0.2)

    def logs(self, limit: int = 2500) -> str:
        parts = []
        for name in self.procs:
            text = (self.log_dir / f"{name}.log").read_text(errors="replace")
            parts.append(f"--- {name} (last {limit} chars)\n{text[-limit:]}")
        return "\n".join(parts)

    def assert_running(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        assert not dead, f"replicas exited: {dead}\n{self.logs()}"

    def stop_all(self) -> dict[str, int]:
        codes: dict[str, int] = {}
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait(timeout=10)
        return codes


@pytest.fixture
def replicas(
    devstack: DevStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Replicas]:
    monkeypatch.setenv("CRS_SESSION_TIMEOUT_MS", "6000")
    r = Replicas(devstack, tmp_path)
    try:
        yield r
    finally:
        r.stop_all()


def topics_for(prefix_env: pytest.MonkeyPatch, topics: dict[str, str]) -> dict[str, str]:
    prefix_env.setenv("CRS_TRANSACTIONAL_ID_PREFIX", f"tx-{topics['input']}")
    return topics


# --------------------------------------------------------------------------- Kafka reads


async def admin_client(bootstrap: str) -> AIOKafkaAdminClient:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    return admin


async def group_members(bootstrap: str, group: str) -> tuple[str, int]:
    """(state, number of members) of a consumer group."""
    admin = await admin_client(bootstrap)
    try:
        (response,) = await admin.describe_consumer_groups([group])
        _error, _gid, state, _ptype, _protocol, members, *_ = response.groups[0]
        return state, len(members)
    except KafkaError as exc:  # e.g. the coordinator not there yet on a fresh broker
        return f"unknown ({type(exc).__name__})", 0
    finally:
        await admin.close()


async def wait_group(bootstrap: str, group: str, members: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    seen: tuple[str, int] = ("", 0)
    while time.monotonic() < deadline:
        seen = await group_members(bootstrap, group)
        if seen == ("Stable", members):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"group {group}: wanted Stable with {members} members, saw {seen}")


async def end_offsets(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        ends = await consumer.end_offsets(tps)
        return {tp.partition: ends[tp] for tp in tps}
    finally:
        await consumer.stop()


async def wait_all_committed(
    bootstrap: str, group: str, topic: str, partitions: int, timeout_s: float, r: Replicas
) -> dict[int, int]:
    """Wait until the group's committed offsets reach the input's end offsets."""
    ends = await end_offsets(bootstrap, topic, partitions)
    deadline = time.monotonic() + timeout_s
    committed: dict[int, int] = {}
    while time.monotonic() < deadline:
        r.assert_running()
        try:
            committed = await e2e.committed_offsets(bootstrap, group, topic)
        except KafkaError as exc:
            # The coordinator moving or loading (after a frozen broker thaws) answers
            # NOT_COORDINATOR for a while; the replicas meet it too and retry.
            if not exc.retriable:
                raise
            await asyncio.sleep(0.5)
            continue
        if all(committed.get(p, -1) >= ends[p] for p in ends):
            return ends
        await asyncio.sleep(0.5)
    raise AssertionError(f"committed {committed} never reached the end offsets {ends}")


async def first_outputs(bootstrap: str, topics: dict[str, str], r: Replicas) -> None:
    """Wait until 300 outputs are committed (the replicas are under way)."""

    async def partway() -> bool:
        r.assert_running()
        return await resilience.count_committed(bootstrap, topics["output"]) >= 300

    await resilience.wait_for(partway, 60, "the first outputs")


async def results(
    bootstrap: str,
    topics: dict[str, str],
    partitions: int,
    w: Workload,
    r: Replicas,
    timeout_s: float,
) -> tuple[dict[int, int], list[ConsumerRecord], list[ConsumerRecord]]:
    """Once the group has committed every input: (end offsets, outputs, dead letters)."""
    group = f"g-{topics['input']}"
    ends = await wait_all_committed(bootstrap, group, topics["input"], partitions, timeout_s, r)
    outputs = await e2e.read_all(
        bootstrap, topics["output"], len(w.records) - w.poison, partitions=partitions, timeout_s=30
    )
    dead = await e2e.read_all(bootstrap, topics["dlq"], w.poison, timeout_s=15)
    return ends, outputs, dead


def dead_letter_coords(record: ConsumerRecord) -> tuple[int, int]:
    headers = {k: bytes(v).decode() for k, v in record.headers}
    return int(headers["crs.source.partition"]), int(headers["crs.source.offset"])


# What the replicas' logs say about ownership and commits: printed with a failed check,
# so a run that failed once on CI can be told apart afterwards (stop 29's could not).
_OWNERSHIP_EVENTS = (
    "partitions_assigned",
    "partitions_revoking",
    "partition_acquired",
    "partition_acquire_failed",
    "commit_failed",
    "commit_found_landed",
    "release_commit_cut_short",
    "partition_fenced",
    "fetch_offset_reset",
    "fetch_rewound",
    "kafka_client_ended",
)


def offset_ranges(coords: list[tuple[int, int]]) -> dict[int, list[str]]:
    """``(partition, offset)`` pairs as runs per partition: {0: ["0-249", "260"]}."""
    runs: dict[int, list[list[int]]] = collections.defaultdict(list)
    for p, o in sorted(coords):
        if runs[p] and runs[p][-1][1] == o - 1:
            runs[p][-1][1] = o
        else:
            runs[p].append([o, o])
    return {p: [f"{a}-{b}" if a != b else str(a) for a, b in r] for p, r in runs.items()}


def ownership_story(replicas: Replicas) -> str:
    lines = []
    for name in replicas.procs:
        log = replicas.log_dir / f"{name}.log"
        for event in _OWNERSHIP_EVENTS:
            for e in e2e.log_events(log, event):
                fields = {k: v for k, v in e.items() if k not in {"event", "level", "topic"}}
                lines.append((e["timestamp"], f"{name} {event} {fields}"))
    return "\n".join(text for _, text in sorted(lines)[-200:])


def check_exactly_once(
    outputs: list[ConsumerRecord],
    dead: list[ConsumerRecord],
    ends: dict[int, int],
    w: Workload,
    replicas: Replicas | None = None,
) -> None:
    """Every input record exactly once across output + DLQ; no duplicate output id; no
    two outputs of one input; each kind of event classified as its kind. On failure the
    message names the offsets and (``replicas``) what their logs say about ownership."""
    datas = [e2e.data_of(r) for r in outputs]
    seen: collections.Counter[tuple[int, int]] = collections.Counter(
        (d["input"]["partition"], d["input"]["offset"]) for d in datas
    )
    seen.update(dead_letter_coords(r) for r in dead)
    expected = {(p, o) for p, end in ends.items() for o in range(end)}
    twice = sorted(k for k, c in seen.items() if c > 1)
    missing = sorted(expected - set(seen))
    unknown = sorted(set(seen) - expected)
    by_input: dict[tuple[int, int], set[tuple[Any, ...]]] = collections.defaultdict(set)
    for d in datas:
        by_input[(d["input"]["partition"], d["input"]["offset"])].add(
            (d["cr_slot"], d["allocation"], d["reservation"])
        )
    # Two outputs of one input that disagree on the class or the slot contradict each
    # other (written vs. already_present is a replay of the same decision).
    contradicting = {k: v for k, v in by_input.items() if len({(c, r) for c, _, r in v}) > 1}
    ids = collections.Counter(e2e.data_of(r)["input"]["id"] for r in outputs)
    output_ids = collections.Counter(
        __import__("msgspec").json.decode(r.value)["id"] for r in outputs
    )
    problems = []
    if twice:
        problems.append(
            f"{len(twice)} of {len(expected)} inputs with more than one output:"
            f" {offset_ranges(twice)}"
        )
    if contradicting:
        sample = list(contradicting.items())[:3]
        problems.append(f"{len(contradicting)} contradicting pairs, e.g. {sample}")
    if missing:
        problems.append(f"{len(missing)} inputs never processed: {offset_ranges(missing)}")
    if unknown:
        problems.append(f"outputs for offsets past the end: {unknown[:5]}")
    dup_ids = [i for i, c in output_ids.items() if c > 1]
    if dup_ids:
        problems.append(f"{len(dup_ids)} duplicate output ids")
    if any(c > 1 for c in ids.values()):
        problems.append("an input event id classified twice")
    if len(dead) != w.poison:
        problems.append(f"{len(dead)} dead letters, expected {w.poison} (the poison records)")
    for d in datas:
        kind = w.kind_of.get(d["instance_uuid"])
        ok = {
            NO_HOST_FOUND: d["kind"] == "no_host_found",
            NO_CR: d["cr_slot"] == "no_cr",
            SLOT_USED: d["cr_slot"] == "slot_used"
            and d["allocation"] in {"written", "already_present"},
        }.get(kind or "", False)
        if not ok:
            problems.append(f"{kind} classified {d['kind']}/{d['cr_slot']}/{d['allocation']}")
            break
    story = f"\n{ownership_story(replicas)}" if replicas is not None and problems else ""
    assert not problems, "; ".join(problems) + story


async def check_allocations(api: Any, w: Workload) -> None:
    placed = {vm for vm, kind in w.kind_of.items() if kind == SLOT_USED}
    where = await resilience.allocations_by_vm(api)
    in_two = {vm: slots for vm, slots in where.items() if len(slots) > 1}
    assert not in_two, f"VMs in more than one slot: {list(in_two.items())[:5]}"
    assert set(where) == placed, (
        f"{len(placed - set(where))} slot_used VMs without allocation, "
        f"{len(set(where) - placed)} allocations of other VMs"
    )


# --------------------------------------------------------------------------- tests


def slow_take_overs(log: str, limit_s: float) -> dict[int, float | None]:
    """Partitions of a replica's last assignment not taken over within ``limit_s``
    (seconds from partitions_assigned to partition_acquired; None: never)."""
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assigned = [
        i
        for i, e in enumerate(lines)
        if e.get("event") == "partitions_assigned" and e["partitions"]
    ]
    if not assigned:
        return {}
    start = lines[assigned[-1]]
    at = datetime.fromisoformat(start["timestamp"])
    took: dict[int, float | None] = dict.fromkeys(start["partitions"])
    for e in lines[assigned[-1] :]:
        if e.get("event") == "partition_acquired" and e["partition"] in took:
            took[e["partition"]] = (datetime.fromisoformat(e["timestamp"]) - at).total_seconds()
    return {p: t for p, t in took.items() if t is None or t > limit_s}


async def test_frozen_replica_past_its_session_commits_nothing_twice(
    devstack: DevStack,
    clean_k8s: Any,
    new_topic: Any,
    replicas: Replicas,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """2 replicas; one is frozen (SIGSTOP) mid-batch until the group has evicted it and
    the other replica has taken its partitions over, then resumed (SIGCONT). The resumed
    zombie must not commit its stale batch: every input exactly once."""
    partitions = 4
    hosts = await seed(clean_k8s, hosts=8, slots_per_host=1, slot_memory="4Ti")
    topics = topics_for(monkeypatch, await resilience.service_topics(new_topic))
    w = mixed(hosts, 2400, seed=11)
    group = f"g-{topics['input']}"
    boot = devstack.kafka_bootstrap
    ports = {name: e2e.free_port() for name in ("a", "b")}
    for name, port in ports.items():
        # A commit timeout far beyond the freeze: a commit that reached the broker before
        # the SIGSTOP must not be counted as failed (and uncounted) when a wakes up.
        replicas.spawn(name, topics, CRS_HTTP_PORT=str(port), CRS_COMMIT_TIMEOUT_S="300")
    await wait_group(boot, group, 2, timeout_s=60)
    await e2e.publish(boot, topics["input"], w.records)

    await first_outputs(boot, topics, replicas)
    frozen = replicas.procs["a"]
    os.kill(frozen.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        # Held until the group has evicted it and b, alone, has drained the whole backlog
        # (a's former partitions included), so whatever a still holds is stale.
        await wait_group(boot, group, 1, timeout_s=60)
        evicted_after = time.monotonic() - stopped_at
        await wait_all_committed(boot, group, topics["input"], partitions, 90, replicas)
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    # The broker evicts a session timeout after the member's *last heartbeat*, which may
    # have been up to one heartbeat interval (aiokafka: 3 s) before the SIGSTOP: so the
    # eviction comes 6 - 3 = 3 s after the freeze at the earliest (4.87 s was seen).
    assert evicted_after > 6 - 3, "evicted too fast to have been caused by the freeze"
    # a rejoining proves it has woken up and dealt with what it held when frozen.
    await wait_group(boot, group, 2, timeout_s=60)

    ends, outputs, dead = await results(boot, topics, partitions, w, replicas, 90)
    names = ("crs_events_total", "crs_dead_letters_total")
    counted = [await e2e.counter_sums(port, *names) for port in ports.values()]
    # The zombie takes the partitions its rejoin gave it over at once, not after the
    # fence re-check (15 s) that its revoke's fenced commit used to leave pending.
    deadline = time.monotonic() + 10
    while late := slow_take_overs((replicas.log_dir / "a.log").read_text(), limit_s=5.0):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    codes = replicas.stop_all()
    assert not late, f"partitions taken over late (s): {late}"
    check_exactly_once(outputs, dead, ends, w, replicas)
    await check_allocations(clean_k8s, w)
    committed = await e2e.committed_offsets(boot, group, topics["input"])
    assert committed == ends
    assert set(codes.values()) == {0}, f"exit codes {codes}\n{replicas.logs()}"
    # The zombie found itself fenced when it woke up (its stale batch dropped, not
    # committed) ...
    zombie_log = (replicas.log_dir / "a.log").read_text(errors="replace")
    assert '"event":"partition_fenced"' in zombie_log, zombie_log[-3000:]
    # ... and counted nothing of it: the two replicas together count each event once.
    total = {n: sum(c[n] for c in counted) for n in names}
    assert total == {"crs_events_total": len(outputs), "crs_dead_letters_total": len(dead)}, counted


async def test_api_server_frozen_does_not_hold_events_that_need_no_api_call(
    devstack: DevStack,
    clean_k8s: Any,
    new_topic: Any,
    replicas: Replicas,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A steady 40 events/s while kube-apiserver is frozen for 30 s: no-host-found and
    no-CR placements (decided from the watch cache) keep coming out, p99 publish ->
    committed output <= 2 s; the slot_used placements (one PATCH each) wait and are all
    written after SIGCONT; nothing twice."""
    partitions, rate, before_s, freeze_s, after_s = 4, 40.0, 5.0, 30.0, 5.0
    hosts = await seed(clean_k8s, hosts=8, slots_per_host=1, slot_memory="4Ti")
    topics = topics_for(monkeypatch, await resilience.service_topics(new_topic))
    total = int(rate * (before_s + freeze_s + after_s))
    w = mixed(hosts, total, seed=12, poison_every=0)
    group = f"g-{topics['input']}"
    boot = devstack.kafka_bootstrap
    replicas.spawn("a", topics, CRS_MAX_ATTEMPTS="1000")
    await wait_group(boot, group, 1, timeout_s=60)
    await replicas.synced("a")

    published: dict[str, float] = {}
    seen: dict[str, float] = {}
    reader = AIOKafkaConsumer(
        bootstrap_servers=boot,
        isolation_level="read_committed",
        auto_offset_reset="earliest",
        fetch_max_wait_ms=50,
    )
    await reader.start()
    reader.assign([TopicPartition(topics["output"], p) for p in range(partitions)])

    async def read() -> None:
        while True:
            batch = await reader.getmany(timeout_ms=100)
            now = time.monotonic()
            for records in batch.values():
                for r in records:
                    seen.setdefault(e2e.data_of(r)["instance_uuid"], now)

    reading = asyncio.create_task(read())
    producer = AIOKafkaProducer(bootstrap_servers=boot, acks="all")
    await producer.start()
    pid = int((devstack.run_dir / "kube-apiserver.pid").read_text())
    frozen = False
    try:
        vms = list(w.kind_of)
        start = time.monotonic()
        freeze_at, thaw_at = start + before_s, start + before_s + freeze_s
        for i, (key, value, headers) in enumerate(w.records):
            now = time.monotonic()
            if not frozen and now >= freeze_at and now < thaw_at:
                os.kill(pid, signal.SIGSTOP)
                frozen = True
            elif frozen and now >= thaw_at:
                os.kill(pid, signal.SIGCONT)
                frozen = False
            await asyncio.sleep(max(0.0, start + i / rate - now))
            published[vms[i]] = time.monotonic()
            await producer.send_and_wait(topics["input"], value, key=key, headers=headers)
        if frozen:
            os.kill(pid, signal.SIGCONT)
            frozen = False
        replicas.assert_running()
        ends = await wait_all_committed(boot, group, topics["input"], partitions, 120, replicas)

        async def all_seen() -> bool:
            return len(seen) >= len(w.kind_of)

        # The figures below name what is missing; a timeout here is not the verdict.
        with contextlib.suppress(AssertionError):
            await resilience.wait_for(all_seen, 30, "every output")
    finally:
        if frozen:
            os.kill(pid, signal.SIGCONT)
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading
        await reader.stop()
        await producer.stop()

    delays = {
        kind: sorted(
            seen.get(vm, float("inf")) - published[vm]
            for vm, k in w.kind_of.items()
            if k == kind and freeze_at <= published[vm] < thaw_at
        )
        for kind in (*NEEDS_NO_API, SLOT_USED)
    }
    no_api = sorted(delays[NO_HOST_FOUND] + delays[NO_CR])
    assert len(no_api) >= rate * freeze_s * 0.5, "too few events published during the freeze"
    summary = {
        kind: (len(d), round(d[len(d) // 2], 2), round(d[int(0.99 * (len(d) - 1))], 2))
        for kind, d in delays.items()
    }
    p99 = no_api[int(0.99 * (len(no_api) - 1))]
    outputs = await e2e.read_all(boot, topics["output"], total, partitions=partitions)
    dead = await e2e.read_all(boot, topics["dlq"], 0, timeout_s=2)
    codes = replicas.stop_all()
    # Every verdict is collected, so one run tells which of them fail.
    problems = []
    if p99 > 2.0:
        problems.append(
            f"p99 {p99:.2f}s > 2s for no-API events during the freeze; "
            f"(n, median s, p99 s) by kind {summary}"
        )
    try:
        check_exactly_once(outputs, dead, ends, w, replicas)
    except AssertionError as exc:
        problems.append(str(exc).splitlines()[0])
    try:
        await check_allocations(clean_k8s, w)
    except AssertionError as exc:
        problems.append(str(exc).splitlines()[0])
    if set(codes.values()) != {0}:
        problems.append(f"exit codes {codes}\n{replicas.logs()}")
    assert not problems, "\n".join(problems)


async def test_conflict_storm_of_three_replicas_decides_every_placement(
    devstack: DevStack,
    clean_k8s: Any,
    new_topic: Any,
    replicas: Replicas,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """3 replicas write placements onto 2 hosts with 2 small slots each (room for 128
    VMs; 200 placements): every slot fills up exactly, no slot is overfilled, no VM sits
    in two slots, no placement ends ``allocation=failed``."""
    partitions, n = 6, 200
    hosts = await seed(clean_k8s, hosts=2, slots_per_host=2, slot_memory="128Gi")
    capacity = 2 * 2 * 128 * GiB // VM_BYTES
    topics = {
        "input": await new_topic("in", partitions),
        "output": await new_topic("out", partitions),
        "dlq": await new_topic("dlq", 1),
    }
    topics_for(monkeypatch, topics)
    rng = random.Random(13)
    w = Workload()
    for _ in range(n):
        w.add(SLOT_USED, hosts, rng)
    group = f"g-{topics['input']}"
    boot = devstack.kafka_bootstrap
    for name in ("a", "b", "c"):
        replicas.spawn(name, topics)
    await wait_group(boot, group, 3, timeout_s=60)
    await e2e.publish(boot, topics["input"], w.records)
    ends = await wait_all_committed(boot, group, topics["input"], partitions, 90, replicas)
    outputs = await e2e.read_all(boot, topics["output"], n, partitions=partitions)
    codes = replicas.stop_all()

    datas = [e2e.data_of(r) for r in outputs]
    coords = collections.Counter((d["input"]["partition"], d["input"]["offset"]) for d in datas)
    assert sum(ends.values()) == n
    assert len(coords) == n, f"{n - len(coords)} inputs without output"
    assert max(coords.values()) == 1, "an input classified twice"
    outcomes = collections.Counter((d["cr_slot"], d["allocation"]) for d in datas)
    assert outcomes[("slot_used", "failed")] == 0, f"outcomes {dict(outcomes)}"

    slots = await reservations(clean_k8s)
    where: dict[str, list[str]] = collections.defaultdict(list)
    for name, res in slots.items():
        allocs = res["spec"]["committedResourceReservation"].get("allocations") or {}
        used = sum(parse_quantity(a["resources"]["memory"]).value() for a in allocs.values())
        size = parse_quantity(res["spec"]["resources"]["memory"]).value()
        assert used <= size, f"{name} overfilled: {used} of {size} bytes"
        for vm in allocs:
            where[vm].append(name)
    assert all(len(s) == 1 for s in where.values()), "a VM in two slots"
    written = {
        d["instance_uuid"] for d in datas if d["allocation"] in {"written", "already_present"}
    }
    assert written == set(where), "outputs and allocations disagree"
    # More placements than room: a slot left with room means a placement gave up on it.
    assert len(where) == capacity, f"{len(where)} of {capacity} places taken; {dict(outcomes)}"
    assert set(codes.values()) == {0}, f"exit codes {codes}\n{replicas.logs()}"


async def test_one_vms_events_keep_their_order_while_other_keys_go_on(
    devstack: DevStack,
    clean_k8s: Any,
    new_topic: Any,
    replicas: Replicas,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Key lanes on the real stack, one partition: VM X's placement (a PATCH, held by a
    frozen API server) comes first in its lane, keyed by X's UUID in upper case; X's
    no-host-found outcome after it has no key (its lane is then X's instance UUID, which
    compares case-insensitively); VM Y's outcome has its own key. Y's output must come out
    during the freeze, X's second event only after X's first, in input order."""
    await e2e.seed_region(clean_k8s)
    topics = topics_for(monkeypatch, await e2e.new_topics(new_topic, 1))
    group = f"g-{topics['input']}"
    boot = devstack.kafka_bootstrap
    # A PATCH timeout longer than any freeze here: X's write must be answered "written"
    # after SIGCONT, not time out and be found already present by its retry.
    replicas.spawn("a", topics, CRS_MAX_ATTEMPTS="1000", CRS_K8S_TIMEOUT_S="60")
    await wait_group(boot, group, 1, timeout_s=60)
    x, y = "6c1b8e4e-5f2a-4d8e-9c3b-0a1b2c3d4e5f", "0f9e8d7c-6b5a-4c3d-8e2f-1a0b9c8d7e6f"
    _, placed, placed_req = e2e.outcome("hv-1", ["hv-1", "hv-2"], vm=x)  # slot_used
    _, x_none, x_none_req = e2e.outcome(None, ["hv-3"], vm=x)
    _, y_none, y_none_req = e2e.outcome(None, ["hv-3"], vm=y)
    x_first = e2e.good_record(x, placed, placed_req)
    x_second = e2e.good_record(x, x_none, x_none_req)
    records = [
        (x.upper().encode(), x_first[1], x_first[2]),
        (None, x_second[1], x_second[2]),
        e2e.good_record(y, y_none, y_none_req),
    ]
    await replicas.synced("a")
    pid = int((devstack.run_dir / "kube-apiserver.pid").read_text())
    os.kill(pid, signal.SIGSTOP)
    try:
        await e2e.publish(boot, topics["input"], records)
        during = await e2e.read_all(boot, topics["output"], 1, timeout_s=20)
        # A moment more: X's second event must still be waiting behind X's first.
        during = await e2e.read_all(boot, topics["output"], 2, timeout_s=3)
    finally:
        os.kill(pid, signal.SIGCONT)
    replicas.assert_running()
    assert [e2e.data_of(r)["instance_uuid"] for r in during] == [y]
    after = await e2e.read_all(boot, topics["output"], 3, timeout_s=60)
    order = [(e2e.data_of(r)["instance_uuid"], e2e.data_of(r)["kind"]) for r in after]
    assert order == [(y, "no_host_found"), (x, "placement"), (x, "no_host_found")]
    assert e2e.data_of(after[1])["allocation"] == "written"
    assert replicas.stop_all() == {"a": 0}


async def test_lag_follows_the_backlog_of_a_partition_full_of_stuck_placements(
    devstack: DevStack,
    clean_k8s: Any,
    new_topic: Any,
    replicas: Replicas,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CRS_MAX_IN_FLIGHT=4, one partition, API server frozen: four placements (a PATCH
    each) fill the partition, so it is fetched no more (aiokafka keeps one response
    buffered). aiokafka learns the last stable offset from fetches only; the backlog
    published meanwhile must still show in crs_consumer_lag, or the lag alert cannot
    fire during the outage that builds the backlog. After SIGCONT everything comes out
    and the lag returns to 0."""
    await e2e.seed_region(clean_k8s)
    topics = topics_for(monkeypatch, await e2e.new_topics(new_topic, 1))
    group = f"g-{topics['input']}"
    boot = devstack.kafka_bootstrap
    port = e2e.free_port()
    replicas.spawn(
        "a", topics, CRS_MAX_IN_FLIGHT="4", CRS_MAX_ATTEMPTS="1000", CRS_HTTP_PORT=str(port)
    )
    await wait_group(boot, group, 1, timeout_s=60)
    lag = ("crs_consumer_lag", (("partition", "0"), ("topic", topics["input"])))

    def events(target: str | None, n: int) -> list[Any]:
        return [e2e.good_record(*e2e.outcome(target, ["hv-1", "hv-2"])) for _ in range(n)]

    await replicas.synced("a")
    pid = int((devstack.run_dir / "kube-apiserver.pid").read_text())
    os.kill(pid, signal.SIGSTOP)
    try:
        await e2e.publish(boot, topics["input"], events("hv-1", 4))  # slot_used: stuck
        await asyncio.sleep(2)  # fetched; the partition is full
        for _ in range(3):  # the first wave may land in the one buffered fetch
            await e2e.publish(boot, topics["input"], events(None, 20))
            await asyncio.sleep(1)
        deadline = time.monotonic() + 30
        seen = 0.0
        while (seen := (await e2e.metrics_at(port)).get(lag, 0.0)) < 64:
            assert time.monotonic() < deadline, f"lag {seen}, backlog 64\n{replicas.logs()}"
            await asyncio.sleep(0.5)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert len(await e2e.read_all(boot, topics["output"], 64, timeout_s=90)) == 64
    deadline = time.monotonic() + 30
    while (seen := (await e2e.metrics_at(port)).get(lag, 0.0)) != 0:
        assert time.monotonic() < deadline, f"lag {seen} after the backlog drained"
        await asyncio.sleep(0.5)
    assert replicas.stop_all() == {"a": 0}


async def test_key_concurrency_bounds_the_lanes_running_at_once(
    devstack: DevStack,
    clean_k8s: Any,
    new_topic: Any,
    replicas: Replicas,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CRS_KEY_CONCURRENCY=1 on the real stack: one lane at a time per partition, so a
    placement held by a frozen API server holds the 3,000 other keys behind it (with the
    default bound they go on: test_api_server_frozen_does_not_hold_events_that_need_no_api_call);
    after SIGCONT those 3,000 waiting lanes all drain."""
    await e2e.seed_region(clean_k8s)
    topics = topics_for(monkeypatch, await e2e.new_topics(new_topic, 1))
    group = f"g-{topics['input']}"
    boot = devstack.kafka_bootstrap
    replicas.spawn(
        "a",
        topics,
        CRS_KEY_CONCURRENCY="1",
        CRS_MAX_IN_FLIGHT="5000",
        CRS_MAX_ATTEMPTS="1000",
        CRS_K8S_TIMEOUT_S="60",  # the held PATCH is answered "written" after SIGCONT
    )
    await wait_group(boot, group, 1, timeout_s=60)
    others = 3000
    records = [e2e.good_record(*e2e.outcome("hv-1", ["hv-1", "hv-2"]))]  # slot_used: a PATCH
    records += [e2e.good_record(*e2e.outcome(None, ["hv-3"])) for _ in range(others)]
    await replicas.synced("a")
    pid = int((devstack.run_dir / "kube-apiserver.pid").read_text())
    os.kill(pid, signal.SIGSTOP)
    try:
        await e2e.publish(boot, topics["input"], records)
        during = await e2e.read_all(boot, topics["output"], 1, timeout_s=5)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert during == []
    after = await e2e.read_all(boot, topics["output"], len(records), timeout_s=120)
    assert len(after) == len(records)
    assert e2e.data_of(after[0])["allocation"] == "written"
    replicas.assert_running()
    assert replicas.stop_all() == {"a": 0}


async def test_a_revoke_bounds_its_last_commits_when_the_broker_hangs(
    devstack: DevStack,
    clean_k8s: Any,
    new_topic: Any,
    replicas: Replicas,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rebalance (replica b joins) while replica a's records wait on a frozen API server
    and then its last commits hang on a frozen broker: a's revoke, which runs inside the
    rebalance where aiokafka sends no heartbeat, must end within CRS_REVOKE_WAIT_S plus
    what is left of half the session (here 3 + 2 s, plus a second of slack), its commits
    cut short, instead of waiting CRS_COMMIT_TIMEOUT_S per partition (and a member that
    misses its session is evicted: one more rebalance); afterwards every input exactly
    once."""
    partitions = 4
    # Many hosts: the placements do not queue behind each other on a few slots, so the
    # rest is done quickly after the freezes.
    hosts = await seed(clean_k8s, hosts=32, slots_per_host=1, slot_memory="4Ti")
    topics = topics_for(monkeypatch, await resilience.service_topics(new_topic))
    w = mixed(hosts, 3000, seed=13)
    group = f"g-{topics['input']}"
    boot = devstack.kafka_bootstrap
    settings = {
        "CRS_SESSION_TIMEOUT_MS": "10000",
        "CRS_REVOKE_WAIT_S": "3",
        "CRS_MAX_ATTEMPTS": "1000",
    }
    # a commits every 10 s (or per 500 records): what it decides before the rebalance is
    # still to be committed when the revoke comes.
    replicas.spawn("a", topics, CRS_COMMIT_INTERVAL_MS="10000", CRS_COMMIT_BURST="1", **settings)
    await wait_group(boot, group, 1, timeout_s=60)
    await e2e.publish(boot, topics["input"], w.records)

    await first_outputs(boot, topics, replicas)
    a_log, b_log = replicas.log_dir / "a.log", replicas.log_dir / "b.log"
    revokes_before = len(e2e.log_events(a_log, "partitions_revoking"))
    apiserver = int((devstack.run_dir / "kube-apiserver.pid").read_text())
    broker = int((devstack.run_dir / "kafka.pid").read_text())
    frozen: list[int] = []
    try:
        replicas.spawn("b", topics, **settings)
        deadline = time.monotonic() + 60
        while not e2e.log_events(b_log, "consumer_started"):  # b is joining: a rebalance
            assert time.monotonic() < deadline, replicas.logs()
            await asyncio.sleep(0.05)
        os.kill(apiserver, signal.SIGSTOP)  # a's placements in progress stay so
        frozen.append(apiserver)
        while len(e2e.log_events(a_log, "partitions_revoking")) == revokes_before:
            assert time.monotonic() < deadline, replicas.logs()
            await asyncio.sleep(0.05)
        os.kill(broker, signal.SIGSTOP)  # before a's revoke has waited 3 s and commits
        frozen.append(broker)
        await asyncio.sleep(8.0)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    revoking = e2e.log_events(a_log, "partitions_revoking")[revokes_before]
    after = [
        e
        for e in e2e.log_events(a_log, "partitions_revoked")
        if e["timestamp"] > revoking["timestamp"]
    ]
    assert after, replicas.logs()
    took = (
        datetime.fromisoformat(after[0]["timestamp"])
        - datetime.fromisoformat(revoking["timestamp"])
    ).total_seconds()
    assert e2e.log_events(a_log, "release_commit_cut_short"), "the revoke's commits did not hang"
    assert took <= 3 + 2 + 1, f"a's revoke took {took:.1f} s\n{replicas.logs()}"

    ends, outputs, dead = await results(boot, topics, partitions, w, replicas, 180)
    codes = replicas.stop_all()
    check_exactly_once(outputs, dead, ends, w, replicas)
    await check_allocations(clean_k8s, w)
    assert set(codes.values()) == {0}, f"exit codes {codes}\n{replicas.logs()}"
