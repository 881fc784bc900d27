"""The Recorder against a real kube-apiserver: every reference case, plus real races.

Each test seeds the cluster through the admin client, runs the Recorder through the
production list-mode state (KubeClient + ListClusterState), and checks the result the
way an operator would: the stored Reservation and the counter samples.
"""

from __future__ import annotations

import asyncio
import copy
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from kubernetes_asyncio import client
from prometheus_client import CollectorRegistry

from service.crs import Recorder, new_no_host_found_counter, new_placement_counter
from service.crs.outcome import AllocationStatus, Outcome
from service.crs.ports import ClusterState, Snapshot, UnavailableError
from service.k8s import K8sMetrics, KubeClient, ListClusterState
from service.k8s.cache import WatchClusterState
from service.model import Reservation
from service.quantity import parse_quantity
from tests import factories as f
from tests import nova
from tests.conftest import DevStack
from tests.integration.test_crd_compat import PREFIX, install, renamed
from tests.upstream import UPSTREAM_CRDS

HOST = "host-a"
OTHER = "host-b"
PROJECT = "p1"
GROUP = "g1"
UUID = "11111111-2222-3333-4444-555555555555"
NOW = datetime(2026, 12, 2, 10, 11, 12, 987654, tzinfo=UTC)
NOW_TEXT = "2026-12-02T10:11:12Z"


def knowledge(**kwargs: Any) -> dict[str, Any]:
    return f.knowledge(
        [
            f.flavor_group(GROUP, [f.flavor("m1.large", 4096, 2), f.flavor("m1.xlarge", 8192, 4)]),
            f.flavor_group("g2", [f.flavor("other.small", 2048, 1)]),
        ],
        **kwargs,
    )


@dataclass
class Env:
    api: Any
    client: KubeClient
    state: ListClusterState
    registry: CollectorRegistry
    k8s_metrics: K8sMetrics
    recorder: Recorder

    def recorder_on(self, state: ClusterState, **kwargs: Any) -> Recorder:
        """Another Recorder on the same counters, over a (wrapped) state."""
        return Recorder(
            state,
            self.recorder._placement_counter,
            self.recorder._no_host_found_counter,
            clock=lambda: NOW,
            **kwargs,
        )

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

    def k8s_requests(self, verb: str, kind: str, code: str) -> float:
        value = self.registry.get_sample_value(
            "crs_k8s_requests_total", {"verb": verb, "kind": kind, "code": code}
        )
        return value or 0.0


@pytest_asyncio.fixture
async def env(clean_k8s: Any, devstack: DevStack) -> AsyncIterator[Env]:
    registry = CollectorRegistry()
    metrics = K8sMetrics(registry)
    kube = await KubeClient.create(devstack.kubeconfig, metrics=metrics)
    state = ListClusterState(kube)
    recorder = Recorder(
        state,
        new_placement_counter(registry),
        new_no_host_found_counter(registry),
        clock=lambda: NOW,
    )
    try:
        yield Env(clean_k8s, kube, state, registry, metrics, recorder)
    finally:
        await kube.close()


async def seed(api: Any, *objs: dict[str, Any]) -> None:
    await asyncio.gather(*(f.create(api, o) for o in objs))


async def stored(api: Any, name: str) -> dict[str, Any]:
    return await f.get(api, "reservations", name)


def allocations_of(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"].get("committedResourceReservation", {}).get("allocations") or {}


def standard_world(*reservations: dict[str, Any], cr_state: str = "confirmed") -> list[Any]:
    return [
        knowledge(),
        f.committed_resource("cr-1", project=PROJECT, group=GROUP, amount="64Gi", state=cr_state),
        f.hypervisor(HOST),
        f.hypervisor(OTHER),
        *reservations,
    ]


async def place(
    rec: Recorder,
    *,
    uuid: str = UUID,
    target: str = HOST,
    candidates: Sequence[str] | None = None,
    flavor: str = "m1.large",
    **req: Any,
) -> Outcome:
    cands = list(candidates) if candidates is not None else [target]
    request = nova.parse_request(
        nova.request(uuid, project_id=PROJECT, flavor_name=flavor, hosts=cands, **req)
    )
    return await rec.record_placement(nova.decision(target, cands), request)


async def no_host(
    rec: Recorder, *, hosts: Sequence[str] = (HOST,), flavor: str = "m1.large", **req: Any
) -> Outcome:
    request = nova.parse_request(
        nova.request(UUID, project_id=PROJECT, flavor_name=flavor, hosts=hosts, **req)
    )
    return await rec.record_no_host_found(nova.decision(None, []), request)


# --- the reference recorder's cases -------------------------------------------------------


async def test_writes_allocation_into_matching_slot(env: Env) -> None:
    await seed(env.api, *standard_world(f.reservation("slot-1", host=HOST, memory="8Gi")))

    out = await place(env.recorder)

    assert (out.cr_slot, out.allocation, out.reservation) == (
        "slot_used",
        AllocationStatus.WRITTEN,
        "slot-1",
    )
    assert (out.flavor_group, out.vm_memory_bytes, out.conflicts) == (GROUP, 4 << 30, 0)
    obj = await stored(env.api, "slot-1")
    assert allocations_of(obj) == {
        UUID: {"creationTimestamp": NOW_TEXT, "resources": {"memory": "4Gi", "cpu": "2"}}
    }
    assert env.placement("slot_used") == 1
    assert env.total("cortex_nova_placement") == 1
    assert env.k8s_requests("patch", "reservations", "200") == 1


async def test_memory_quantity_is_binary_si_of_the_group_flavor(env: Env) -> None:
    # The request says 1 MiB/1 vCPU; the group flavor (8 GiB, 4 vCPUs) is what counts.
    await seed(env.api, *standard_world(f.reservation("slot-1", host=HOST, memory="16Gi")))
    out = await place(env.recorder, flavor="m1.xlarge", memory_mb=1, vcpus=1)
    assert out.allocation is AllocationStatus.WRITTEN
    alloc = allocations_of(await stored(env.api, "slot-1"))[UUID]
    assert alloc["resources"] == {"memory": "8Gi", "cpu": "4"}


async def test_idempotent_when_uuid_already_allocated(env: Env) -> None:
    await seed(
        env.api,
        *standard_world(
            f.reservation(
                "slot-1", host=HOST, memory="8Gi", allocations={UUID: f.allocation("4Gi")}
            )
        ),
    )
    before = (await stored(env.api, "slot-1"))["metadata"]["resourceVersion"]

    out = await place(env.recorder)

    assert (out.cr_slot, out.allocation, out.reservation) == (
        "slot_used",
        AllocationStatus.ALREADY_PRESENT,
        "slot-1",
    )
    assert (await stored(env.api, "slot-1"))["metadata"]["resourceVersion"] == before
    assert env.k8s_requests("patch", "reservations", "200") == 0
    assert env.placement("slot_used") == 1


async def test_payg_flavor_no_write_no_count(env: Env) -> None:
    await seed(env.api, *standard_world(f.reservation("slot-1", host=HOST)))
    out = await place(env.recorder, flavor="unknown-flavor")
    assert (out.cr_slot, out.flavor_group, out.allocation) == (
        "payg",
        None,
        AllocationStatus.NOT_APPLICABLE,
    )
    assert allocations_of(await stored(env.api, "slot-1")) == {}
    assert env.total("cortex_nova_placement") == 0


async def test_host_mismatch_no_write(env: Env) -> None:
    await seed(env.api, *standard_world(f.reservation("slot-1", host=OTHER)))
    out = await place(env.recorder)
    assert out.cr_slot == "slot_missed"
    assert out.allocation is AllocationStatus.NOT_APPLICABLE
    assert allocations_of(await stored(env.api, "slot-1")) == {}
    assert env.placement("slot_missed") == 1


async def test_full_slot_no_write(env: Env) -> None:
    full = f.reservation(
        "slot-full", host=HOST, memory="4Gi", allocations={"other-vm": f.allocation("4Gi")}
    )
    await seed(env.api, *standard_world(full))
    out = await place(env.recorder)
    assert out.cr_slot == "slot_missed"
    assert set(allocations_of(await stored(env.api, "slot-full"))) == {"other-vm"}
    assert env.placement("slot_missed") == 1


async def test_pending_commitment_no_write(env: Env) -> None:
    await seed(env.api, *standard_world(f.reservation("slot-1", host=HOST), cr_state="pending"))
    out = await place(env.recorder)
    assert out.cr_slot == "no_cr"
    assert allocations_of(await stored(env.api, "slot-1")) == {}
    assert env.placement("no_cr") == 1


async def test_missing_knowledge_counts_error_unknown_group(env: Env) -> None:
    world = [
        o for o in standard_world(f.reservation("slot-1", host=HOST)) if o["kind"] != "Knowledge"
    ]
    await seed(env.api, *world)
    out = await place(env.recorder)
    assert (out.cr_slot, out.flavor_group) == ("error", "unknown")
    assert allocations_of(await stored(env.api, "slot-1")) == {}
    assert env.placement("error", group="unknown") == 1
    assert env.total("cortex_nova_placement") == 1


async def test_knowledge_not_ready_counts_error(env: Env) -> None:
    world = [
        o for o in standard_world(f.reservation("slot-1", host=HOST)) if o["kind"] != "Knowledge"
    ]
    await seed(env.api, *world, knowledge(is_ready=False))
    request = nova.parse_request(nova.request(UUID, project_id=PROJECT, hosts=[HOST]))
    out = await env.recorder.record_no_host_found(nova.decision(None), request)
    assert (out.cr_slot, out.flavor_group) == ("error", "unknown")
    assert env.no_host_found("error", group="unknown") == 1


async def test_skip_option_no_write_no_count(env: Env) -> None:
    await seed(env.api, *standard_world(f.reservation("slot-1", host=HOST)))
    out = await place(env.recorder, skip_cr_tracking=True)
    assert (out.cr_slot, out.allocation) == ("skipped", AllocationStatus.NOT_APPLICABLE)
    assert allocations_of(await stored(env.api, "slot-1")) == {}
    assert env.total("cortex_nova_placement") == 0
    # Nothing was even read: the option is checked first, as in the reference controller.
    assert env.k8s_requests("list", "reservations", "200") == 0


async def test_skip_option_does_not_apply_to_no_host_found(env: Env) -> None:
    await seed(env.api, *standard_world())
    out = await no_host(env.recorder, skip_cr_tracking=True)
    assert out.cr_slot == "slot_exhausted"
    assert env.no_host_found("slot_exhausted") == 1


# --- placement classes ---------------------------------------------------------------------


async def test_placement_no_cr_when_commitments_exhausted(env: Env) -> None:
    world = standard_world(f.reservation("slot-1", host=HOST))
    world[1] = f.committed_resource("cr-1", project=PROJECT, group=GROUP, amount="8Gi", used="8Gi")
    await seed(env.api, *world)
    out = await place(env.recorder)
    assert out.cr_slot == "no_cr"
    assert env.placement("no_cr") == 1


async def test_placement_slot_used_on_candidate_but_not_target_is_no_slot(env: Env) -> None:
    # A candidate had a slot, so the class is slot_used; the target has none: nothing written.
    await seed(env.api, *standard_world(f.reservation("slot-b", host=OTHER)))
    out = await place(env.recorder, target=HOST, candidates=[HOST, OTHER])
    assert (out.cr_slot, out.allocation) == ("slot_used", AllocationStatus.NO_SLOT)
    assert allocations_of(await stored(env.api, "slot-b")) == {}
    assert env.placement("slot_used") == 1


async def test_placement_intent_label_from_hints(env: Env) -> None:
    await seed(env.api, *standard_world(f.reservation("slot-1", host=HOST)))
    out = await place(env.recorder, hints={"_nova_check_type": ["live_migrate"]})
    assert out.intent == "live_migration"
    assert env.placement("slot_used", intent="live_migration") == 1


async def test_placement_ignores_other_projects_and_not_ready_slots(env: Env) -> None:
    await seed(
        env.api,
        *standard_world(
            f.reservation("slot-other-project", host=HOST, project="p2"),
            f.reservation("slot-other-group", host=HOST, group="g2"),
            f.reservation("slot-not-ready", host=HOST, is_ready=False),
            f.reservation("slot-failover", host=HOST, label="failover"),
        ),
    )
    out = await place(env.recorder)
    assert out.cr_slot == "slot_missed"
    for name in ("slot-other-project", "slot-other-group", "slot-not-ready", "slot-failover"):
        assert allocations_of(await stored(env.api, name)) == {}


# --- no-host-found classes -----------------------------------------------------------------


async def test_no_host_found_no_cr(env: Env) -> None:
    world = [o for o in standard_world() if o["kind"] != "CommittedResource"]
    await seed(env.api, *world)
    out = await no_host(env.recorder)
    assert (out.cr_slot, out.kind, out.target_host) == ("no_cr", "no_host_found", None)
    assert env.no_host_found("no_cr") == 1


async def test_no_host_found_cr_exhausted(env: Env) -> None:
    world = standard_world(f.reservation("slot-1", host=HOST))
    world[1] = f.committed_resource("cr-1", project=PROJECT, group=GROUP, amount="8Gi", used="9Gi")
    await seed(env.api, *world)
    await no_host(env.recorder)
    assert env.no_host_found("cr_exhausted") == 1


async def test_no_host_found_slot_exhausted(env: Env) -> None:
    full = f.reservation("slot-1", host=HOST, memory="4Gi", allocations={"x": f.allocation("4Gi")})
    await seed(env.api, *standard_world(full, f.reservation("slot-2", host="host-c")))
    # slot-2 has room but host-c is not an input host.
    await no_host(env.recorder, hosts=[HOST, OTHER])
    assert env.no_host_found("slot_exhausted") == 1


async def test_no_host_found_slot_blocked(env: Env) -> None:
    await seed(env.api, *standard_world(f.reservation("slot-1", host=OTHER)))
    out = await no_host(env.recorder, hosts=[HOST, OTHER])
    assert out.cr_slot == "slot_blocked"
    assert out.vm_memory_bytes == 4 << 30
    assert env.no_host_found("slot_blocked") == 1
    assert env.total("cortex_nova_no_host_found") == 1


async def test_no_host_found_slot_exhausted_when_host_has_no_free_memory(env: Env) -> None:
    # The slot has room, but the host's free memory minus all slot blocks cannot take it.
    world = [
        o for o in standard_world(f.reservation("slot-1", host=HOST)) if o["kind"] != "Hypervisor"
    ]
    await seed(env.api, *world, f.hypervisor(HOST, memory="16Gi", allocated="12Gi"))
    await no_host(env.recorder, flavor="m1.xlarge")
    assert env.no_host_found("slot_exhausted") == 1


async def test_no_host_found_payg_not_counted(env: Env) -> None:
    await seed(env.api, *standard_world())
    out = await no_host(env.recorder, flavor="nope")
    assert out.cr_slot == "payg"
    assert env.total("cortex_nova_no_host_found") == 0


# --- the written object is valid upstream ----------------------------------------------------


@pytest_asyncio.fixture
async def upstream_reservations(env: Env) -> AsyncIterator[Env]:
    path = UPSTREAM_CRDS.path() / "cortex.cloud_reservations.yaml"
    await install(env.api, renamed(yaml.safe_load(path.read_text())))
    yield env
    await client.CustomObjectsApi(env.api).delete_collection_cluster_custom_object(
        PREFIX + "cortex.cloud", "v1alpha1", "reservations"
    )


async def test_written_object_passes_upstream_schema(upstream_reservations: Env) -> None:
    env = upstream_reservations
    await seed(env.api, *standard_world(f.reservation("slot-1", host=HOST)))
    out = await place(env.recorder)
    assert out.allocation is AllocationStatus.WRITTEN

    obj = await stored(env.api, "slot-1")
    copy_ = {
        "apiVersion": "cortex.cloud/v1alpha1",
        "kind": "Reservation",
        "metadata": {"name": "slot-1", "labels": obj["metadata"]["labels"]},
        "spec": copy.deepcopy(obj["spec"]),
        "status": copy.deepcopy(obj["status"]),
    }
    accepted = await f.create(env.api, copy_, group=PREFIX + "cortex.cloud")
    assert allocations_of(accepted) == allocations_of(obj)
    assert allocations_of(accepted)[UUID]["creationTimestamp"] == NOW_TEXT


# --- concurrency: real 409s on the real server --------------------------------------------


class GatedState:
    """Delegates to a real state; lets a test act at chosen points of the protocol."""

    def __init__(self, inner: ClusterState) -> None:
        self.inner = inner
        self.barrier: asyncio.Barrier | None = None
        self.before_patch: Any = None
        self.patches = 0

    async def snapshot(self, hosts: Collection[str], project_id: str) -> Snapshot:
        snap = await self.inner.snapshot(hosts, project_id)
        if self.barrier is not None:
            await self.barrier.wait()  # every writer decides on the same data
        return snap

    async def reservations_on_host(self, host: str) -> Sequence[Reservation]:
        return await self.inner.reservations_on_host(host)

    async def get_reservation(self, name: str) -> Reservation | None:
        return await self.inner.get_reservation(name)

    async def patch_allocation(
        self, reservation: Reservation, instance_uuid: str, allocation: dict[str, object]
    ) -> Reservation:
        self.patches += 1
        if self.before_patch is not None:
            await self.before_patch(reservation, self.patches)
        return await self.inner.patch_allocation(reservation, instance_uuid, allocation)


async def test_race_eight_writers_two_slots(env: Env) -> None:
    await seed(
        env.api,
        *standard_world(
            f.reservation("slot-1", host=HOST, memory="8Gi"),
            f.reservation("slot-2", host=HOST, memory="8Gi"),
        ),
    )
    gated = GatedState(env.state)
    gated.barrier = asyncio.Barrier(8)
    # Eight writers as eight replicas would be: each its own Recorder, so only the
    # resourceVersion guard stands between them.
    recs = [env.recorder_on(gated) for _ in range(8)]
    uuids = [f"vm-{i}" for i in range(8)]

    outs = await asyncio.gather(*(place(r, uuid=u) for r, u in zip(recs, uuids, strict=True)))

    slots = {n: allocations_of(await stored(env.api, n)) for n in ("slot-1", "slot-2")}
    placed = [u for allocs in slots.values() for u in allocs]
    assert len(placed) == 4
    assert len(set(placed)) == 4, "a VM appears in two slots"
    for name, allocs in slots.items():
        used = sum(parse_quantity(a["resources"]["memory"]).value() for a in allocs.values())
        assert used <= 8 << 30, f"{name} overfilled: {used}"
    statuses = sorted(o.allocation.value for o in outs)
    assert statuses == ["no_slot"] * 4 + ["written"] * 4
    for o in outs:
        if o.allocation is AllocationStatus.WRITTEN:
            assert o.instance_uuid in slots[o.reservation or ""]
    assert sum(o.conflicts for o in outs) >= 1
    assert env.k8s_requests("patch", "reservations", "409") >= 1
    assert env.k8s_requests("patch", "reservations", "200") == 4
    assert env.placement("slot_used") == 8


async def test_one_replica_serialises_placements_per_host_without_conflicts(env: Env) -> None:
    """Within one process, concurrent partitions placing onto one host take turns: each
    decision sees the previous write, so a burst never exhausts the conflict budget."""
    await seed(
        env.api,
        *standard_world(
            f.reservation("slot-1", host=HOST, memory="8Gi"),
            f.reservation("slot-2", host=HOST, memory="8Gi"),
        ),
    )
    rec = env.recorder_on(env.state)
    outs = await asyncio.gather(*(place(rec, uuid=f"vm-{i}") for i in range(12)))
    # Four fit; each later decision already sees the slots full (slot_missed).
    statuses = sorted((o.cr_slot, o.allocation.value) for o in outs)
    assert statuses == [("slot_missed", "not_applicable")] * 8 + [("slot_used", "written")] * 4
    assert sum(o.conflicts for o in outs) == 0
    assert env.k8s_requests("patch", "reservations", "409") == 0


async def test_a_vm_written_into_a_sibling_slot_meanwhile_is_found_after_a_conflict(
    env: Env,
) -> None:
    """Another writer puts this VM into slot-2 while we conflict on slot-1: the re-read
    covers every candidate, so the VM is reported already present, not written twice."""
    await seed(
        env.api,
        *standard_world(
            f.reservation("slot-1", host=HOST, memory="8Gi"),
            f.reservation("slot-2", host=HOST, memory="16Gi"),
        ),
    )
    gated = GatedState(env.state)
    co = client.CustomObjectsApi(env.api)

    async def race(res: Reservation, n: int) -> None:
        if n == 1:
            assert res.name == "slot-1"
            other = {"creationTimestamp": "2026-01-01T00:00:00Z", "resources": {"memory": "1Gi"}}
            for name, vm in (("slot-1", "someone-else"), ("slot-2", UUID)):
                await co.patch_cluster_custom_object(
                    *f.RES,
                    name,
                    {"spec": {"committedResourceReservation": {"allocations": {vm: other}}}},
                    _content_type="application/merge-patch+json",
                )

    gated.before_patch = race
    out = await place(env.recorder_on(gated))
    assert (out.allocation, out.reservation, out.conflicts) == (
        AllocationStatus.ALREADY_PRESENT,
        "slot-2",
        1,
    )
    assert UUID not in allocations_of(await stored(env.api, "slot-1"))


async def test_reservation_deleted_between_read_and_patch_moves_to_other_slot(env: Env) -> None:
    await seed(
        env.api,
        *standard_world(
            f.reservation("slot-a", host=HOST, memory="8Gi"),
            f.reservation("slot-b", host=HOST, memory="16Gi"),
        ),
    )
    gated = GatedState(env.state)
    co = client.CustomObjectsApi(env.api)

    async def delete_first(res: Reservation, n: int) -> None:
        if n == 1:
            assert res.name == "slot-a"  # tightest fit is chosen first
            await co.delete_cluster_custom_object(*f.RES, res.name)

    gated.before_patch = delete_first
    out = await place(env.recorder_on(gated))

    assert (out.allocation, out.reservation, out.conflicts) == (
        AllocationStatus.WRITTEN,
        "slot-b",
        1,
    )
    assert UUID in allocations_of(await stored(env.api, "slot-b"))
    assert env.k8s_requests("patch", "reservations", "404") == 1


async def test_only_slot_deleted_between_read_and_patch_is_no_slot(env: Env) -> None:
    await seed(env.api, *standard_world(f.reservation("slot-a", host=HOST)))
    gated = GatedState(env.state)
    co = client.CustomObjectsApi(env.api)

    async def delete(res: Reservation, n: int) -> None:
        await co.delete_cluster_custom_object(*f.RES, res.name)

    gated.before_patch = delete
    out = await place(env.recorder_on(gated))
    assert (out.allocation, out.reservation, out.conflicts) == (AllocationStatus.NO_SLOT, None, 1)


async def test_only_slot_deleted_is_no_slot_on_the_watch_cache_too(env: Env) -> None:
    # The same in watch mode, once the watch has delivered the delete: the host has no
    # cached slot left to read fresh. That empty read raised ValueError (asyncio.wait
    # refuses an empty set) and the placement became an internal_error dead letter.
    await seed(env.api, *standard_world(f.reservation("slot-a", host=HOST)))
    cache = WatchClusterState(env.client)
    await cache.start()
    try:
        assert await cache.wait_synced(10.0)
        gated = GatedState(cache)
        co = client.CustomObjectsApi(env.api)

        async def delete(res: Reservation, n: int) -> None:
            await co.delete_cluster_custom_object(*f.RES, res.name)
            deadline = asyncio.get_running_loop().time() + 10
            while cache.reservations.get(res.name) is not None:
                assert asyncio.get_running_loop().time() < deadline, "delete not watched"
                await asyncio.sleep(0.02)

        gated.before_patch = delete
        out = await place(env.recorder_on(gated))
        assert (out.allocation, out.reservation, out.conflicts) == (
            AllocationStatus.NO_SLOT,
            None,
            1,
        )
    finally:
        await cache.stop()


async def test_conflict_then_uuid_found_by_reread_is_already_present(env: Env) -> None:
    # Another writer (e.g. a replay on another consumer) stores this VM first.
    await seed(env.api, *standard_world(f.reservation("slot-a", host=HOST)))
    gated = GatedState(env.state)
    co = client.CustomObjectsApi(env.api)

    async def other_writer(res: Reservation, n: int) -> None:
        if n == 1:
            patch = {
                "spec": {
                    "committedResourceReservation": {"allocations": {UUID: f.allocation("4Gi")}}
                }
            }
            await co.patch_cluster_custom_object(
                *f.RES, res.name, patch, _content_type="application/merge-patch+json"
            )

    gated.before_patch = other_writer
    out = await place(env.recorder_on(gated))
    assert (out.allocation, out.reservation, out.conflicts) == (
        AllocationStatus.ALREADY_PRESENT,
        "slot-a",
        1,
    )
    assert gated.patches == 1


async def test_slot_moved_to_another_host_between_read_and_patch_is_no_slot(env: Env) -> None:
    await seed(env.api, *standard_world(f.reservation("slot-a", host=HOST)))
    gated = GatedState(env.state)
    co = client.CustomObjectsApi(env.api)

    async def move(res: Reservation, n: int) -> None:
        if n == 1:
            await co.patch_cluster_custom_object(
                *f.RES,
                res.name,
                {"spec": {"targetHost": OTHER}},
                _content_type="application/merge-patch+json",
            )

    gated.before_patch = move
    out = await place(env.recorder_on(gated))
    assert (out.allocation, out.reservation) == (AllocationStatus.NO_SLOT, None)
    assert allocations_of(await stored(env.api, "slot-a")) == {}


async def test_conflict_then_slot_filled_by_another_writer_is_no_slot(env: Env) -> None:
    await seed(env.api, *standard_world(f.reservation("slot-a", host=HOST, memory="4Gi")))
    gated = GatedState(env.state)
    co = client.CustomObjectsApi(env.api)

    async def fill(res: Reservation, n: int) -> None:
        if n == 1:
            crr = {"committedResourceReservation": {"allocations": {"vm-x": f.allocation("4Gi")}}}
            await co.patch_cluster_custom_object(
                *f.RES, res.name, {"spec": crr}, _content_type="application/merge-patch+json"
            )

    gated.before_patch = fill
    out = await place(env.recorder_on(gated))
    assert (out.allocation, out.reservation) == (AllocationStatus.NO_SLOT, None)
    assert set(allocations_of(await stored(env.api, "slot-a"))) == {"vm-x"}


# --- a PATCH that reaches the server after its client gave up ------------------------------


class HoldingProxy:
    """A TCP proxy to the API server that can hold back one request until told.

    TLS passes through untouched (the client still verifies the API server's certificate,
    which covers 127.0.0.1 on any port). After :meth:`hold`, the bytes the client sends
    within ``_REQUEST_WINDOW_S`` are kept, not forwarded, and anything after them (the
    client closing the connection when it times out) is dropped: the connection to the
    server stays open. :meth:`release` then forwards the kept bytes, so the server gets
    the request whole, long after its client stopped waiting: a request still in flight
    when its client timed out. ``answered`` is set when the server responds to it.
    """

    _REQUEST_WINDOW_S = 0.3  # well below the client's 1 s timeout

    def __init__(self, upstream: tuple[str, int]) -> None:
        self._upstream = upstream
        self.connections = 0
        self.held = bytearray()
        self.answered = asyncio.Event()
        self._holding = False
        self._held_since: float | None = None
        self._held_to: asyncio.StreamWriter | None = None
        self._released = False
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def __aenter__(self) -> HoldingProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._writers:
            writer.close()
        await self._server.wait_closed()

    def hold(self) -> None:
        self._holding = True

    async def release(self) -> None:
        assert self._held_to is not None, "nothing was held"
        self._released = True
        self._held_to.write(bytes(self.held))
        await self._held_to.drain()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        server_r, server_w = await asyncio.open_connection(*self._upstream)
        self._writers += [client_w, server_w]
        for pipe in (self._to_server(client_r, server_w), self._to_client(server_r, client_w)):
            task = asyncio.create_task(pipe)
            self._tasks.add(task)

    async def _to_server(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while chunk := await reader.read(65536):
            if not self._holding:
                writer.write(chunk)
                await writer.drain()
                continue
            if self._held_since is None:
                self._held_since, self._held_to = loop.time(), writer
            if writer is self._held_to and loop.time() - self._held_since < self._REQUEST_WINDOW_S:
                self.held += chunk
        # The client is gone; the server side stays open for the held request's answer.

    async def _to_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while chunk := await reader.read(65536):
            if self._released:
                self.answered.set()
            if not writer.is_closing():
                writer.write(chunk)


class FirstPatchVia(GatedState):
    """Reads and later writes go to ``inner``; the first PATCH goes through ``first``,
    right after ``before_first()`` is called."""

    def __init__(self, inner: ClusterState, first: ClusterState, before_first: Any) -> None:
        super().__init__(inner)
        self.first = first
        self.before_first = before_first

    async def patch_allocation(
        self, reservation: Reservation, instance_uuid: str, allocation: dict[str, object]
    ) -> Reservation:
        self.patches += 1
        if self.patches > 1:
            return await self.inner.patch_allocation(reservation, instance_uuid, allocation)
        self.before_first()
        return await self.first.patch_allocation(reservation, instance_uuid, allocation)


async def test_a_patch_landing_after_its_retry_leaves_the_vm_in_one_slot(
    env: Env, devstack: DevStack, tmp_path: Path
) -> None:
    """The first PATCH (into slot-b) reaches the API server only after its client timed
    out and the event's retry has run; meanwhile another VM made slot-a as good a fit.
    The retry must not write slot-a: the late PATCH, whose guard slot-b still satisfies,
    would then land too. The VM ends up in exactly one slot."""
    await seed(
        env.api,
        *standard_world(
            f.reservation("slot-a", host=HOST, memory="16Gi"),
            f.reservation("slot-b", host=HOST, memory="8Gi"),
        ),
    )
    kubeconfig = Path(devstack.kubeconfig).read_text()
    server = re.search(r"server: https://([^:\s]+):(\d+)", kubeconfig)
    assert server is not None
    async with HoldingProxy((server.group(1), int(server.group(2)))) as proxy:
        proxied = tmp_path / "kubeconfig"
        proxied.write_text(
            kubeconfig.replace(server.group(0), f"server: https://127.0.0.1:{proxy.port}")
        )
        far = await KubeClient.create(str(proxied), request_timeout_s=1.0)
        try:
            assert await far.get_reservation("slot-b") is not None  # a warm connection
            rec = env.recorder_on(FirstPatchVia(env.state, ListClusterState(far), proxy.hold))
            with pytest.raises(UnavailableError, match="timed out"):
                await place(rec, flavor="m1.xlarge")  # 8Gi, tightest fit: slot-b
            assert proxy.connections == 1, "the PATCH did not go over the warm connection"
            assert proxy.held, "nothing was held"
            # Another VM takes 8Gi of slot-a: it now ties with the empty slot-b and wins
            # the tie by name, so a decision that ignores the PATCH in flight picks it.
            other = {"allocations": {"other-vm": f.allocation("8Gi")}}
            await client.CustomObjectsApi(env.api).patch_cluster_custom_object(
                *f.RES,
                "slot-a",
                {"spec": {"committedResourceReservation": other}},
                _content_type="application/merge-patch+json",
            )

            out = await place(rec, flavor="m1.xlarge")  # the event, retried
            await proxy.release()
            await asyncio.wait_for(proxy.answered.wait(), 10)
        finally:
            await far.close()

    holding = [n for n in ("slot-a", "slot-b") if UUID in allocations_of(await stored(env.api, n))]
    assert holding == ["slot-b"], f"the VM is in {holding}"
    assert (out.allocation, out.reservation) == (AllocationStatus.WRITTEN, "slot-b")


async def test_knowledge_turning_ready_is_seen_by_the_next_event(env: Env) -> None:
    """The parsed flavor groups are memoised per Knowledge version: a new version counts."""
    world = [
        o for o in standard_world(f.reservation("slot-1", host=HOST)) if o["kind"] != "Knowledge"
    ]
    await seed(env.api, *world, knowledge(is_ready=False))
    assert (await no_host(env.recorder)).cr_slot == "error"
    co = client.CustomObjectsApi(env.api)
    await co.patch_cluster_custom_object_status(
        *f.KN,
        "flavor-groups",
        {"status": {"conditions": f.ready("True")}},
        _content_type="application/merge-patch+json",
    )
    assert (await no_host(env.recorder)).cr_slot == "slot_blocked"


async def test_conflicts_exhausted_is_failed(env: Env) -> None:
    await seed(env.api, *standard_world(f.reservation("slot-a", host=HOST)))
    gated = GatedState(env.state)
    co = client.CustomObjectsApi(env.api)

    async def touch(res: Reservation, n: int) -> None:
        patch = {"metadata": {"labels": {"touched": str(n)}}}
        await co.patch_cluster_custom_object(
            *f.RES, res.name, patch, _content_type="application/merge-patch+json"
        )

    gated.before_patch = touch
    out = await place(env.recorder_on(gated, max_conflict_retries=2, backoff_s=0.001))
    assert (out.allocation, out.reservation, out.conflicts) == (
        AllocationStatus.FAILED,
        "slot-a",
        3,
    )
    assert gated.patches == 3
    assert allocations_of(await stored(env.api, "slot-a")) == {}
    assert env.k8s_requests("patch", "reservations", "409") == 3


async def test_snapshot_failure_is_raised_not_swallowed(env: Env, unused_port: int) -> None:
    await seed(env.api, *standard_world(f.reservation("slot-1", host=HOST)))
    dead = KubeClient.from_token(
        f"https://127.0.0.1:{unused_port}", None, "x", request_timeout_s=1.0
    )
    try:
        rec = env.recorder_on(ListClusterState(dead))
        with pytest.raises(UnavailableError):
            await place(rec)
        with pytest.raises(UnavailableError):
            await no_host(rec)
    finally:
        await dead.close()
    assert env.total("cortex_nova_placement") == 0
    assert env.total("cortex_nova_no_host_found") == 0


@pytest.fixture
def unused_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_recorder_imports_no_client_library() -> None:
    """The Recorder sees only the ClusterState protocol: no Kubernetes or Kafka client."""
    code = (
        "import sys, service.crs.recorder; "
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('kubernetes_asyncio', 'aiokafka', 'aiohttp') or m.startswith('service.k8s')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
