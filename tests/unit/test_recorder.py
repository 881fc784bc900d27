"""The Recorder on the in-memory cluster state: the reference cases and the races, fast.

Mirrors tests/integration/test_recorder.py (which runs the same cases against the real
API server) case by case, so the Recorder's logic, including conflicts and deletions
between read and patch, is checked in milliseconds. Assertions are about outcomes (what
was written, what was counted, what the outcome says), not about how many times the
Recorder retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
from collections.abc import Collection, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry

from service.app.logs import configure_logging
from service.crs import Recorder, new_no_host_found_counter, new_placement_counter
from service.crs import recorder as recorder_module
from service.crs.outcome import AllocationStatus, Outcome
from service.crs.ports import (
    OUTCOME_HOOK,
    ClusterState,
    ConflictError,
    NotFoundError,
    Snapshot,
    UnavailableError,
)
from service.model import Reservation
from service.quantity import parse_quantity
from tests import factories as f
from tests import nova
from tests.fakes.cluster_state import InMemoryClusterState

HOST = "host-a"
OTHER = "host-b"
PROJECT = "p1"
GROUP = "g1"
UUID = "11111111-2222-3333-4444-555555555555"
NOW = datetime(2026, 12, 2, 10, 11, 12, 987654, tzinfo=UTC)
NOW_TEXT = "2026-12-02T10:11:12Z"
# Give up quickly on a slot that keeps changing (the one place naming the retry knobs).
QUICK_GIVE_UP: dict[str, Any] = {"max_conflict_retries": 2, "backoff_s": 0.001}


def knowledge(**kwargs: Any) -> dict[str, Any]:
    return f.knowledge(
        [
            f.flavor_group(GROUP, [f.flavor("m1.large", 4096, 2), f.flavor("m1.xlarge", 8192, 4)]),
            f.flavor_group("g2", [f.flavor("other.small", 2048, 1)]),
        ],
        **kwargs,
    )


def standard_world(*reservations: dict[str, Any], cr_state: str = "confirmed") -> list[Any]:
    return [
        knowledge(),
        f.committed_resource("cr-1", project=PROJECT, group=GROUP, amount="64Gi", state=cr_state),
        f.hypervisor(HOST),
        f.hypervisor(OTHER),
        *reservations,
    ]


class Env:
    def __init__(self) -> None:
        self.state = InMemoryClusterState()
        self.registry = CollectorRegistry()
        self.placement_counter = new_placement_counter(self.registry)
        self.no_host_found_counter = new_no_host_found_counter(self.registry)
        self.recorder = self.recorder_on(self.state)

    def recorder_on(self, state: ClusterState, **kwargs: Any) -> Recorder:
        """Another Recorder on the same counters (another replica, as far as writes go)."""
        return Recorder(
            state,
            self.placement_counter,
            self.no_host_found_counter,
            clock=lambda: NOW,
            **kwargs,
        )

    def seed(self, *objs: dict[str, Any]) -> None:
        self.state.put(*objs)

    def allocations(self, name: str) -> dict[str, Any]:
        obj = self.state.stored("Reservation", name)
        assert obj is not None, f"{name} is gone"
        return obj["spec"].get("committedResourceReservation", {}).get("allocations") or {}

    def placement(self, cr_slot: str, group: str = GROUP, intent: str = "Unknown") -> float:
        value = self.registry.get_sample_value(
            "cortex_nova_placement_total",
            {"flavor_group": group, "intent": intent, "cr_slot": cr_slot},
        )
        return value or 0.0

    def no_host_found(self, cr_slot: str, group: str = GROUP, intent: str = "Unknown") -> float:
        value = self.registry.get_sample_value(
            "cortex_nova_no_host_found_total",
            {"cr_slot": cr_slot, "flavor_group": group, "intent": intent},
        )
        return value or 0.0

    def total(self, metric: str) -> float:
        return sum(
            s.value
            for fam in self.registry.collect()
            for s in fam.samples
            if s.name == f"{metric}_total"
        )


@pytest.fixture
def env() -> Env:
    return Env()


async def place(
    rec: Recorder,
    *,
    uuid: str = UUID,
    target: str = HOST,
    candidates: Sequence[str] | None = None,
    flavor: str = "m1.large",
    replay: bool = False,
    **req: Any,
) -> Outcome:
    cands = list(candidates) if candidates is not None else [target]
    request = nova.parse_request(
        nova.request(uuid, project_id=PROJECT, flavor_name=flavor, hosts=cands, **req)
    )
    return await rec.record_placement(nova.decision(target, cands), request, replay=replay)


async def no_host(
    rec: Recorder, *, hosts: Sequence[str] = (HOST,), flavor: str = "m1.large", **req: Any
) -> Outcome:
    request = nova.parse_request(
        nova.request(UUID, project_id=PROJECT, flavor_name=flavor, hosts=hosts, **req)
    )
    return await rec.record_no_host_found(nova.decision(None, []), request)


# --- the reference recorder's cases -------------------------------------------------------


async def test_writes_allocation_into_matching_slot(env: Env) -> None:
    env.seed(*standard_world(f.reservation("slot-1", host=HOST, memory="8Gi")))
    out = await place(env.recorder)
    assert (out.cr_slot, out.allocation, out.reservation) == (
        "slot_used",
        AllocationStatus.WRITTEN,
        "slot-1",
    )
    assert (out.flavor_group, out.vm_memory_bytes, out.conflicts) == (GROUP, 4 << 30, 0)
    assert env.allocations("slot-1") == {
        UUID: {"creationTimestamp": NOW_TEXT, "resources": {"memory": "4Gi", "cpu": "2"}}
    }
    assert env.placement("slot_used") == 1
    assert env.total("cortex_nova_placement") == 1
    assert env.state.patch_results == {"200": 1}


async def test_a_written_allocation_is_logged_once_by_the_processor_not_here(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The processor's "classified" line is the one info line of a write (it names the
    # event); the recorder's own is at debug, so a write is not logged twice.
    env.seed(*standard_world(f.reservation("slot-1", host=HOST, memory="16Gi")))
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    seen: dict[str, io.StringIO] = {}
    try:
        for name, vm in (("INFO", UUID), ("DEBUG", "vm-2")):
            out = seen[name] = io.StringIO()
            configure_logging(name, "json", stream=out)
            # The module's logger may have been cached under an earlier configuration.
            monkeypatch.setattr(recorder_module, "_log", structlog.get_logger("recorder"))
            outcome = await place(env.recorder, uuid=vm)
            assert outcome.allocation is AllocationStatus.WRITTEN
    finally:
        structlog.reset_defaults()
        root.handlers[:] = handlers
        root.setLevel(level)
    assert seen["INFO"].getvalue() == ""
    assert '"allocation_written"' in seen["DEBUG"].getvalue()


async def test_the_allocation_is_stamped_with_the_placement_time_not_the_processing_time(
    env: Env,
) -> None:
    # An outcome processed two hours late: Cortex's grace period must count from the
    # placement, as it does for the in-process reference recorder.
    env.seed(*standard_world(f.reservation("slot-1", host=HOST, memory="16Gi")))
    request = nova.parse_request(
        nova.request(UUID, project_id=PROJECT, flavor_name="m1.large", hosts=[HOST])
    )
    placed = NOW - timedelta(hours=2, seconds=0.5)
    out = await env.recorder.record(nova.decision(HOST, [HOST]), request, placed_at=placed)
    assert out.allocation is AllocationStatus.WRITTEN
    assert env.allocations("slot-1")[UUID]["creationTimestamp"] == "2026-12-02T08:11:12Z"
    # Replayed later again: the VM is in the slot, nothing is written, the stamp stays.
    again = await env.recorder.record(nova.decision(HOST, [HOST]), request, placed_at=NOW)
    assert again.allocation is AllocationStatus.ALREADY_PRESENT
    assert env.allocations("slot-1")[UUID]["creationTimestamp"] == "2026-12-02T08:11:12Z"
    assert env.state.patch_results == {"200": 1}


async def test_a_placement_time_ahead_of_the_clock_is_clamped_to_the_clock(env: Env) -> None:
    # A producer whose clock runs ahead must not extend Cortex's grace period.
    env.seed(*standard_world(f.reservation("slot-1", host=HOST, memory="16Gi")))
    request = nova.parse_request(
        nova.request(UUID, project_id=PROJECT, flavor_name="m1.large", hosts=[HOST])
    )
    ahead = NOW + timedelta(minutes=30)
    await env.recorder.record(nova.decision(HOST, [HOST]), request, placed_at=ahead)
    assert env.allocations("slot-1")[UUID]["creationTimestamp"] == NOW_TEXT
    other = "22222222-2222-3333-4444-555555555555"
    naive = NOW.replace(tzinfo=None) - timedelta(hours=1)  # taken as UTC
    request = nova.parse_request(
        nova.request(other, project_id=PROJECT, flavor_name="m1.large", hosts=[HOST])
    )
    await env.recorder.record(nova.decision(HOST, [HOST]), request, placed_at=naive)
    assert env.allocations("slot-1")[other]["creationTimestamp"] == "2026-12-02T09:11:12Z"


async def test_memory_quantity_is_binary_si_of_the_group_flavor(env: Env) -> None:
    env.seed(*standard_world(f.reservation("slot-1", host=HOST, memory="16Gi")))
    out = await place(env.recorder, flavor="m1.xlarge", memory_mb=1, vcpus=1)
    assert out.allocation is AllocationStatus.WRITTEN
    assert env.allocations("slot-1")[UUID]["resources"] == {"memory": "8Gi", "cpu": "4"}


async def test_idempotent_when_uuid_already_allocated(env: Env) -> None:
    env.seed(
        *standard_world(
            f.reservation(
                "slot-1", host=HOST, memory="8Gi", allocations={UUID: f.allocation("4Gi")}
            )
        )
    )
    before = env.state.stored("Reservation", "slot-1")
    out = await place(env.recorder)
    assert (out.cr_slot, out.allocation, out.reservation) == (
        "slot_used",
        AllocationStatus.ALREADY_PRESENT,
        "slot-1",
    )
    assert env.state.stored("Reservation", "slot-1") == before
    assert env.state.calls["patch_allocation"] == 0
    assert env.placement("slot_used") == 1


async def test_payg_flavor_no_write_no_count(env: Env) -> None:
    env.seed(*standard_world(f.reservation("slot-1", host=HOST)))
    out = await place(env.recorder, flavor="unknown-flavor")
    assert (out.cr_slot, out.flavor_group, out.allocation) == (
        "payg",
        None,
        AllocationStatus.NOT_APPLICABLE,
    )
    assert env.allocations("slot-1") == {}
    assert env.total("cortex_nova_placement") == 0


async def test_host_mismatch_no_write(env: Env) -> None:
    env.seed(*standard_world(f.reservation("slot-1", host=OTHER)))
    out = await place(env.recorder)
    assert (out.cr_slot, out.allocation) == ("slot_missed", AllocationStatus.NOT_APPLICABLE)
    assert env.allocations("slot-1") == {}
    assert env.placement("slot_missed") == 1


async def test_full_slot_no_write(env: Env) -> None:
    full = f.reservation(
        "slot-full", host=HOST, memory="4Gi", allocations={"other-vm": f.allocation("4Gi")}
    )
    env.seed(*standard_world(full))
    out = await place(env.recorder)
    assert out.cr_slot == "slot_missed"
    assert set(env.allocations("slot-full")) == {"other-vm"}
    assert env.placement("slot_missed") == 1


async def test_pending_commitment_no_write(env: Env) -> None:
    env.seed(*standard_world(f.reservation("slot-1", host=HOST), cr_state="pending"))
    out = await place(env.recorder)
    assert out.cr_slot == "no_cr"
    assert env.allocations("slot-1") == {}
    assert env.placement("no_cr") == 1


async def test_missing_knowledge_counts_error_unknown_group(env: Env) -> None:
    env.seed(
        *(o for o in standard_world(f.reservation("slot-1", host=HOST)) if o["kind"] != "Knowledge")
    )
    out = await place(env.recorder)
    assert (out.cr_slot, out.flavor_group) == ("error", "unknown")
    assert env.allocations("slot-1") == {}
    assert env.placement("error", group="unknown") == 1
    assert env.total("cortex_nova_placement") == 1


async def test_knowledge_not_ready_counts_error(env: Env) -> None:
    env.seed(
        *(
            o
            for o in standard_world(f.reservation("slot-1", host=HOST))
            if o["kind"] != "Knowledge"
        ),
        knowledge(is_ready=False),
    )
    request = nova.parse_request(nova.request(UUID, project_id=PROJECT, hosts=[HOST]))
    out = await env.recorder.record_no_host_found(nova.decision(None), request)
    assert (out.cr_slot, out.flavor_group) == ("error", "unknown")
    assert env.no_host_found("error", group="unknown") == 1


async def test_knowledge_turning_ready_is_seen_by_the_next_event(env: Env) -> None:
    """The parsed flavor groups are memoised per Knowledge version: a new version counts."""
    env.seed(*standard_world(f.reservation("slot-1", host=HOST)))
    env.state.put(knowledge(is_ready=False))
    assert (await no_host(env.recorder)).cr_slot == "error"
    env.state.put(knowledge())
    assert (await no_host(env.recorder)).cr_slot == "slot_blocked"


async def test_skip_option_no_write_no_count(env: Env) -> None:
    env.seed(*standard_world(f.reservation("slot-1", host=HOST)))
    out = await place(env.recorder, skip_cr_tracking=True)
    assert (out.cr_slot, out.allocation) == ("skipped", AllocationStatus.NOT_APPLICABLE)
    assert env.allocations("slot-1") == {}
    assert env.total("cortex_nova_placement") == 0
    assert sum(env.state.calls.values()) == 0  # nothing was even read


async def test_skip_option_does_not_apply_to_no_host_found(env: Env) -> None:
    env.seed(*standard_world())
    out = await no_host(env.recorder, skip_cr_tracking=True)
    assert out.cr_slot == "slot_exhausted"
    assert env.no_host_found("slot_exhausted") == 1


# --- placement classes ---------------------------------------------------------------------


async def test_placement_no_cr_when_commitments_exhausted(env: Env) -> None:
    world = standard_world(f.reservation("slot-1", host=HOST))
    world[1] = f.committed_resource("cr-1", project=PROJECT, group=GROUP, amount="8Gi", used="8Gi")
    env.seed(*world)
    out = await place(env.recorder)
    assert out.cr_slot == "no_cr"
    assert env.placement("no_cr") == 1


async def test_placement_slot_used_on_candidate_but_not_target_is_no_slot(env: Env) -> None:
    env.seed(*standard_world(f.reservation("slot-b", host=OTHER)))
    out = await place(env.recorder, target=HOST, candidates=[HOST, OTHER])
    assert (out.cr_slot, out.allocation) == ("slot_used", AllocationStatus.NO_SLOT)
    assert env.allocations("slot-b") == {}
    assert env.placement("slot_used") == 1


async def test_placement_intent_label_from_hints(env: Env) -> None:
    env.seed(*standard_world(f.reservation("slot-1", host=HOST)))
    out = await place(env.recorder, hints={"_nova_check_type": ["live_migrate"]})
    assert out.intent == "live_migration"
    assert env.placement("slot_used", intent="live_migration") == 1


async def test_placement_ignores_other_projects_and_not_ready_slots(env: Env) -> None:
    names = ("slot-other-project", "slot-other-group", "slot-not-ready", "slot-failover")
    env.seed(
        *standard_world(
            f.reservation(names[0], host=HOST, project="p2"),
            f.reservation(names[1], host=HOST, group="g2"),
            f.reservation(names[2], host=HOST, is_ready=False),
            f.reservation(names[3], host=HOST, label="failover"),
        )
    )
    out = await place(env.recorder)
    assert out.cr_slot == "slot_missed"
    for name in names:
        assert env.allocations(name) == {}


# --- no-host-found classes -----------------------------------------------------------------


async def test_no_host_found_no_cr(env: Env) -> None:
    env.seed(*(o for o in standard_world() if o["kind"] != "CommittedResource"))
    out = await no_host(env.recorder)
    assert (out.cr_slot, out.kind, out.target_host) == ("no_cr", "no_host_found", None)
    assert env.no_host_found("no_cr") == 1


async def test_no_host_found_cr_exhausted(env: Env) -> None:
    world = standard_world(f.reservation("slot-1", host=HOST))
    world[1] = f.committed_resource("cr-1", project=PROJECT, group=GROUP, amount="8Gi", used="9Gi")
    env.seed(*world)
    await no_host(env.recorder)
    assert env.no_host_found("cr_exhausted") == 1


async def test_no_host_found_slot_exhausted(env: Env) -> None:
    full = f.reservation("slot-1", host=HOST, memory="4Gi", allocations={"x": f.allocation("4Gi")})
    env.seed(*standard_world(full, f.reservation("slot-2", host="host-c")))
    await no_host(env.recorder, hosts=[HOST, OTHER])  # slot-2 has room, but not on an input host
    assert env.no_host_found("slot_exhausted") == 1


async def test_no_host_found_slot_blocked(env: Env) -> None:
    env.seed(*standard_world(f.reservation("slot-1", host=OTHER)))
    out = await no_host(env.recorder, hosts=[HOST, OTHER])
    assert out.cr_slot == "slot_blocked"
    assert out.vm_memory_bytes == 4 << 30
    assert env.no_host_found("slot_blocked") == 1
    assert env.total("cortex_nova_no_host_found") == 1


async def test_no_host_found_slot_exhausted_when_host_has_no_free_memory(env: Env) -> None:
    world = [
        o for o in standard_world(f.reservation("slot-1", host=HOST)) if o["kind"] != "Hypervisor"
    ]
    env.seed(*world, f.hypervisor(HOST, memory="16Gi", allocated="12Gi"))
    await no_host(env.recorder, flavor="m1.xlarge")
    assert env.no_host_found("slot_exhausted") == 1


async def test_no_host_found_payg_not_counted(env: Env) -> None:
    env.seed(*standard_world())
    out = await no_host(env.recorder, flavor="nope")
    assert out.cr_slot == "payg"
    assert env.total("cortex_nova_no_host_found") == 0


class _BindSpy:
    """The recorder's module logger, counting binds (each builds a bound logger: 1.1 µs
    of a routine event) and keeping the lines written."""

    def __init__(self) -> None:
        self.binds = 0
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def bind(self, **context: Any) -> Any:
        self.binds += 1
        spy = self

        class Bound:
            def error(self, event: str, **kw: Any) -> None:
                spy.lines.append((event, {**context, **kw}))

            debug = error

        return Bound()


async def test_a_no_host_found_event_binds_a_logger_only_to_write_a_line(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = _BindSpy()
    monkeypatch.setattr(recorder_module, "_log", spy)
    env.seed(*standard_world(f.reservation("slot-1", host="elsewhere")))
    assert (await no_host(env.recorder)).cr_slot == "slot_exhausted"
    assert (await no_host(env.recorder, flavor="nope")).cr_slot == "payg"
    assert spy.binds == 0
    env.seed(knowledge(is_ready=False))  # the lookup fails: an error line, with the event
    assert (await no_host(env.recorder)).cr_slot == "error"
    assert spy.binds == 1
    assert spy.lines[0][0] == "flavor_group_lookup_failed"
    assert (spy.lines[0][1]["instance_uuid"], spy.lines[0][1]["project_id"]) == (UUID, PROJECT)


# --- concurrency: 409s and 404s between read and patch -----------------------------------


class BarrierState:
    """Delegates to the fake; every writer waits at the barrier after its snapshot, so
    all of them decide on the same data (the worst case for the write guard)."""

    def __init__(self, inner: InMemoryClusterState, parties: int) -> None:
        self.inner = inner
        self.barrier = asyncio.Barrier(parties)

    async def snapshot(self, hosts: Any, project_id: str) -> Snapshot:
        snap = await self.inner.snapshot(hosts, project_id)
        await self.barrier.wait()
        return snap

    async def reservations_on_host(self, host: str) -> Sequence[Reservation]:
        return await self.inner.reservations_on_host(host)

    async def get_reservation(self, name: str) -> Reservation | None:
        return await self.inner.get_reservation(name)

    async def patch_allocation(
        self, reservation: Reservation, instance_uuid: str, allocation: dict[str, object]
    ) -> Reservation:
        return await self.inner.patch_allocation(reservation, instance_uuid, allocation)


async def test_race_eight_writers_two_slots(env: Env) -> None:
    env.seed(
        *standard_world(
            f.reservation("slot-1", host=HOST, memory="8Gi"),
            f.reservation("slot-2", host=HOST, memory="8Gi"),
        )
    )
    gated = BarrierState(env.state, 8)
    # Eight writers as eight replicas would be: only the resourceVersion guard between them.
    recs = [env.recorder_on(gated) for _ in range(8)]
    uuids = [f"vm-{i}" for i in range(8)]

    outs = await asyncio.gather(*(place(r, uuid=u) for r, u in zip(recs, uuids, strict=True)))

    slots = {n: env.allocations(n) for n in ("slot-1", "slot-2")}
    placed = [u for allocs in slots.values() for u in allocs]
    assert len(placed) == 4
    assert len(set(placed)) == 4, "a VM appears in two slots"
    for name, allocs in slots.items():
        used = sum(parse_quantity(a["resources"]["memory"]).value() for a in allocs.values())
        assert used <= 8 << 30, f"{name} overfilled: {used}"
    assert sorted(o.allocation.value for o in outs) == ["no_slot"] * 4 + ["written"] * 4
    for o in outs:
        if o.allocation is AllocationStatus.WRITTEN:
            assert o.instance_uuid in slots[o.reservation or ""]
    assert sum(o.conflicts for o in outs) >= 1
    assert env.state.patch_results["409"] >= 1
    assert env.state.patch_results["200"] == 4
    assert env.placement("slot_used") == 8


async def test_one_replica_serialises_placements_per_host_without_conflicts(env: Env) -> None:
    env.seed(
        *standard_world(
            f.reservation("slot-1", host=HOST, memory="8Gi"),
            f.reservation("slot-2", host=HOST, memory="8Gi"),
        )
    )
    outs = await asyncio.gather(*(place(env.recorder, uuid=f"vm-{i}") for i in range(12)))
    statuses = sorted((o.cr_slot, o.allocation.value) for o in outs)
    assert statuses == [("slot_missed", "not_applicable")] * 8 + [("slot_used", "written")] * 4
    assert sum(o.conflicts for o in outs) == 0
    assert env.state.patch_results["409"] == 0


async def test_without_the_host_lock_one_replica_still_never_overfills(env: Env) -> None:
    """serialize_per_host=False: the same burst races inside one process; the guard holds."""
    env.seed(*standard_world(f.reservation("slot-1", host=HOST, memory="8Gi")))
    rec = env.recorder_on(env.state, serialize_per_host=False)
    outs = await asyncio.gather(*(place(rec, uuid=f"vm-{i}") for i in range(6)))
    assert set(env.allocations("slot-1")) == {
        o.instance_uuid for o in outs if o.allocation is AllocationStatus.WRITTEN
    }
    assert len(env.allocations("slot-1")) == 2


async def test_a_vm_written_into_a_sibling_slot_meanwhile_is_found_after_a_conflict(
    env: Env,
) -> None:
    env.seed(
        *standard_world(
            f.reservation("slot-1", host=HOST, memory="8Gi"),
            f.reservation("slot-2", host=HOST, memory="16Gi"),
        )
    )

    async def race(res: Reservation, n: int) -> None:
        if n == 1:
            assert res.name == "slot-1"
            other = {"creationTimestamp": "2026-01-01T00:00:00Z", "resources": {"memory": "1Gi"}}
            for name, vm in (("slot-1", "someone-else"), ("slot-2", UUID)):
                crr = {"committedResourceReservation": {"allocations": {vm: other}}}
                env.state.patch("Reservation", name, {"spec": crr})

    env.state.before_patch = race
    out = await place(env.recorder)
    assert (out.allocation, out.reservation) == (AllocationStatus.ALREADY_PRESENT, "slot-2")
    assert out.conflicts >= 1
    assert UUID not in env.allocations("slot-1")


async def test_reservation_deleted_between_read_and_patch_moves_to_other_slot(env: Env) -> None:
    env.seed(
        *standard_world(
            f.reservation("slot-a", host=HOST, memory="8Gi"),
            f.reservation("slot-b", host=HOST, memory="16Gi"),
        )
    )

    async def delete_first(res: Reservation, n: int) -> None:
        if n == 1:
            assert res.name == "slot-a"  # tightest fit is chosen first
            env.state.delete("Reservation", res.name)

    env.state.before_patch = delete_first
    out = await place(env.recorder)
    assert (out.allocation, out.reservation) == (AllocationStatus.WRITTEN, "slot-b")
    assert out.conflicts >= 1
    assert UUID in env.allocations("slot-b")
    assert env.state.patch_results == {"404": 1, "200": 1}


async def test_only_slot_deleted_between_read_and_patch_is_no_slot(env: Env) -> None:
    env.seed(*standard_world(f.reservation("slot-a", host=HOST)))

    async def delete(res: Reservation, n: int) -> None:
        env.state.delete("Reservation", res.name)

    env.state.before_patch = delete
    out = await place(env.recorder)
    assert (out.allocation, out.reservation) == (AllocationStatus.NO_SLOT, None)
    assert out.conflicts >= 1
    assert env.state.stored("Reservation", "slot-a") is None


async def test_slot_moved_to_another_host_between_read_and_patch_is_no_slot(env: Env) -> None:
    env.seed(*standard_world(f.reservation("slot-a", host=HOST)))

    async def move(res: Reservation, n: int) -> None:
        if n == 1:
            env.state.patch("Reservation", res.name, {"spec": {"targetHost": OTHER}})

    env.state.before_patch = move
    out = await place(env.recorder)
    assert (out.allocation, out.reservation) == (AllocationStatus.NO_SLOT, None)
    assert env.allocations("slot-a") == {}


async def test_conflict_then_uuid_found_by_reread_is_already_present(env: Env) -> None:
    env.seed(*standard_world(f.reservation("slot-a", host=HOST)))

    async def other_writer(res: Reservation, n: int) -> None:
        if n == 1:
            crr = {"committedResourceReservation": {"allocations": {UUID: f.allocation("4Gi")}}}
            env.state.patch("Reservation", res.name, {"spec": crr})

    env.state.before_patch = other_writer
    out = await place(env.recorder)
    assert (out.allocation, out.reservation) == (AllocationStatus.ALREADY_PRESENT, "slot-a")
    assert out.conflicts >= 1
    assert env.state.patch_results == {"409": 1}


async def test_conflict_then_slot_filled_by_another_writer_is_no_slot(env: Env) -> None:
    env.seed(*standard_world(f.reservation("slot-a", host=HOST, memory="4Gi")))

    async def fill(res: Reservation, n: int) -> None:
        if n == 1:
            crr = {"committedResourceReservation": {"allocations": {"vm-x": f.allocation("4Gi")}}}
            env.state.patch("Reservation", res.name, {"spec": crr})

    env.state.before_patch = fill
    out = await place(env.recorder)
    assert (out.allocation, out.reservation) == (AllocationStatus.NO_SLOT, None)
    assert set(env.allocations("slot-a")) == {"vm-x"}


async def test_a_slot_that_keeps_changing_ends_failed_with_nothing_written(env: Env) -> None:
    env.seed(*standard_world(f.reservation("slot-a", host=HOST)))

    async def touch(res: Reservation, n: int) -> None:
        env.state.patch("Reservation", res.name, {"metadata": {"labels": {"touched": str(n)}}})

    env.state.before_patch = touch
    out = await place(env.recorder_on(env.state, **QUICK_GIVE_UP))
    assert (out.allocation, out.reservation) == (AllocationStatus.FAILED, "slot-a")
    assert out.conflicts >= 1
    assert out.conflicts == env.state.patch_results["409"]
    assert env.state.patch_results["200"] == 0
    assert env.allocations("slot-a") == {}
    assert env.placement("slot_used") == 1


class LaggingCache(InMemoryClusterState):
    """Snapshots from a watch cache that has not seen some writes yet: the ``frozen``
    Reservations are served as they were, fresh reads (GET, the host's list) see the
    truth. ``land_then_time_out``: the next PATCH is applied but its caller times out."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen: dict[str, Reservation] = {}
        self.land_then_time_out = False

    async def snapshot(self, hosts: Collection[str], project_id: str) -> Snapshot:
        real = self._cr_reservations
        self._cr_reservations = lambda: [self.frozen.get(r.name, r) for r in real()]  # type: ignore[method-assign]
        try:
            return await super().snapshot(hosts, project_id)
        finally:
            del self._cr_reservations

    async def patch_allocation(
        self, reservation: Reservation, instance_uuid: str, allocation: dict[str, object]
    ) -> Reservation:
        written = await super().patch_allocation(reservation, instance_uuid, allocation)
        if self.land_then_time_out:
            self.land_then_time_out = False
            raise UnavailableError("timed out", status=None)
        return written


def slots_a_and_b_on(state: InMemoryClusterState) -> Env:
    """An Env on ``state`` with two slots on HOST: slot-a (16Gi) and slot-b (8Gi, the
    tightest fit for the standard VM)."""
    env = Env()
    env.state = state
    env.recorder = env.recorder_on(state)
    env.seed(
        *standard_world(
            f.reservation("slot-a", host=HOST, memory="16Gi"),
            f.reservation("slot-b", host=HOST, memory="8Gi"),
        )
    )
    return env


async def landed_in_slot_b_unseen() -> tuple[Env, LaggingCache]:
    """A placement's PATCH into slot-b (4Gi, the tightest fit next to a 16Gi slot-a)
    landed but answered too late, and the cache has not seen it."""
    env = slots_a_and_b_on(state := LaggingCache())
    before = await state.get_reservation("slot-b")
    assert before is not None
    state.land_then_time_out = True
    with pytest.raises(UnavailableError):
        await place(env.recorder)
    assert UUID in env.allocations("slot-b")
    state.frozen["slot-b"] = before
    return env, state


async def test_a_write_that_timed_out_is_found_by_the_retry_despite_a_lagging_cache() -> None:
    # The PATCH into slot-b landed but answered too late; the retry's snapshot has not
    # seen it, and another VM made slot-a as good a fit meanwhile. Deciding on that
    # snapshot would write the VM into slot-a as well: after a write whose fate is
    # unknown, the host's slots are read fresh before the next decision on it.
    env, state = await landed_in_slot_b_unseen()
    state.patch(
        "Reservation",
        "slot-a",
        {
            "spec": {
                "committedResourceReservation": {"allocations": {"other-vm": f.allocation("8Gi")}}
            }
        },
    )
    out = await place(env.recorder)  # the event, retried
    assert (out.allocation, out.reservation) == (AllocationStatus.ALREADY_PRESENT, "slot-b")
    assert UUID not in env.allocations("slot-a")


class LatePatch(InMemoryClusterState):
    """A PATCH whose caller times out while the request is still on its way: with
    ``hold_next`` set, the next ``patch_allocation`` raises UnavailableError without
    applying anything; :meth:`land_held` applies it later, guard and all, as the API
    server would when the request finally reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.hold_next = False
        self.held: tuple[Reservation, str, dict[str, object]] | None = None

    async def patch_allocation(
        self, reservation: Reservation, instance_uuid: str, allocation: dict[str, object]
    ) -> Reservation:
        if self.hold_next:
            self.hold_next = False
            self.held = (reservation, instance_uuid, allocation)
            raise UnavailableError("patch reservations: timed out", status=None)
        return await super().patch_allocation(reservation, instance_uuid, allocation)

    async def land_held(self) -> Reservation:
        assert self.held is not None, "no PATCH held"
        held, self.held = self.held, None
        return await super().patch_allocation(*held)


def fill_slot_a_to_8gi_left(state: InMemoryClusterState) -> None:
    """Another VM takes 8Gi of the 16Gi slot-a: it now ties with an empty 8Gi slot-b and
    wins the tie by name, so a decision that misses this VM in slot-b picks slot-a."""
    state.patch(
        "Reservation",
        "slot-a",
        {
            "spec": {
                "committedResourceReservation": {"allocations": {"other-vm": f.allocation("8Gi")}}
            }
        },
    )


async def test_a_write_landing_after_its_retry_does_not_put_the_vm_in_two_slots() -> None:
    # The PATCH into slot-b times out while still in flight; the retry's fresh reads show
    # slot-b unchanged and slot-a as good a fit. Writing slot-a, then the original landing
    # on slot-b (its guard still holds) would put the VM into both: the retry must send
    # the same guarded PATCH to slot-b instead, so only one of the two can land.
    env = slots_a_and_b_on(state := LatePatch())
    state.hold_next = True
    with pytest.raises(UnavailableError):
        await place(env.recorder, flavor="m1.xlarge")  # 8Gi, tightest fit: slot-b
    assert state.held is not None
    assert state.held[0].name == "slot-b"
    fill_slot_a_to_8gi_left(state)

    out = await place(env.recorder, flavor="m1.xlarge")  # the event, retried
    with contextlib.suppress(ConflictError):
        await state.land_held()  # the original reaches the API server only now

    holding = [n for n in ("slot-a", "slot-b") if UUID in env.allocations(n)]
    assert holding == ["slot-b"], f"the VM is in {holding}"
    assert (out.allocation, out.reservation) == (AllocationStatus.WRITTEN, "slot-b")
    assert state.patch_results == {"200": 1, "409": 1}  # the re-send won, the original lost


@pytest.mark.parametrize("replay", [True, False])
async def test_a_takeover_fences_the_previous_owners_write_still_in_flight(replay: bool) -> None:
    # Replica A's PATCH into slot-b is on its way (a held connection, a paused process)
    # when A loses the partition. Replica B, another process without A's memory of the
    # write, replays the event; slot-a meanwhile became as good a fit and wins the tie.
    # B's replay fences both candidates first, so A's write, landing only now, fails its
    # guard: the VM is in exactly one slot. Without the fence (a live decision) both land.
    env = slots_a_and_b_on(state := LatePatch())
    state.hold_next = True
    with pytest.raises(UnavailableError):
        await place(env.recorder, flavor="m1.xlarge")  # replica A: slot-b, the answer lost
    assert state.held is not None
    assert state.held[0].name == "slot-b"
    fill_slot_a_to_8gi_left(state)

    replica_b = env.recorder_on(state)
    out = await place(replica_b, flavor="m1.xlarge", replay=replay)
    assert (out.allocation, out.reservation) == (AllocationStatus.WRITTEN, "slot-a")
    if replay:
        with pytest.raises(ConflictError):
            await state.land_held()
        assert state.fence_results == {"200": 2}
    else:
        await state.land_held()
    holding = [n for n in ("slot-a", "slot-b") if UUID in env.allocations(n)]
    assert holding == (["slot-a"] if replay else ["slot-a", "slot-b"])


async def test_a_fence_refused_by_a_concurrent_change_is_retried_on_a_fresh_read() -> None:
    # Cortex (or another replica) writes to a candidate between the replay's read and its
    # fence: the fence is refused, and the slot is re-read and fenced again, since every
    # candidate must be fenced. A slot deleted meanwhile needs no fence.
    env = slots_a_and_b_on(state := InMemoryClusterState())
    real_fence = state.fence_reservation
    touched: list[str] = []

    async def fence_after_a_change(reservation: Reservation) -> Reservation:
        if reservation.name not in touched:
            touched.append(reservation.name)
            if reservation.name == "slot-a":
                state.patch("Reservation", "slot-a", {"metadata": {"labels": {"t": "1"}}})
            else:
                state.delete("Reservation", "slot-b")
        return await real_fence(reservation)

    state.fence_reservation = fence_after_a_change  # type: ignore[method-assign]
    out = await place(env.recorder, replay=True)
    assert (out.allocation, out.reservation) == (AllocationStatus.WRITTEN, "slot-a")
    assert state.fence_results == {"409": 1, "200": 1, "404": 1}  # slot-a twice, slot-b once


async def test_a_slot_that_keeps_changing_fails_the_replay_as_an_outage() -> None:
    # Past the conflict deadline the event is retried whole (an outage), not dead-lettered
    # as a Kubernetes error and not decided without its fence.
    env = slots_a_and_b_on(state := InMemoryClusterState())
    ticks = [0.0]
    rec = env.recorder_on(state, monotonic=lambda: ticks[0], conflict_timeout_s=1.0)
    real_fence = state.fence_reservation

    async def always_changed(reservation: Reservation) -> Reservation:
        state.patch("Reservation", reservation.name, {"metadata": {"labels": {"t": str(ticks)}}})
        ticks[0] += 0.4
        return await real_fence(reservation)

    state.fence_reservation = always_changed  # type: ignore[method-assign]
    with pytest.raises(UnavailableError, match="kept changing while being fenced"):
        await place(rec, replay=True)
    assert state.patch_results == {}


async def test_an_unknown_write_is_not_settled_by_another_vms_placement() -> None:
    # VM 1's PATCH into slot-b landed but answered too late, and the cache has not seen
    # it. VM 2's placement onto the same host in between must not make VM 1's retry
    # forget that its write may have landed: the retry would then decide on the lagging
    # snapshot, pick slot-a and hold VM 1 twice.
    env, state = await landed_in_slot_b_unseen()
    second = await place(env.recorder, uuid="vm-2")
    assert second.allocation is AllocationStatus.WRITTEN
    fill_slot_a_to_8gi_left(state)

    out = await place(env.recorder)  # VM 1's event, retried
    assert (out.allocation, out.reservation) == (AllocationStatus.ALREADY_PRESENT, "slot-b")
    assert UUID not in env.allocations("slot-a")


async def test_a_failed_re_read_cancels_the_others(env: Env) -> None:
    """After a conflict the slots are re-read concurrently; when one read fails the
    event fails, and the reads still running are cancelled rather than left behind."""
    env.seed(
        *standard_world(
            f.reservation("slot-1", host=HOST, memory="8Gi"),
            f.reservation("slot-2", host=HOST, memory="16Gi"),
        )
    )
    failing = UnavailableError("connection reset", status=None)
    cancelled = False

    async def get_reservation(name: str) -> Reservation | None:
        nonlocal cancelled
        if name == "slot-1":
            raise failing
        try:
            await asyncio.Event().wait()  # hangs until cancelled
        except asyncio.CancelledError:
            cancelled = True
            raise
        raise AssertionError("unreachable")

    async def conflict_then_break_reads(res: Reservation, n: int) -> None:
        if n == 1:
            env.state.patch("Reservation", res.name, {"metadata": {"labels": {"touched": "1"}}})
            env.state.get_reservation = get_reservation  # type: ignore[method-assign]

    env.state.before_patch = conflict_then_break_reads
    with pytest.raises(UnavailableError) as raised:
        await place(env.recorder)
    assert raised.value is failing
    assert cancelled, "the hanging re-read of slot-2 was left running"


async def test_snapshot_failure_is_raised_not_swallowed(env: Env) -> None:
    env.seed(*standard_world(f.reservation("slot-1", host=HOST)))
    env.state.read_error = UnavailableError("connection refused", status=None)
    with pytest.raises(UnavailableError):
        await place(env.recorder)
    with pytest.raises(UnavailableError):
        await no_host(env.recorder)
    assert env.total("cortex_nova_placement") == 0
    assert env.total("cortex_nova_no_host_found") == 0


# --- the fake itself keeps the API server's write rules ------------------------------------


async def test_fake_rejects_a_stale_patch_and_bumps_the_resource_version(env: Env) -> None:
    env.seed(f.reservation("slot-a", host=HOST))
    read = await env.state.get_reservation("slot-a")
    assert read is not None
    written = await env.state.patch_allocation(read, "vm-1", f.allocation("1Gi"))
    assert int(written.metadata.resource_version or 0) > int(read.metadata.resource_version or 0)
    with pytest.raises(ConflictError, match="modified") as conflict:
        await env.state.patch_allocation(read, "vm-2", f.allocation("1Gi"))
    assert conflict.value.status == 409
    env.state.delete("Reservation", "slot-a")
    with pytest.raises(NotFoundError, match="not found") as gone:
        await env.state.patch_allocation(written, "vm-2", f.allocation("1Gi"))
    assert gone.value.status == 404


async def test_a_lost_write_is_forgotten_once_it_can_no_longer_land() -> None:
    # Its entry outlived the event (dead-lettered, the PATCH dropped): days later the VM,
    # resized on the same host into another flavor group, got the old group's slot and
    # the old flavor's body re-sent, reported as written for the new group (review).
    t0 = datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC)
    env = Env()
    env.state = state = LatePatch()
    now, ticks = [t0], [0.0]
    rec = Recorder(state, clock=lambda: now[0], monotonic=lambda: ticks[0])
    env.seed(
        *standard_world(
            f.reservation("slot-b", host=HOST, memory="8Gi"),
            f.reservation("slot-g2", host=HOST, group="g2", memory="8Gi"),
            f.committed_resource("cr-2", group="g2", amount="64Gi"),
        )
    )
    state.hold_next = True
    with pytest.raises(UnavailableError):
        await place(rec, flavor="m1.large")  # into slot-b; the answer lost
    state.held = None  # the API server dropped it
    now[0] = t0 + timedelta(days=3)
    ticks[0] += 3 * 86400.0
    out = await place(rec, flavor="other.small")
    assert out.flavor_group == "g2"
    assert UUID not in env.allocations("slot-b")
    assert UUID in env.allocations("slot-g2")


@pytest.mark.parametrize("replay", [True, False])
async def test_a_replay_on_a_lagging_watch_cache_reads_the_host_fresh_before_writing(
    replay: bool,
) -> None:
    """Replica A wrote the VM into slot-y and lost its partition before committing;
    replica B replays the event while its watch lags (it missed slot-y losing an
    allocation, and A's write). Decided on B's cache, the guard let a write to slot-p
    through: the VM in two slots (found by review). As a replay, B reads the host fresh
    first and finds the VM."""
    from service.k8s.cache import WatchClusterState
    from tests.fakes.kube import FakeKube

    env = Env()
    env.seed(
        *standard_world(
            f.reservation(
                "slot-y", host=HOST, memory="8Gi", allocations={"gone": f.allocation("8Gi")}
            ),
            f.reservation("slot-p", host=HOST, memory="16Gi"),
        )
    )
    kube = FakeKube(env.state)  # its watches are silent: B's cache sees nothing after its LIST
    cache_b = WatchClusterState(kube, transport=kube)  # type: ignore[arg-type]
    await cache_b.start()
    assert await cache_b.wait_synced(2)
    try:
        env.state.patch(
            "Reservation",
            "slot-y",
            {"spec": {"committedResourceReservation": {"allocations": {"gone": None}}}},
        )
        written = await place(env.recorder_on(env.state))  # replica A, up to date
        assert (written.allocation, written.reservation) == (AllocationStatus.WRITTEN, "slot-y")
        again = await place(env.recorder_on(cache_b), replay=replay)  # replica B
    finally:
        await cache_b.stop()
    if replay:
        assert (again.allocation, again.reservation) == (AllocationStatus.ALREADY_PRESENT, "slot-y")
        assert UUID not in env.allocations("slot-p")
    else:  # what a live event decides on the lagging cache: why replays read fresh
        assert (again.allocation, again.reservation) == (AllocationStatus.WRITTEN, "slot-p")


# --- the outcome told ahead (ports.OUTCOME_HOOK) ---------------------------------------------


async def _told(env: Env) -> tuple[Outcome, list[Outcome], list[int]]:
    """A placement with OUTCOME_HOOK set: (its outcome, what was told, how many PATCHes
    had been sent at each telling)."""
    told: list[Outcome] = []
    sent_by_then: list[int] = []

    def hook(outcome: Outcome) -> None:
        told.append(outcome)
        sent_by_then.append(sum(env.state.patch_results.values()))

    token = OUTCOME_HOOK.set(hook)
    try:
        out = await place(env.recorder)
    finally:
        OUTCOME_HOOK.reset(token)
    return out, told, sent_by_then


async def test_a_written_placement_is_told_ahead_before_its_write_as_it_ends(env: Env) -> None:
    env.seed(*standard_world(f.reservation("slot-1", host=HOST, memory="8Gi")))
    out, told, sent_by_then = await _told(env)
    assert out.allocation == AllocationStatus.WRITTEN
    assert told == [out]  # equal: the stream layer publishes what it produced ahead
    assert sent_by_then == [0]  # before the PATCH


async def test_a_placement_that_meets_a_conflict_ends_other_than_told(env: Env) -> None:
    env.seed(
        *standard_world(
            f.reservation("slot-a", host=HOST, memory="8Gi"),
            f.reservation("slot-b", host=HOST, memory="16Gi"),
        )
    )

    async def delete_first(res: Reservation, n: int) -> None:
        if n == 1:
            env.state.delete("Reservation", res.name)

    env.state.before_patch = delete_first
    out, told, _ = await _told(env)
    assert (out.reservation, out.conflicts) == ("slot-b", 1)
    assert [t.reservation for t in told] == ["slot-a"]  # only the first write is told
    assert out not in told


async def test_no_write_no_telling(env: Env) -> None:
    env.seed(*standard_world(f.reservation("slot-1", host=HOST, memory="8Gi")))
    await place(env.recorder)  # written; the second event of the VM finds it there
    out, told, _ = await _told(env)
    assert out.allocation == AllocationStatus.ALREADY_PRESENT
    assert told == []
