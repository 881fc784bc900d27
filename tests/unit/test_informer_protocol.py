"""The informer's list/watch protocol against a scripted transport (no API server).

Each test scripts what the "server" answers: LIST results, and per WATCH request a list
of steps (events, a failure, a pause until the test releases it, or a hang). The
informer runs on a fake clock and a fake sleep that records every back-off it waits.
The same behaviours run end to end against the real kube-apiserver in
tests/integration/test_watch_cache.py (events, 410, dropped connection) and
tests/integration/test_health.py (a silent, frozen API server).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
import pytest_asyncio

from service.crs.ports import UnavailableError
from service.k8s.client import EventType, K8sObject, ListResult, ResourceKind, WatchEvent
from service.k8s.errors import ResourceExpiredError
from service.k8s.informer import Informer, InformerOptions
from service.model import ObjectMeta

KIND = ResourceKind("example.test", "v1", "things")
L = TypeVar("L")
Obj = TypeVar("Obj", bound=K8sObject)


@dataclass(frozen=True)
class Thing:
    metadata: ObjectMeta
    value: str = ""


def thing(name: str, rv: int, value: str = "") -> Thing:
    return Thing(ObjectMeta(name=name, resource_version=str(rv)), value)


def event(type_: EventType, obj: Thing) -> WatchEvent[Any]:
    meta = obj.metadata
    return WatchEvent(type_, meta.name or "", meta.resource_version or "", obj)


def bookmark(rv: int) -> WatchEvent[Any]:
    return WatchEvent("BOOKMARK", "", str(rv))


HANG = object()  # a step: the stream stays open and silent; a float: pause that long
# (a callable step is called)


@dataclass
class Scripted:
    """The fake server: answers in order; with nothing left to answer, a call hangs."""

    lists: list[ListResult[Any] | Exception] = field(default_factory=list)
    # One entry per WATCH request: an exception raised when it opens, or its steps.
    watches: list[Exception | list[object]] = field(default_factory=list)
    list_calls: int = 0
    watch_from: list[str] = field(default_factory=list)
    timeouts: list[int] = field(default_factory=list)  # each WATCH's timeoutSeconds

    async def list_objects(
        self,
        kind: ResourceKind,
        type_: type[L],
        *,
        label_selector: str | None = None,
        limit: int = 500,
    ) -> ListResult[L]:
        self.list_calls += 1
        if not self.lists:
            await asyncio.Event().wait()
        answer = self.lists.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

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
        self.watch_from.append(resource_version)
        self.timeouts.append(timeout_s)
        if not self.watches:
            await asyncio.Event().wait()
        script = self.watches.pop(0)
        if isinstance(script, Exception):
            raise script
        yield self._play(script)

    async def _play(self, steps: list[object]) -> AsyncIterator[WatchEvent[Any]]:
        for step in steps:
            if step is HANG:
                await asyncio.Event().wait()
            elif isinstance(step, asyncio.Event):
                await step.wait()
            elif isinstance(step, float):
                await asyncio.sleep(step)  # real time: the idle bound runs on the loop's clock
            elif callable(step):
                step()  # e.g. move the fake clock while the stream is open
            elif isinstance(step, Exception):
                raise step
            else:
                assert isinstance(step, WatchEvent)
                yield step


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Run:
    informer: Informer[Thing]
    server: Scripted
    clock: Clock
    slept: list[float]
    changes: list[tuple[str | None, str | None]]


Make = Callable[..., Run]


@pytest_asyncio.fixture
async def make() -> AsyncIterator[Make]:
    runs: list[Run] = []

    def build(server: Scripted, **options: Any) -> Run:
        clock = Clock()
        slept: list[float] = []
        changes: list[tuple[str | None, str | None]] = []

        async def sleep(seconds: float) -> None:
            slept.append(seconds)
            clock.now += seconds
            await asyncio.sleep(0)

        def on_change(old: Thing | None, new: Thing | None) -> None:
            changes.append(
                (
                    None if old is None else f"{old.metadata.name}@{old.metadata.resource_version}",
                    None if new is None else f"{new.metadata.name}@{new.metadata.resource_version}",
                )
            )

        informer = Informer(
            server,
            KIND,
            Thing,
            on_change=on_change,
            options=InformerOptions(**{"backoff_base_s": 1.0, **options}),
            clock=clock,
            sleep=sleep,
        )
        run = Run(informer, server, clock, slept, changes)
        runs.append(run)
        informer.start()
        return run

    try:
        yield build
    finally:
        for run in runs:
            await run.informer.stop()


async def until(fn: Callable[[], bool], what: str) -> None:
    # Scripted steps complete without real waiting: a few hundred loop turns suffice,
    # the real-time bound only catches a protocol that never gets there.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2.0
    while not fn():
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


def names(informer: Informer[Thing], *candidates: str) -> list[str]:
    return [n for n in candidates if informer.get(n) is not None]


# --- list, then events ----------------------------------------------------------------------


async def test_initial_list_then_events_from_the_lists_resource_version(make: Make) -> None:
    server = Scripted(
        lists=[ListResult([thing("a", 5), thing("b", 6)], "10")],
        watches=[
            [
                event("ADDED", thing("c", 11)),
                event("MODIFIED", thing("a", 12, "new")),
                event("DELETED", thing("b", 13)),
                HANG,
            ]
        ],
    )
    run = make(server)
    inf = run.informer
    assert await inf.wait_synced(2)
    await until(lambda: inf.resource_version == "13", "the three events")

    assert server.watch_from == ["10"]
    assert run.changes == [
        (None, "a@5"),
        (None, "b@6"),
        (None, "c@11"),
        ("a@5", "a@12"),
        ("b@6", None),
    ]
    assert names(inf, "a", "b", "c") == ["a", "c"]
    got = inf.get("a")
    assert got is not None
    assert got.value == "new"
    assert (inf.lists, inf.events, inf.connected, inf.last_error) == (1, 3, True, "")


async def test_stale_and_undecodable_events(make: Make) -> None:
    server = Scripted(
        lists=[ListResult([thing("a", 5), thing("b", 6)], "10")],
        watches=[
            [
                # A watch event older than what the store holds does not roll it back.
                event("MODIFIED", thing("a", 4, "old")),
                # An object that does not decode (the client logged it) counts as absent.
                WatchEvent("MODIFIED", "b", "11"),
                HANG,
            ]
        ],
    )
    run = make(server)
    inf = run.informer
    await until(lambda: inf.resource_version == "11", "both events")
    assert names(inf, "a", "b") == ["a"]
    assert run.changes[2:] == [("b@6", None)]

    # Read-your-writes: our own write result applies at once, but never one the watch
    # has already got past (it may have been deleted since).
    assert inf.apply(thing("a", 20, "mine")) is True
    assert inf.apply(thing("c", 9)) is False
    assert names(inf, "a", "c") == ["a"]


# --- bookmarks and renewals -------------------------------------------------------------------


async def test_bookmark_advances_the_resource_version_of_the_next_watch(make: Make) -> None:
    server = Scripted(
        lists=[ListResult([thing("a", 5)], "10")],
        # The server ends the first stream (its timeout) after a bookmark.
        watches=[[bookmark(42)], [HANG]],
    )
    run = make(server)
    await until(lambda: len(server.watch_from) == 2, "the renewal")
    assert server.watch_from == ["10", "42"]
    assert server.list_calls == 1  # a renewal is not a relist
    assert run.slept == [0.0]  # a stream that delivered something is renewed at once
    assert run.changes == [(None, "a@5")]
    assert run.informer.events == 0  # a bookmark is no object event


async def test_an_empty_stream_that_ends_at_once_is_not_renewed_in_a_spin(make: Make) -> None:
    server = Scripted(lists=[ListResult([], "10")], watches=[[], [], [HANG]])
    run = make(server)
    await until(lambda: len(server.watch_from) == 3, "two renewals")
    assert server.watch_from == ["10", "10", "10"]
    first, second = run.slept
    assert 0.5 <= first <= 1.0
    assert 1.0 <= second <= 2.0


# --- 410: relist ----------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["at open", "mid-stream"])
async def test_expired_resource_version_relists_as_a_diff(make: Make, when: str) -> None:
    gone = ResourceExpiredError("watch things: too old resource version", status=410)
    first_watch: Exception | list[object] = (
        gone if when == "at open" else [event("ADDED", thing("b", 11)), gone]
    )
    server = Scripted(
        lists=[
            ListResult([thing("a", 5), thing("b", 6)], "10"),
            # The relist: a deleted, b changed, c added, all while the watch was away.
            ListResult([thing("b", 15), thing("c", 16)], "20"),
        ],
        watches=[first_watch, [HANG]],
    )
    run = make(server)
    inf = run.informer
    await until(lambda: inf.lists == 2 and inf.connected, "the relist and the next watch")

    assert server.watch_from == ["10", "20"]
    assert inf.expired == 1
    assert names(inf, "a", "b", "c") == ["b", "c"]
    stored = inf.get("b")
    assert stored is not None
    assert stored.metadata.resource_version == "15"
    assert ("a@5", None) in run.changes  # the diff removed what the list no longer has
    assert (None, "c@16") in run.changes
    assert run.slept == [0.0]  # the first relist is immediate


# --- disconnects: re-watch with back-off, no relist ---------------------------------------


async def test_disconnect_resumes_from_the_last_resource_version_with_back_off(
    make: Make,
) -> None:
    reset = UnavailableError("watch things: ClientPayloadError: connection reset")
    refused = UnavailableError("watch things: ClientConnectorError: refused")
    server = Scripted(
        lists=[ListResult([thing("a", 5)], "10")],
        watches=[
            [event("ADDED", thing("b", 11)), reset],
            refused,
            [event("ADDED", thing("c", 12)), HANG],
        ],
    )
    run = make(server)
    inf = run.informer
    await until(lambda: inf.resource_version == "12", "the replayed event")

    assert server.watch_from == ["10", "11", "11"]
    assert server.list_calls == 1
    assert inf.expired == 0
    assert names(inf, "a", "b", "c") == ["a", "b", "c"]
    # Capped exponential with equal jitter, base 1 s: [0.5, 1], then [1, 2].
    first, second = run.slept
    assert 0.5 <= first <= 1.0
    assert 1.0 <= second <= 2.0
    assert inf.connected


async def test_back_off_starts_over_after_a_watch_that_stayed_up(make: Make) -> None:
    release = asyncio.Event()
    reset = UnavailableError("watch things: connection reset")
    server = Scripted(
        lists=[ListResult([], "10")],
        watches=[[reset], [reset], [release, reset], [HANG]],
    )
    run = make(server)
    await until(lambda: len(server.watch_from) == 3 and run.informer.connected, "third watch")
    run.clock.now += 60  # the third watch is healthy for a minute before it breaks
    release.set()
    await until(lambda: len(server.watch_from) == 4, "the fourth watch")
    first, second, third = run.slept
    assert (0.5 <= first <= 1.0, 1.0 <= second <= 2.0, 0.5 <= third <= 1.0) == (True,) * 3


async def test_a_failing_list_is_retried_with_back_off_before_any_watch(make: Make) -> None:
    server = Scripted(
        lists=[UnavailableError("list things: 503", status=503), ListResult([thing("a", 1)], "10")],
        watches=[[HANG]],
    )
    run = make(server)
    await until(lambda: run.informer.connected, "the watch after the retried list")
    assert server.list_calls == 2
    assert server.watch_from == ["10"]
    assert len(run.slept) == 1
    assert 0.5 <= run.slept[0] <= 1.0


async def test_relists_after_repeated_expiries_back_off(make: Make) -> None:
    # A LIST slower than the server's watch window: each relist's resourceVersion has
    # expired by the time the watch opens. Only the first relist is immediate; the rest
    # back off (a successful LIST alone does not make the watch healthy again).
    n = 4
    server = Scripted(
        lists=[ListResult([thing("a", 5)], str(10 + i)) for i in range(n + 1)],
        watches=[
            *[ResourceExpiredError("watch things: too old", status=410) for _ in range(n)],
            [HANG],
        ],
    )
    run = make(server)
    await until(lambda: run.informer.lists == n + 1 and run.informer.connected, "the relists")
    assert run.slept[0] == 0.0
    assert all(delay >= 0.5 for delay in run.slept[1:]), run.slept
    assert len(run.slept) == n


async def test_an_expiry_after_a_list_outage_relists_at_once(make: Make) -> None:
    # The API server restarted: LISTs fail for a while, then one succeeds and the first
    # watch finds its resourceVersion expired. The LIST outage's back-off is over: the
    # relist is immediate (only repeated expiries back off).
    down = [UnavailableError("list things: 503", status=503) for _ in range(6)]
    server = Scripted(
        lists=[*down, ListResult([], "10"), ListResult([], "20")],
        watches=[ResourceExpiredError("watch things: too old", status=410), [HANG]],
    )
    run = make(server)
    await until(lambda: run.informer.lists == 2 and run.informer.connected, "the relist")
    assert len(run.slept) == 7
    assert run.slept[-1] == 0.0


async def test_a_watch_the_server_ended_as_asked_is_a_sign_of_life(make: Make) -> None:
    # A quiet kind: the watch ends at its server-side timeout, the next one fails at once
    # (a reset). The renewal was the last sign of life, not the LIST before it.
    release = asyncio.Event()
    server = Scripted(
        lists=[ListResult([], "10")],
        watches=[[release], [UnavailableError("reset")], [HANG]],
    )
    run = make(server)
    inf = run.informer
    silent: list[float] = []  # at the end of each back-off
    sleep = inf._sleep

    async def probing(seconds: float) -> None:
        await sleep(seconds)
        silent.append(inf.silent_for())

    inf._sleep = probing
    await until(lambda: inf.connected, "the first watch")
    run.clock.now += 15.0  # the renewal period
    release.set()
    await until(lambda: len(server.watch_from) == 3 and inf.connected, "the third watch")
    assert silent
    assert silent[-1] <= sum(run.slept) + 0.01, (silent, run.slept)


async def test_a_watch_that_fails_as_soon_as_it_opens_does_not_end_the_outage(
    make: Make,
) -> None:
    # Every watch is answered 200 and then an ERROR event (a server that cannot serve
    # the resourceVersion, a broken aggregation layer): no event ever reaches the cache.
    # Opening such a watch is no sign of life: the cache must be seen down and silent.
    n = 8
    broken = [[UnavailableError("watch things: internal error", status=500)] for _ in range(n)]
    server = Scripted(lists=[ListResult([thing("a", 5)], "10")], watches=[*broken, [HANG]])
    run = make(server)
    inf = run.informer
    seen: list[tuple[float, float, float]] = []  # (time slept so far, down, silent)
    sleep = inf._sleep

    async def probing(seconds: float) -> None:
        await sleep(seconds)
        seen.append((sum(run.slept), inf.down_for(), inf.silent_for()))

    inf._sleep = probing
    await until(lambda: len(server.watch_from) == n + 1 and inf.connected, "the retries")
    total, down, silent = seen[-1]
    assert total > 30, seen  # minutes of back-off without one event delivered
    assert down >= total - 1e-6, seen
    assert silent >= total - 1e-6, seen
    assert inf.down_for() == 0.0  # the last watch is up


async def test_a_watch_that_delivered_then_failed_restarts_the_down_clock(make: Make) -> None:
    release = asyncio.Event()
    server = Scripted(
        lists=[ListResult([], "10")],
        watches=[
            [event("ADDED", thing("a", 11)), release, UnavailableError("reset")],
            [HANG],
        ],
    )
    run = make(server)
    inf = run.informer
    await until(lambda: inf.events == 1, "the event")
    run.clock.now += 5.0
    release.set()
    await until(lambda: len(server.watch_from) == 2, "the re-watch")
    # Down since the failure (the back-off), not since before the watch opened.
    assert run.slept[0] <= 1.0
    assert inf.silent_for() <= 5.0 + run.slept[0]


# --- silence: readiness signal and idle bound ----------------------------------------------------


async def test_silence_is_measured_from_the_last_sign_of_life(make: Make) -> None:
    more = asyncio.Event()
    server = Scripted(
        lists=[ListResult([], "10")],
        watches=[[bookmark(11), more, bookmark(12), HANG]],
    )
    run = make(server)
    inf = run.informer
    await until(lambda: inf.resource_version == "11", "the first bookmark")
    assert inf.silent_for() == 0.0

    run.clock.now += 7.0
    # Silent, but still connected: a half-open connection looks exactly like this.
    assert (inf.silent_for(), inf.connected, inf.down_for()) == (7.0, True, 0.0)

    more.set()
    await until(lambda: inf.resource_version == "12", "the second bookmark")
    assert inf.silent_for() == 0.0


async def test_a_stream_silent_past_the_idle_bound_is_watched_again(make: Make) -> None:
    server = Scripted(
        lists=[ListResult([], "10")],
        watches=[[event("ADDED", thing("a", 11)), HANG], [HANG]],
    )
    # The idle bound runs on the event loop's real clock: keep it short.
    run = make(server, idle_timeout_s=0.05)
    inf = run.informer
    await until(lambda: len(server.watch_from) == 2, "the re-watch after the idle bound")
    assert server.watch_from == ["10", "11"]
    assert server.list_calls == 1
    assert len(run.slept) == 1
    assert 0.5 <= run.slept[0] <= 1.0
    assert inf.events == 1


async def test_every_event_moves_the_idle_bound(make: Make) -> None:
    # Twelve events 0.05 s apart: 0.6 s of traffic on a 0.5 s idle bound, never that long
    # quiet. The margin (0.45 s) is for a loaded machine: a stall that makes a step's
    # sleep and the idle timeout fall due in one loop turn lets the timeout win.
    steps: list[object] = []
    for i in range(12):
        steps += [0.05, event("ADDED", thing(f"t{i}", 11 + i))]
    server = Scripted(lists=[ListResult([], "10")], watches=[[*steps, HANG]])
    run = make(server, idle_timeout_s=0.5)
    await until(lambda: run.informer.events == 12, "the twelve events")
    assert server.watch_from == ["10"]
    assert run.slept == []


async def test_silence_then_idle_error_is_reported(make: Make) -> None:
    server = Scripted(lists=[ListResult([], "10")], watches=[[HANG]])
    run = make(server, idle_timeout_s=0.05)
    inf = run.informer
    await until(lambda: len(server.watch_from) == 2, "the re-watch")
    assert not inf.connected
    assert inf.last_error == "watch things: nothing received for 0.05s"


async def test_a_server_that_opens_every_watch_and_then_sends_nothing_is_seen_down(
    make: Make,
) -> None:
    # Every WATCH answered 200 and then nothing, never ended by the server (a wedged
    # handler, a proxy holding the stream after its upstream died): each stream stayed
    # open past the healthy mark until the idle limit, so it counted as a healthy watch,
    # and each re-open as a sign of life. The cache was never seen down or silent and
    # requests were decided on a frozen cache for good (found by review).
    n = 5
    runs: list[Run] = []

    def open_30_s() -> None:
        runs[0].clock.now += 30.0  # the idle limit's 30 s, on the fake clock

    silent_watches: list[list[object]] = [[open_30_s, HANG] for _ in range(n)]
    server = Scripted(
        lists=[ListResult([thing("a", 5)], "10")],
        watches=[*silent_watches, [bookmark(11), HANG]],
    )
    run = make(server, idle_timeout_s=0.02)
    runs.append(run)
    inf = run.informer
    seen: list[tuple[float, float, bool]] = []  # after each back-off: (down, silent, connected)
    sleep = inf._sleep

    async def probing(seconds: float) -> None:
        await sleep(seconds)
        seen.append((inf.down_for(), inf.silent_for(), inf.connected))

    inf._sleep = probing
    await until(lambda: inf.resource_version == "11", "the watch that delivers")
    down, silent, connected = seen[-1]
    # Down since the first silent stream ended (as any watch that went down: served for
    # stale_after_s more), not since the last one opened.
    assert down >= (n - 1) * 30, seen
    assert silent >= n * 30, seen
    assert not connected
    # One that delivers something is up again.
    assert (inf.connected, inf.down_for(), inf.silent_for()) == (True, 0.0, 0.0)


async def test_after_a_silent_watch_one_that_fails_otherwise_does_not_end_the_outage(
    make: Make,
) -> None:
    # A silent stream, then one that delivers nothing and is reset after the healthy
    # mark: it proved nothing either, so the outage goes on (found by review).
    runs: list[Run] = []

    def open_30_s() -> None:
        runs[0].clock.now += 30.0

    server = Scripted(
        lists=[ListResult([thing("a", 5)], "10")],
        watches=[[open_30_s, HANG], [open_30_s, UnavailableError("reset")], [HANG]],
    )
    run = make(server, idle_timeout_s=0.02)
    runs.append(run)
    inf = run.informer
    await until(lambda: len(server.watch_from) == 3, "the third watch")
    assert inf.down_for() >= 30.0  # since the silent stream ended, not since the reset
    assert not inf.connected


async def test_a_list_after_a_silent_watch_counts_as_delivered(make: Make) -> None:
    # A relist (410) after a silent stream: the LIST brought the whole state, and the
    # next watch is up at once instead of after its first renewal (found by review).
    runs: list[Run] = []

    def open_30_s() -> None:
        runs[0].clock.now += 30.0

    server = Scripted(
        lists=[ListResult([thing("a", 5)], "10"), ListResult([thing("a", 6)], "12")],
        watches=[[open_30_s, HANG], [ResourceExpiredError("too old", status=410)], [HANG]],
    )
    run = make(server, idle_timeout_s=0.02)
    runs.append(run)
    inf = run.informer
    await until(lambda: server.list_calls == 2 and len(server.watch_from) == 3, "the relist")
    await until(lambda: inf.connected, "the watch after the relist")
    assert inf.down_for() == 0.0


async def test_after_a_silent_stream_a_live_server_proves_itself_within_seconds(
    make: Make,
) -> None:
    # A frozen API server resumes: the watch opened after the silent one counts only
    # once it delivers, and on a quiet kind that was its renewal ~15 s later, while
    # requests failed on the cache gone stale (found by review). It asks the server to
    # end it within seconds: the renewal then comes at once.
    runs: list[Run] = []

    def open_30_s() -> None:
        runs[0].clock.now += 30.0

    def two_s() -> None:
        runs[0].clock.now += 2.0

    server = Scripted(
        lists=[ListResult([thing("a", 5)], "10")],
        watches=[[event("ADDED", thing("a", 11)), open_30_s, HANG], [two_s], [HANG]],
    )
    run = make(server, idle_timeout_s=0.02, watch_timeout_s=15)
    runs.append(run)
    inf = run.informer
    await until(lambda: len(server.watch_from) == 3, "the watch after the probe")
    # A stream that delivered and then fell silent counts too: the next one is a probe.
    assert server.timeouts[0] >= 15
    assert server.timeouts[1] <= 2
    assert server.timeouts[2] >= 15
    await until(lambda: inf.connected, "the third watch up")
    assert inf.down_for() == 0.0
    assert inf.silent_for() <= 2.0 + sum(run.slept) + 1e-6


# --- objects that do not decode --------------------------------------------------------------


async def test_undecodable_objects_are_reported_and_their_end_too() -> None:
    """A LIST's and a watch's undecodable objects reach on_undecodable with the failing
    path; a later decodable version, a DELETED event or a relist without the object end
    it (the invariant monitor counts them as allocation_malformed)."""
    path = "$.spec.committedResourceReservation.allocations[...].resources[...]"
    release = asyncio.Event()
    server = Scripted(
        lists=[
            ListResult([thing("a", 5)], "10", (("bad", path), ("worse", path))),
            ListResult([thing("a", 5)], "30"),
        ],
        watches=[
            [
                WatchEvent("MODIFIED", "a", "11", None, path),  # a turns undecodable
                WatchEvent("MODIFIED", "bad", "12", thing("bad", 12)),  # decodes again
                release,
                ResourceExpiredError("gone", status=410),  # relist: worse is gone
            ]
        ],
    )
    reports: list[tuple[str, str | None]] = []
    changes: list[tuple[Thing | None, Thing | None]] = []
    informer: Informer[Thing] = Informer(
        server,
        KIND,
        Thing,
        on_change=lambda old, new: changes.append((old, new)),
        on_undecodable=lambda name, where: reports.append((name, where)),
    )
    informer.start()
    try:
        await until(lambda: len(reports) >= 4, "the watch's reports")
        assert reports == [("bad", path), ("worse", path), ("a", path), ("bad", None)]
        assert informer.get("a") is None  # counts as absent meanwhile
        release.set()
        await until(lambda: server.list_calls == 2 and len(reports) >= 6, "the relist")
        assert sorted(reports[4:], key=str) == [("a", None), ("worse", None)]
    finally:
        await informer.stop()
