"""The watch cache (``CRS_K8S_READ_MODE=watch``) against the real kube-apiserver.

Other test modules share the API server and may run at the same time, so these tests
never wipe the cluster (no ``clean_k8s``): every object carries a per-test prefix, every
assertion is about the test's own hosts and project, and each test deletes what it made.
The one shared object is ``Knowledge/flavor-groups`` (a singleton by name); tests that
need it install the same content the Recorder tests use.

The informers list and watch through :class:`Faults`, the real client with two faults
a test can inject: abort a live watch's TCP connection (a real network failure) and
freeze a kind's watch (new watches wait until thawed). Some tests freeze the
reservations watch: only then is it deterministic that a fresh read can have come from
read-your-writes or a relist, and not from a watch event racing the test.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, TypeVar

import pytest
import pytest_asyncio
import structlog
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from prometheus_client import CollectorRegistry

from service.crs.evaluator import reservation_remaining_memory
from service.crs.outcome import AllocationStatus
from service.crs.ports import Snapshot, UnavailableError
from service.crs.recorder import Recorder
from service.k8s import K8sMetrics, KubeClient, ListClusterState
from service.k8s.cache import WatchClusterState
from service.k8s.client import K8sObject, ListResult, ResourceKind, WatchEvent, WatchStream
from service.k8s.informer import Informer, is_newer
from tests import factories as f
from tests import nova
from tests.conftest import DevStack

GI = 1024**3
GROUP = "g1"
MERGE = "application/merge-patch+json"
V = TypeVar("V")
L = TypeVar("L")
Obj = TypeVar("Obj", bound=K8sObject)


def knowledge() -> dict[str, Any]:
    """The flavor groups the Recorder tests install too (so concurrent runs agree)."""
    return f.knowledge(
        [
            f.flavor_group(GROUP, [f.flavor("m1.large", 4096, 2), f.flavor("m1.xlarge", 8192, 4)]),
            f.flavor_group("g2", [f.flavor("other.small", 2048, 1)]),
        ]
    )


# --- plumbing ---------------------------------------------------------------------------


class Cluster:
    """Creates, patches and deletes the test's own objects through the admin client."""

    def __init__(self, api: Any) -> None:
        self.api = api
        self.co = client.CustomObjectsApi(api)
        self.prefix = f"wc{uuid.uuid4().hex[:6]}"
        self.made: list[tuple[str, str]] = []

    def n(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    async def create(self, *objs: dict[str, Any]) -> None:
        for obj in objs:
            self.made.append((f.gvp_of(obj)[2], obj["metadata"]["name"]))
        await asyncio.gather(*(f.create(self.api, o) for o in objs))

    async def patch(self, plural: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        g, v, p = f.PLURAL_TO_GVP[plural]
        out: dict[str, Any] = await self.co.patch_cluster_custom_object(
            g, v, p, name, body, _content_type=MERGE
        )
        return out

    async def patch_status(self, plural: str, name: str, status: dict[str, Any]) -> None:
        g, v, p = f.PLURAL_TO_GVP[plural]
        await self.co.patch_cluster_custom_object_status(
            g, v, p, name, {"status": status}, _content_type=MERGE
        )

    async def delete(self, plural: str, name: str) -> None:
        g, v, p = f.PLURAL_TO_GVP[plural]
        try:
            await self.co.delete_cluster_custom_object(g, v, p, name)
        except ApiException as exc:
            if exc.status != 404:
                raise

    async def ensure_knowledge(self) -> None:
        """Install the shared flavor-groups Knowledge unless an equal one is there."""
        want = knowledge()
        try:
            have = await f.get(self.api, "knowledges", "flavor-groups")
        except ApiException as exc:
            if exc.status != 404:
                raise
            try:
                await f.create(self.api, want)
            except ApiException as exc2:  # created concurrently by another test
                if exc2.status != 409:
                    raise
            return
        if have.get("status", {}).get("raw") != want["status"]["raw"]:
            await self.patch_status("knowledges", "flavor-groups", want["status"])

    async def cleanup(self) -> None:
        await asyncio.gather(*(self.delete(p, n) for p, n in self.made))


async def until(fn: Callable[[], Awaitable[V]], expected: V, within: float = 15.0) -> V:
    """Poll ``fn`` until it returns ``expected``; assert on the last value otherwise."""
    deadline = time.monotonic() + within
    while True:
        value = await fn()
        if value == expected or time.monotonic() > deadline:
            assert value == expected
            return value
        await asyncio.sleep(0.05)


async def condition(fn: Callable[[], bool], what: str, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while not fn():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def requests(registry: CollectorRegistry, verb: str, kind: str | None = None) -> float:
    return sum(
        s.value
        for fam in registry.collect()
        for s in fam.samples
        if s.name == "crs_k8s_requests_total"
        and s.labels["verb"] == verb
        and (kind is None or s.labels["kind"] == kind)
    )


class Faults:
    """The informers' transport: the real client, plus faults a test injects per kind."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client
        self.live: dict[str, WatchStream[Any]] = {}
        self.gates: dict[str, asyncio.Event] = {}
        self.resume_from: dict[str, str] = {}

    async def list_objects(
        self,
        kind: ResourceKind,
        type_: type[L],
        *,
        label_selector: str | None = None,
        limit: int = 500,
    ) -> ListResult[L]:
        return await self.client.list_objects(
            kind, type_, label_selector=label_selector, limit=limit
        )

    @asynccontextmanager
    async def watch(
        self,
        kind: ResourceKind,
        type_: type[Obj],
        *,
        resource_version: str = "",
        label_selector: str | None = None,
        timeout_s: int = 300,
    ) -> AsyncIterator[AsyncIterator[WatchEvent[Obj]]]:
        gate = self.gates.get(kind.plural)
        if gate is not None:
            await gate.wait()
        resource_version = self.resume_from.pop(kind.plural, resource_version)
        stream = self.client.watch(
            kind,
            type_,
            resource_version=resource_version,
            label_selector=label_selector,
            timeout_s=timeout_s,
        )
        async with stream as events:
            self.live[kind.plural] = stream
            try:
                yield events
            finally:
                self.live.pop(kind.plural, None)

    def drop(self, plural: str) -> bool:
        """Abort the live watch's TCP connection under the stream, as a network failure."""
        stream = self.live.get(plural)
        resp = None if stream is None else stream._resp
        if resp is None or resp.connection is None or resp.connection.transport is None:
            return False
        resp.connection.transport.abort()
        return True


class Frozen:
    """A kind's watch, stopped: no event reaches the cache until ``thaw``."""

    def __init__(self, faults: Faults, informer: Informer[Any]) -> None:
        self.faults = faults
        self.informer = informer
        self.plural = informer.kind.plural

    async def __aenter__(self) -> Frozen:
        await condition(lambda: self.informer.connected, "a live watch to drop")
        self.faults.gates[self.plural] = asyncio.Event()
        assert self.faults.drop(self.plural), "no live watch connection to drop"
        await condition(lambda: not self.informer.connected, "the watch to go down")
        return self

    def thaw(self, *, resource_version: str | None = None) -> None:
        """Let the waiting watch go on (from ``resource_version`` instead, if given)."""
        gate = self.faults.gates.pop(self.plural, None)
        if gate is not None:
            if resource_version is not None:
                self.faults.resume_from[self.plural] = resource_version
            gate.set()

    async def __aexit__(self, *exc: object) -> None:
        self.thaw()


@pytest_asyncio.fixture
async def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest_asyncio.fixture
async def kube(devstack: DevStack, registry: CollectorRegistry) -> AsyncIterator[KubeClient]:
    kc = await KubeClient.create(devstack.kubeconfig, metrics=K8sMetrics(registry))
    try:
        yield kc
    finally:
        await kc.close()


@pytest_asyncio.fixture
async def cluster(kube_api: Any) -> AsyncIterator[Cluster]:
    c = Cluster(kube_api)
    try:
        yield c
    finally:
        await c.cleanup()


@pytest_asyncio.fixture
async def faults(kube: KubeClient) -> Faults:
    return Faults(kube)


@pytest_asyncio.fixture
async def make_cache(
    kube: KubeClient, faults: Faults
) -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    caches: list[WatchClusterState] = []

    async def make(*, start: bool = True, **kwargs: Any) -> WatchClusterState:
        cache = WatchClusterState(kube, transport=faults, **kwargs)
        caches.append(cache)
        if start:
            await cache.start()
            assert await cache.wait_synced(30), cache.ready()
            await condition(lambda: cache.reservations.connected, "the reservations watch")
        return cache

    try:
        yield make
    finally:
        for cache in caches:
            await cache.stop()


def slot_names(snap: Snapshot, host: str, project: str, group: str = GROUP) -> list[str]:
    return [r.name for r in snap.evaluator.slots_for_host(host, project, group)]


def hv_free(snap: Snapshot, host: str) -> int:
    # The evaluator has no public accessor for it; the value is what list mode computes.
    return int(snap.evaluator._hv_free_memory.get(host, 0))


# --- sync, then incremental updates ------------------------------------------------------


async def test_sync_then_incremental_updates(cluster: Cluster, make_cache: Any) -> None:
    n = cluster.n
    h1, h2, proj = n("h1"), n("h2"), n("p")
    await cluster.ensure_knowledge()
    await cluster.create(
        f.hypervisor(h1, memory="256Gi"),
        f.hypervisor(h2, memory="256Gi", effective="64Gi", allocated="16Gi"),
        f.reservation(n("r1"), host=h1, project=proj, memory="8Gi"),
        f.reservation(n("other"), host=h1, project=proj, label="failover"),
        f.reservation(n("unready"), host=h1, project=proj, is_ready=False),
        f.committed_resource(n("c1"), project=proj),
    )
    cache = await make_cache()

    async def snap() -> Snapshot:
        return await cache.snapshot([h1, h2], proj)

    # Objects created before start are there after the initial sync, filtered like list mode.
    s = await snap()
    assert slot_names(s, h1, proj) == [n("r1")]
    assert slot_names(s, h2, proj) == []
    assert (hv_free(s, h1), hv_free(s, h2)) == (256 * GI, 48 * GI)
    assert [c.metadata.name for c in s.committed_resources] == [n("c1")]
    assert s.knowledge is not None
    assert s.knowledge.metadata.name == "flavor-groups"

    async def slots() -> tuple[list[str], list[str]]:
        s = await snap()
        return slot_names(s, h1, proj), slot_names(s, h2, proj)

    async def remaining(host: str, name: str) -> int | None:
        s = await snap()
        found = [r for r in s.evaluator.slots_for_host(host, proj, GROUP) if r.name == name]
        return reservation_remaining_memory(found[0]) if found else None

    # add
    await cluster.create(f.reservation(n("r2"), host=h2, project=proj, memory="16Gi"))
    await until(slots, ([n("r1")], [n("r2")]))

    # modify: an allocation lands
    body = {
        "spec": {"committedResourceReservation": {"allocations": {"vm-1": f.allocation("6Gi")}}}
    }
    await cluster.patch("reservations", n("r1"), body)
    await until(lambda: remaining(h1, n("r1")), 2 * GI)

    # modify: Ready -> not Ready drops the slot
    await cluster.patch_status("reservations", n("r1"), {"conditions": f.ready("False")})
    await until(slots, ([], [n("r2")]))

    # modify: a host move moves the slot
    await cluster.patch("reservations", n("r2"), {"spec": {"targetHost": h1}})
    await until(slots, ([n("r2")], []))

    # modify: losing the committed-resource label is a delete for a label-selected watch
    meta = {"metadata": {"labels": {f.CR_LABEL: "failover"}}}
    await cluster.patch("reservations", n("r2"), meta)
    await until(slots, ([], []))
    assert cache.reservations.get(n("r2")) is None

    # delete (and a not-Ready slot becoming Ready again on the way)
    await cluster.patch_status("reservations", n("r1"), {"conditions": f.ready("True")})
    await until(slots, ([n("r1")], []))
    await cluster.delete("reservations", n("r1"))
    await until(slots, ([], []))

    # hypervisor allocation changes the free memory
    await cluster.patch_status("hypervisors", h1, {"allocation": {"memory": "200Gi", "cpu": "0"}})

    async def free() -> tuple[int, int]:
        s = await snap()
        return hv_free(s, h1), hv_free(s, h2)

    await until(free, (56 * GI, 48 * GI))
    await cluster.delete("hypervisors", h2)
    await until(free, (56 * GI, 0))

    # committed resources: add one, delete the other, move one to another project
    await cluster.create(f.committed_resource(n("c2"), project=proj))

    async def crs() -> list[str]:
        return [c.metadata.name or "" for c in (await snap()).committed_resources]

    await until(crs, [n("c1"), n("c2")])
    await cluster.delete("committedresources", n("c1"))
    await until(crs, [n("c2")])
    await cluster.patch("committedresources", n("c2"), {"spec": {"projectID": n("q")}})
    await until(crs, [])
    s_other = await cache.snapshot([h1], n("q"))
    assert [c.metadata.name for c in s_other.committed_resources] == [n("c2")]


# --- equivalence with list mode ----------------------------------------------------------


def answers(snap: Snapshot, hosts: list[str], project: str) -> dict[str, Any]:
    ev = snap.evaluator
    out: dict[str, Any] = {}
    for host in hosts:
        out[f"free {host}"] = hv_free(snap, host)
        for group in (GROUP, "g2"):
            out[f"slots {host} {group}"] = [
                (r.name, r.metadata.resource_version)
                for r in ev.slots_for_host(host, project, group)
            ]
            out[f"usable {host} {group}"] = [
                ev.has_usable_slot(host, project, group, gib * GI) for gib in (1, 4, 8, 32, 100)
            ]
    out["crs"] = sorted(
        (c.metadata.name, c.metadata.resource_version)
        for c in snap.committed_resources
        if c.spec.project_id == project
    )
    k = snap.knowledge
    out["knowledge"] = None if k is None else k.metadata.resource_version
    return out


def random_world(cluster: Cluster, rnd: random.Random) -> tuple[list[Any], list[str], list[str]]:
    n = cluster.n
    hosts = [n(f"h{i}") for i in range(5)]
    projects = [n(f"p{i}") for i in range(3)]
    objs: list[Any] = []
    for host in hosts:
        effective = rnd.choice([None, None, "100Gi", "0"])
        objs.append(
            f.hypervisor(
                host, memory="128Gi", allocated=f"{rnd.randint(0, 120)}Gi", effective=effective
            )
        )
    for i in range(24):
        allocations = {
            f"vm-{i}-{j}": f.allocation(f"{rnd.choice([2, 4, 6])}Gi")
            for j in range(rnd.randint(0, 2))
        }
        objs.append(
            f.reservation(
                n(f"r{i:02d}"),
                host=rnd.choice(hosts),
                project=rnd.choice(projects),
                group=rnd.choice([GROUP, GROUP, "g2"]),
                memory=f"{rnd.choice([4, 8, 16])}Gi",
                allocations=allocations,
                is_ready=rnd.random() > 0.2,
                label=rnd.choice(["committed-resource"] * 4 + ["failover"]),
            )
        )
    for i in range(6):
        objs.append(
            f.committed_resource(
                n(f"c{i}"),
                project=rnd.choice(projects),
                group=rnd.choice([GROUP, "g2"]),
                state=rnd.choice(["confirmed", "guaranteed", "pending"]),
            )
        )
    return objs, hosts, projects


async def test_snapshot_answers_equal_list_mode(
    cluster: Cluster, kube: KubeClient, make_cache: Any
) -> None:
    rnd = random.Random(20261202)
    objs, hosts, projects = random_world(cluster, rnd)
    await cluster.ensure_knowledge()
    await cluster.create(*objs)
    cache = await make_cache()
    listing = ListClusterState(kube)
    queried = [*hosts, cluster.n("no-such-host")]

    async def compare() -> None:
        for project in [*projects, cluster.n("no-such-project")]:
            for subset in (queried, rnd.sample(hosts, 2)):

                async def both(subset: list[str] = subset, project: str = project) -> bool:
                    w = answers(await cache.snapshot(subset, project), subset, project)
                    lst = answers(await listing.snapshot(subset, project), subset, project)
                    return w == lst

                await until(both, True)

    await compare()

    # Random changes after the sync: the cache follows them to the same answers.
    for i in range(12):
        name = cluster.n(f"r{rnd.randrange(24):02d}")
        action = rnd.choice(["alloc", "move", "ready", "delete", "hv", "cr"])
        if action == "alloc":
            alloc = {f"new-{i}": f.allocation(f"{rnd.choice([2, 4])}Gi")}
            body = {"spec": {"committedResourceReservation": {"allocations": alloc}}}
            await cluster.patch("reservations", name, body)
        elif action == "move":
            await cluster.patch("reservations", name, {"spec": {"targetHost": rnd.choice(hosts)}})
        elif action == "ready":
            status = {"conditions": f.ready(rnd.choice(["True", "False"]))}
            await cluster.patch_status("reservations", name, status)
        elif action == "delete":
            await cluster.delete("reservations", name)
        elif action == "hv":
            alloc = {"allocation": {"memory": f"{rnd.randint(0, 128)}Gi", "cpu": "0"}}
            await cluster.patch_status("hypervisors", rnd.choice(hosts), alloc)
        else:
            cr = cluster.n(f"c{rnd.randrange(6)}")
            await cluster.patch("committedresources", cr, {"spec": {"amount": "1Gi"}})
    await compare()


# --- zero reads per request ---------------------------------------------------------------


async def test_snapshots_after_sync_make_no_api_reads(
    cluster: Cluster, make_cache: Any, registry: CollectorRegistry
) -> None:
    n = cluster.n
    await cluster.create(
        f.hypervisor(n("h1")),
        *(f.reservation(n(f"r{i}"), host=n("h1"), project=n("p")) for i in range(5)),
        f.committed_resource(n("c1"), project=n("p")),
    )
    cache = await make_cache()
    reads_before = requests(registry, "list") + requests(registry, "get")
    assert requests(registry, "list") >= 4  # the initial sync: one LIST per kind at least

    started = time.perf_counter()
    for i in range(100):
        snap = await cache.snapshot([n("h1"), n(f"h{i}")], n("p"))
    per_snapshot_us = (time.perf_counter() - started) / 100 * 1e6

    assert requests(registry, "list") + requests(registry, "get") == reads_before
    assert slot_names(snap, n("h1"), n("p")) != []
    # A synced snapshot never awaits, so the watches may only start now; they are
    # counted as requests of their own verb.
    await condition(lambda: cache.reservations.connected, "the reservations watch")
    assert requests(registry, "watch", "reservations") >= 1
    assert requests(registry, "list") + requests(registry, "get") == reads_before
    print(f"snapshot: {per_snapshot_us:.1f} us each")


# --- read-your-writes -----------------------------------------------------------------------


async def test_write_is_visible_to_the_next_snapshot_without_the_watch(
    cluster: Cluster, make_cache: Any, faults: Faults
) -> None:
    n = cluster.n
    host, proj = n("h1"), n("p")
    await cluster.create(f.hypervisor(host), f.reservation(n("slot"), host=host, project=proj))
    cache = await make_cache()
    await until(lambda: _slot_count(cache, host, proj), 1)

    async with Frozen(faults, cache.reservations):
        (slot,) = (await cache.snapshot([host], proj)).evaluator.slots_for_host(host, proj, GROUP)
        assert reservation_remaining_memory(slot) == 8 * GI

        written = await cache.patch_allocation(slot, "vm-1", f.allocation("4Gi"))
        (now,) = (await cache.snapshot([host], proj)).evaluator.slots_for_host(host, proj, GROUP)
        assert reservation_remaining_memory(now) == 4 * GI
        assert now.metadata.resource_version == written.metadata.resource_version

        # A lagging watch event (the version before the write) must not roll it back.
        assert cache.reservations.store.upsert(slot) is False
        assert cache.reservations.apply(slot) is False
        assert cache.reservations.get(n("slot")) is written

        # The cached version is the server's: a second guarded write does not conflict.
        await cache.patch_allocation(now, "vm-2", f.allocation("4Gi"))
        (full,) = (await cache.snapshot([host], proj)).evaluator.slots_for_host(host, proj, GROUP)
        assert reservation_remaining_memory(full) == 0

    # Once the watch delivers the same versions they are recognised as not newer.
    stored = await f.get(cluster.api, "reservations", n("slot"))
    await condition(
        lambda: (
            not is_newer(stored["metadata"]["resourceVersion"], cache.reservations.resource_version)
        ),
        "the watch to catch up",
    )
    assert sorted(stored["spec"]["committedResourceReservation"]["allocations"]) == ["vm-1", "vm-2"]


async def _slot_count(cache: WatchClusterState, host: str, proj: str) -> int:
    return len((await cache.snapshot([host], proj)).evaluator.slots_for_host(host, proj, GROUP))


async def test_recorder_never_overfills_a_slot_on_a_lagging_watch(
    cluster: Cluster, make_cache: Any, faults: Faults
) -> None:
    n = cluster.n
    host, proj = n("h1"), n("p")
    await cluster.ensure_knowledge()
    await cluster.create(
        f.hypervisor(host),
        f.reservation(n("slot"), host=host, project=proj, memory="8Gi"),
        f.committed_resource(n("cr"), project=proj, amount="64Gi"),
    )
    cache = await make_cache()

    async def seen() -> tuple[int, int, bool]:
        s = await cache.snapshot([host], proj)
        k = s.knowledge
        fg_ok = k is not None and (k.status.raw or {}).get("features", [{}])[0].get("name") == GROUP
        return len(slot_names(s, host, proj)), len(s.committed_resources), fg_ok

    await until(seen, (1, 1, True))
    recorder = Recorder(cache, clock=lambda: datetime(2026, 12, 2, tzinfo=UTC))
    uuids = [str(uuid.uuid4()) for _ in range(3)]

    async with Frozen(faults, cache.reservations):
        outcomes = []
        for vm in uuids:
            request = nova.parse_request(
                nova.request(vm, project_id=proj, flavor_name="m1.large", hosts=[host])
            )
            outcomes.append(await recorder.record_placement(nova.decision(host, [host]), request))

    statuses = [o.allocation for o in outcomes]
    assert statuses.count(AllocationStatus.WRITTEN) == 2, outcomes
    # No conflict was needed to get there: every decision was made on the cached result of
    # the previous write, not on a stale version the server would have rejected.
    assert [o.conflicts for o in outcomes] == [0, 0, 0]
    stored = await f.get(cluster.api, "reservations", n("slot"))
    assert sorted(stored["spec"]["committedResourceReservation"]["allocations"]) == sorted(
        uuids[:2]
    )


# --- watch edge cases ---------------------------------------------------------------------------


async def test_expired_resource_version_relists_and_repairs_missed_events(
    cluster: Cluster, make_cache: Any, registry: CollectorRegistry, faults: Faults
) -> None:
    """A real 410: the server's watch cache no longer has resourceVersion 1.

    While the watch is frozen, objects are created and deleted (the events are missed);
    the watch then resumes from resourceVersion "1", which the API server answers with
    an ERROR event ``410 Expired: too old resource version``. The informer must LIST again
    and the relist (a diff against the store) must repair both the add and the delete.
    """
    n = cluster.n
    host, proj = n("h1"), n("p")
    await cluster.create(f.hypervisor(host), f.reservation(n("gone"), host=host, project=proj))
    cache = await make_cache()
    inf = cache.reservations
    await until(lambda: _names(cache, host, proj), [n("gone")])
    lists_before = requests(registry, "list", "reservations")

    async with Frozen(faults, inf) as frozen:
        await cluster.create(f.reservation(n("new"), host=host, project=proj))
        await cluster.delete("reservations", n("gone"))
        await _a_later_change_arrives(cluster, cache, host, proj, n("cr-later"))
        assert await _names(cache, host, proj) == [n("gone")]  # truly missed so far
        frozen.thaw(resource_version="1")
        await condition(lambda: inf.expired >= 1, "the 410")
        await until(lambda: _names(cache, host, proj), [n("new")])

    assert requests(registry, "list", "reservations") == lists_before + 1
    assert inf.lists == 2
    # The watch runs again after the relist: later changes still arrive.
    await cluster.create(f.reservation(n("later"), host=host, project=proj))
    await until(lambda: _names(cache, host, proj), [n("later"), n("new")])
    await condition(lambda: inf.connected, "the watch to reconnect")


async def _names(cache: WatchClusterState, host: str, proj: str) -> list[str]:
    return slot_names(await cache.snapshot([host], proj), host, proj)


async def _a_later_change_arrives(
    cluster: Cluster, cache: WatchClusterState, host: str, proj: str, name: str
) -> None:
    """A CommittedResource created now reaches the cache through its own, live watch:
    the events made before it had their chance to arrive too, had their watch been up."""
    await cluster.create(f.committed_resource(name, project=proj))

    async def crs() -> list[str]:
        snap = await cache.snapshot([host], proj)
        return sorted(c.metadata.name or "" for c in snap.committed_resources)

    await until(crs, [name])


async def test_dropped_connection_resumes_from_resource_version_without_relisting(
    cluster: Cluster, make_cache: Any, registry: CollectorRegistry, faults: Faults
) -> None:
    n = cluster.n
    host, proj = n("h1"), n("p")
    await cluster.create(f.hypervisor(host), f.reservation(n("a"), host=host, project=proj))
    cache = await make_cache(backoff_base_s=0.05)
    inf = cache.reservations
    await until(lambda: _names(cache, host, proj), [n("a")])
    lists = requests(registry, "list")
    watches = requests(registry, "watch", "reservations")

    # 1. A plain network failure: the TCP connection is aborted under the stream.
    assert faults.drop("reservations")
    await cluster.create(f.reservation(n("b"), host=host, project=proj))
    await until(lambda: _names(cache, host, proj), [n("a"), n("b")])

    # 2. Events that happen while disconnected are replayed from the kept resourceVersion.
    async with Frozen(faults, inf):
        await cluster.create(f.reservation(n("c"), host=host, project=proj))
        await cluster.delete("reservations", n("a"))
        await _a_later_change_arrives(cluster, cache, host, proj, n("cr-later"))
        assert await _names(cache, host, proj) == [n("a"), n("b")]
    await until(lambda: _names(cache, host, proj), [n("b"), n("c")])

    await condition(lambda: inf.connected, "the watch to reconnect")
    assert requests(registry, "list") == lists  # no relist anywhere
    assert inf.expired == 0
    assert inf.lists == 1
    assert requests(registry, "watch", "reservations") >= watches + 2


# --- readiness and sync gating -------------------------------------------------------------------


async def test_readiness_and_requests_before_sync(
    cluster: Cluster, make_cache: Any, kube: KubeClient
) -> None:
    cache = await make_cache(start=False, sync_timeout_s=0.2)
    assert cache.ready() == (False, "watch cache not started")
    with pytest.raises(UnavailableError, match="not synced"):
        await cache.snapshot(["h"], "p")

    await cache.start()
    assert await cache.wait_synced(30)
    assert cache.ready() == (True, "watch cache synced")

    await cache.stop()
    assert cache.ready()[0] is False


async def test_the_first_sync_is_logged_once_however_many_requests_waited_for_it(
    cluster: Cluster, make_cache: Any
) -> None:
    # Events arriving before the first sync each wait for it; each logged
    # watch_cache_synced when it came (148 identical lines from one replica whose API
    # server had been frozen at start-up).
    cache = await make_cache(start=False)
    with structlog.testing.capture_logs() as logs:
        await cache.start()
        waiting = [asyncio.create_task(cache.snapshot(["h"], "p")) for _ in range(50)]
        await asyncio.gather(*waiting)
        assert await cache.wait_synced(30)
    assert [e["event"] for e in logs].count("watch_cache_synced") == 1


async def test_a_watch_down_too_long_is_not_ready_and_fails_requests(
    cluster: Cluster, make_cache: Any, faults: Faults
) -> None:
    cache = await make_cache(stale_after_s=0.3)
    await condition(lambda: cache.ready()[0], "ready")
    async with Frozen(faults, cache.reservations):
        await asyncio.sleep(0.4)
        ok, detail = cache.ready()
        assert not ok
        assert detail.startswith("reservations: watch down for")
        with pytest.raises(UnavailableError, match="stale"):
            await cache.snapshot(["h"], "p")
    await condition(lambda: cache.ready()[0], "ready again after reconnecting")
    await cache.snapshot(["h"], "p")


async def test_knowledge_is_the_flavor_groups_object_like_list_mode(
    cluster: Cluster, make_cache: Any, kube: KubeClient
) -> None:
    """Only ``flavor-groups`` is kept; both modes agree on which version they see.

    ``flavor-groups`` is shared with concurrently running modules, so this test never
    deletes it (the absent case, None in both modes, is the same code path as any
    delete: the knowledge informer's DELETED event clears it).
    """
    await cluster.ensure_knowledge()
    other = f.knowledge([], name=cluster.n("other-knowledge"))
    await cluster.create(other)
    cache = await make_cache()
    listing = ListClusterState(kube)
    assert cache.knowledges.get(cluster.n("other-knowledge")) is None

    async def agree() -> bool:
        w, lst = await cache.snapshot([], "p"), await listing.snapshot([], "p")
        if w.knowledge is None or lst.knowledge is None:
            return False
        return w.knowledge.metadata.resource_version == lst.knowledge.metadata.resource_version

    await until(agree, True)
    assert len(cache.knowledges) == 1
