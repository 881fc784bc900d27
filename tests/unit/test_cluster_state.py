"""The two ClusterState implementations (service/k8s/state.py, service/k8s/cache.py) on
fakes: what they read when, and that a failed read takes no other read down with it.

The Recorder's behaviour on them is tested in tests/unit/test_recorder.py (on the
in-memory state) and end to end in tests/integration/test_recorder.py and
tests/integration/test_watch_cache.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from service.crs.ports import UnavailableError
from service.k8s import ListClusterState
from service.k8s.cache import WatchClusterState
from service.model import Hypervisor, Knowledge
from service.quantity import parse_quantity
from tests import factories as f
from tests.fakes.kube import FakeKube
from tests.unit.test_recorder import HOST, OTHER, BarrierState, Env, place, standard_world


@pytest_asyncio.fixture
async def watch_env() -> AsyncIterator[tuple[Env, FakeKube, WatchClusterState]]:
    """An Env whose cluster is served to a started, synced watch cache."""
    env = Env()
    kube = FakeKube(env.state)
    cache = WatchClusterState(kube, transport=kube)  # type: ignore[arg-type]
    yield env, kube, cache
    await cache.stop()


async def start(cache: WatchClusterState) -> None:
    await cache.start()
    assert await cache.wait_synced(2.0)


# --- watch mode: a lost race reads by name, never the whole kind ------------------------


async def test_watch_mode_race_re_reads_by_name_without_listing(
    watch_env: tuple[Env, FakeKube, WatchClusterState],
) -> None:
    """Eight writers decide on the same snapshot of two slots: most lose the race and
    re-decide on fresh reads. With tens of thousands of Reservations a LIST per lost race
    is a memory and CPU spike each, so the fresh reads are GETs of the host's slots."""
    env, kube, cache = watch_env
    env.seed(
        *standard_world(
            f.reservation("slot-1", host=HOST, memory="8Gi"),
            f.reservation("slot-2", host=HOST, memory="8Gi"),
            f.reservation("elsewhere", host=OTHER, memory="8Gi"),
        )
    )
    await start(cache)
    listed_at_sync = sum(kube.lists.values())
    gated = BarrierState(cache, 8)  # type: ignore[arg-type]
    recs = [env.recorder_on(gated) for _ in range(8)]

    outs = await asyncio.gather(*(place(r, uuid=f"vm-{i}") for i, r in enumerate(recs)))

    lists_in_race = sum(kube.lists.values()) - listed_at_sync
    assert lists_in_race == 0, f"LISTs during the race (all: {dict(kube.lists)})"
    assert sum(o.conflicts for o in outs) >= 1  # the race was lost and re-decided
    slots = {n: env.allocations(n) for n in ("slot-1", "slot-2")}
    placed = [u for allocs in slots.values() for u in allocs]
    assert len(placed) == len(set(placed)) == 4
    for name, allocs in slots.items():
        used = sum(parse_quantity(a["resources"]["memory"]).value() for a in allocs.values())
        assert used <= 8 << 30, f"{name} overfilled"
    assert sorted(o.allocation.value for o in outs) == ["no_slot"] * 4 + ["written"] * 4
    assert env.allocations("elsewhere") == {}


async def test_watch_mode_host_slots_are_fresh_reads_of_the_cached_names(
    watch_env: tuple[Env, FakeKube, WatchClusterState],
) -> None:
    """The names come from the cache, the objects from the API server: a slot the watch
    has not caught up on is read as it is now (moved away, or its allocations)."""
    env, kube, cache = watch_env
    env.seed(
        f.reservation("slot-1", host=HOST),
        f.reservation("slot-2", host=HOST),
        f.reservation("not-ready", host=HOST, is_ready=False),
        f.reservation("elsewhere", host=OTHER),
    )
    await start(cache)
    listed_at_sync = sum(kube.lists.values())
    env.state.patch("Reservation", "slot-2", {"spec": {"targetHost": OTHER}})
    env.state.patch(
        "Reservation",
        "slot-1",
        {"spec": {"committedResourceReservation": {"allocations": {"vm": f.allocation("1Gi")}}}},
    )

    on_host = await cache.reservations_on_host(HOST)

    assert sum(kube.lists.values()) == listed_at_sync
    assert [r.name for r in on_host] == ["not-ready", "slot-1"]  # name order, like a LIST
    slot_1 = on_host[1].spec.committed_resource_reservation
    assert slot_1 is not None
    assert set(slot_1.allocations or {}) == {"vm"}
    # Fed back into the cache: the move is seen there now, too.
    moved = cache.reservations.get("slot-2")
    assert moved is not None
    assert moved.spec.target_host == OTHER


# --- a failed read cancels its siblings -----------------------------------------------


class HangingLists:
    """A KubeClient stand-in for list mode: the Knowledge read fails at once, the
    Reservation list hangs (a big list on a slow API server) until cancelled."""

    def __init__(self) -> None:
        self.error = UnavailableError("get knowledges/flavor-groups: timed out", status=None)
        self.started = asyncio.Event()
        self.cancelled = False

    async def list_hypervisors(self, *, limit: int = 500) -> list[Hypervisor]:
        return []

    async def list_reservations(self, *, limit: int = 500) -> list[object]:
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        raise AssertionError("unreachable")

    async def list_committed_resources(self, *, limit: int = 500) -> list[object]:
        return []

    async def get_knowledge(self, name: str = "flavor-groups") -> Knowledge | None:
        await self.started.wait()  # fail while the list is in flight
        raise self.error


async def test_watch_mode_a_host_without_cached_slots_reads_nothing(
    watch_env: tuple[Env, FakeKube, WatchClusterState],
) -> None:
    env, kube, cache = watch_env
    env.seed(f.reservation("elsewhere", host=OTHER))
    await start(cache)
    listed_at_sync = sum(kube.lists.values())
    assert await cache.reservations_on_host(HOST) == []
    assert sum(kube.lists.values()) == listed_at_sync


async def test_list_mode_a_failed_read_cancels_the_others() -> None:
    client = HangingLists()
    state = ListClusterState(client)  # type: ignore[arg-type]
    with pytest.raises(UnavailableError) as raised:
        await state.snapshot([HOST], "p1")
    assert raised.value is client.error  # the read's own error, not a group of them
    assert client.cancelled, "the hanging LIST was left running after the snapshot failed"


async def test_watch_mode_a_failed_host_read_cancels_the_others(
    watch_env: tuple[Env, FakeKube, WatchClusterState],
) -> None:
    env, kube, cache = watch_env
    env.seed(f.reservation("slot-1", host=HOST), f.reservation("slot-2", host=HOST))
    await start(cache)
    error = UnavailableError("get reservations/slot-1: timed out", status=None)
    cancelled = False

    async def get_reservation(name: str) -> object:
        nonlocal cancelled
        if name == "slot-1":
            raise error
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled = True
            raise
        raise AssertionError("unreachable")

    kube.get_reservation = get_reservation  # type: ignore[method-assign,assignment]
    with pytest.raises(UnavailableError) as raised:
        await cache.reservations_on_host(HOST)
    assert raised.value is error
    assert cancelled
