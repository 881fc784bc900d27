"""Partition ownership: take-over, fencing, re-acquisition, replays."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.structs import OffsetAndMetadata

from service.stream.engine import committer as committer_module
from service.stream.engine import ownership as ownership_module
from service.stream.engine import (
    transactional_id_for,
)
from tests.fake_kafka import FakeBroker, FakeProducer
from tests.unit.engine.harness import (
    IN,
    TP0,
    TP1,
    Harness,
    engine_task,
    now,
    outputs,
    straggler,
    until,
)


async def test_a_new_group_starts_at_the_end_with_latest_and_at_zero_with_earliest(
    broker: FakeBroker,
) -> None:
    for v in (b"a0", b"b0"):
        broker.append(IN, 0, v[:1], v)
    h = Harness(broker, group_id="new", auto_offset_reset="latest")
    await h.start(TP0)
    await h.part()
    broker.append(IN, 0, b"c", b"c0")  # published after the take-over
    await until(lambda: outputs(broker) == [b"c0"])
    await h.stop()
    assert h.processor.calls == [(0, 2)]  # the two before were skipped
    assert broker.committed[("new", TP0)].offset == 3
    # The same group again: it has committed, so "latest" no longer matters.
    again = Harness(broker, group_id="new", auto_offset_reset="latest")
    broker.append(IN, 0, b"d", b"d0")
    await again.start(TP0)
    await until(lambda: outputs(broker) == [b"c0", b"d0"])
    await again.stop()
    # Another new group with the default replays all of it.
    replay = Harness(broker, group_id="other")
    await replay.start(TP0)
    await until(lambda: len(outputs(broker)) == 6)
    await replay.stop()
    assert replay.processor.calls == [(0, 0), (0, 1), (0, 2), (0, 3)]


async def test_a_new_owner_skips_what_was_committed_above_the_watermark(
    broker: FakeBroker,
) -> None:
    first = Harness(broker)
    first.processor.gates[b"x0"] = asyncio.Event()  # never opened: the owner dies
    for v in (b"x0", b"y0", b"y1", b"w0"):
        broker.append(IN, 0, v[:1], v)
    await first.start(TP0)
    await until(lambda: sorted(outputs(broker)) == [b"w0", b"y0", b"y1"])
    await first.crash()
    second = Harness(broker)
    await second.start(TP0)
    await until(lambda: len(outputs(broker)) == 4)
    await second.stop()
    assert second.processor.calls == [(0, 0)]  # only the record that was not done
    assert sorted(outputs(broker)) == [b"w0", b"x0", b"y0", b"y1"]


async def test_a_fenced_owner_publishes_and_counts_nothing(broker: FakeBroker) -> None:
    # A re-check 0.3 s after the fence: well after the revoke below, even on a busy loop.
    zombie = Harness(broker, fence_recheck_s=0.3)
    gate = zombie.processor.gates[b"v0"] = asyncio.Event()
    broker.append(IN, 0, b"v", b"v0")
    await zombie.start(TP0)
    await until(lambda: zombie.processor.calls == [(0, 0)])
    # Another member takes the partition over while the zombie is paused mid-record.
    successor = FakeProducer(broker, transactional_id=transactional_id_for("g", TP0))
    await successor.start()
    gate.set()
    await until(lambda: zombie.metrics.fenced._value.get() == 1)
    assert outputs(broker) == []
    assert zombie.counted() == 0
    assert TP0 in zombie.consumer.paused()
    # Revoked before the re-check: it never re-initialises the id (that would fence
    # the rightful owner).
    recheck = engine_task("reacquire-fenced-0")
    zombie.consumer._assigned = set()
    zombie.service._table.assigned.clear()
    await until(recheck.done)  # the re-check ran (fence_recheck_s later) and gave up
    assert not recheck.cancelled()
    assert broker.epochs[transactional_id_for("g", TP0)] == successor.epoch
    zombie.service.request_stop()
    assert zombie.task is not None
    await asyncio.wait_for(zombie.task, 5)


async def test_a_cancelled_re_acquisition_stops_and_still_closes_the_producer(
    broker: FakeBroker,
) -> None:
    # A revoke cancels the task re-acquiring a partition while that task waits for the
    # old workers to end. Swallowing the cancellation there let it go on and take the
    # partition over a second time (fencing the live take-over).
    h = Harness(broker)
    await h.start(TP0)
    part = await h.part()
    release = asyncio.Event()

    async def worker() -> None:  # ends a moment after it is cancelled, as a PATCH does
        try:
            await asyncio.sleep(10)
        finally:
            await release.wait()

    part.tasks.add(asyncio.create_task(worker()))
    went_on: list[str] = []

    async def reacquire() -> None:
        await h.service._drop(part)
        went_on.append("acquire")

    task = asyncio.create_task(reacquire())
    await until(lambda: part.released)  # _drop cancelled the worker and waits for it
    task.cancel()
    await asyncio.sleep(0.01)
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert went_on == []
    assert part.producer.stopped
    await h.stop()


async def test_a_partition_taken_over_twice_keeps_only_the_newer_producer(
    broker: FakeBroker,
) -> None:
    # The second InitProducerId fenced the first producer: the first part must go, not
    # stay beside the new one with its committer and producer.
    h = Harness(broker)
    broker.append_numbered(IN, 0, range(5))
    await h.start(TP0)
    await until(lambda: len(outputs(broker)) == 5)
    first = h.service.partitions.owned[TP0]
    await h.service._acquire(TP0)
    second = h.service.partitions.owned[TP0]
    assert second is not first
    assert first.closed
    assert first.producer.stopped
    broker.append_numbered(IN, 0, range(5, 10))
    await until(lambda: len(outputs(broker)) == 10)
    assert sorted(outputs(broker)) == sorted(b"v%d" % i for i in range(10))
    await h.stop()


async def test_a_take_over_that_keeps_waiting_shows_in_readiness_and_clears_once_done(
    broker: FakeBroker,
) -> None:
    # aiokafka retries InitProducerId (CONCURRENT_TRANSACTIONS, a coordinator loading)
    # and the offset fetch without limit: no attempt ever failed, so the partition sat
    # paused with /readyz OK ("N partitions assigned"). Found by review.
    h = Harness(broker, commit_timeout_s=0.1, assign_wait_s=0.01)
    broker.init_delay_s = 0.6
    broker.append(IN, 0, b"k", b"v")
    await h.start(TP0)
    await until(lambda: TP0 in h.service.stalled(), limit_s=0.5)
    assert "still waiting" in h.service.stalled()[TP0]
    await until(lambda: outputs(broker) == [b"v"])
    assert h.service.stalled() == {}
    await h.stop()


async def test_a_take_over_answered_a_group_level_error_retries_not_starts_over(
    broker: FakeBroker,
) -> None:
    # A coordinator loading answers OffsetFetch with the error on top and no partition;
    # read as "never committed", the partition started over and its committed records
    # came out again (stop 29's CI). The take-over must fail, retry and start from 2.
    for v in (b"a", b"b", b"c"):
        broker.append(IN, 0, v, v)
    broker.committed[("g", TP0)] = OffsetAndMetadata(2, "")
    broker.offset_fetch_errors = [14, 16, 30]  # loading, moved, not authorised
    h = Harness(broker)
    await h.start(TP0)
    await until(lambda: outputs(broker) == [b"c"])
    await h.stop()
    assert h.processor.calls == [(0, 2)]
    assert broker.offset_fetches == 4
    assert h.consumer._coordinator.coordinator_deaths == 1  # NOT_COORDINATOR: look it up


async def test_a_slow_take_over_goes_on_after_the_assignment_callback_returns(
    broker: FakeBroker,
) -> None:
    # aiokafka does not heartbeat while on_partitions_assigned runs: a take-over slower
    # than the session timeout (a transaction coordinator still loading) must not hold it.
    h = Harness(broker, assign_wait_s=0.05)
    broker.init_delay_s = 0.5
    broker.append_numbered(IN, 0, range(5))
    started = now()
    await h.start(TP0)
    assert now() - started < 0.4
    assert TP0 in h.consumer.paused()  # nothing handed out before the fence is up
    await until(lambda: len(outputs(broker)) == 5)
    assert sorted(outputs(broker)) == [b"v%d" % i for i in range(5)]
    # Revoked while a take-over is still under way: it is called off, its producer closed.
    broker.append(IN, 1, b"k", b"w")
    await h.consumer.assign([TP0, TP1])
    taking_over = engine_task("acquire-1")
    await h.consumer.assign([TP0])
    await until(taking_over.done)  # called off (the InitProducerId takes 0.5 s)
    assert taking_over.cancelled()
    assert TP1 not in h.service.partitions.owned
    ones = [p for p in h.producers if p.txn_id and p.txn_id.endswith("-1")]
    assert ones
    assert all(p.stopped for p in ones)  # closed before the take-over ended
    await h.stop()


@pytest.mark.parametrize("failure", ["commit failed", "fenced"])
async def test_a_partition_given_back_after_its_revoke_commit_failed_is_taken_over_at_once(
    broker: FakeBroker, failure: str
) -> None:
    # The revoke's last commit fails (broker trouble, or fenced: a zombie woken from a
    # SIGSTOP is revoked first by its rejoin). The failure must not leave a delayed
    # re-acquisition behind: the eager rebalance gives the same partition back, and a
    # take-over still pending would make the assignment skip it for its back-off.
    h = Harness(
        broker,
        commit_interval_ms=60_000,
        commit_burst=1,
        retry_backoff_s=1.5,
        retry_backoff_max_s=1.5,
        fence_recheck_s=1.5,
    )
    broker.append(IN, 0, b"a", b"a0")
    await h.start(TP0)
    await until(lambda: outputs(broker) == [b"a0"])  # spends the only token
    broker.append(IN, 0, b"b", b"b0")
    gate = straggler(h)  # in progress: b0 waits for a token
    await until(lambda: h.service.partitions.owned[TP0].ledger.done_uncommitted == 1)
    gate.set()  # decided while the revoke waits for it: the revoke's commit carries both
    if failure == "fenced":
        other = FakeProducer(broker, transactional_id=transactional_id_for("g", TP0))
        await other.start()  # the member that took the partition over meanwhile
        await other.stop()
    else:
        broker.fail_commits = 1
    await h.consumer.assign([TP0])
    started = now()
    await until(lambda: TP0 in h.service.partitions.owned, limit_s=5)
    waited = now() - started
    await until(lambda: sorted(outputs(broker)) == [b"a0", b"b0", b"slow"])
    await h.stop()
    assert waited < 0.5, f"taken over again only after {waited:.2f}s"


async def test_a_partition_taken_over_after_failures_is_no_longer_reported_stalled(
    broker: FakeBroker,
) -> None:
    # Three failed take-overs mark it stalled (readiness 503); a successful one must clear
    # that even if no record ever arrives to be committed.
    h = Harness(broker)
    broker.fail_inits = 3
    await h.start(TP0)
    await h.part()
    assert h.service.stalled() == {}
    value = h.metrics.stalled.labels(IN, "0")._value.get()
    assert value == 0
    await h.stop()


async def test_a_take_over_clears_a_take_over_stall_but_not_a_commit_stall(
    broker: FakeBroker,
) -> None:
    # A partition whose commits keep failing is re-acquired after each failure; the
    # take-over succeeding says nothing about the commits, so readiness stays failed.
    h = Harness(broker)
    await h.start(TP0)
    await h.part()
    h.service._table.mark_stalled(TP0, "commit failing: KafkaConnectionError")
    h.service._table.parts.pop(TP0)
    await h.service._acquire(TP0)
    assert h.service.stalled() == {TP0: "commit failing: KafkaConnectionError"}
    await h.stop()


# A partition's own tasks ending by an error nobody foresaw (a bug, a MemoryError, a
# cancellation leaking out of a callee) left the partition stuck while every probe stayed
# green (found by an audit of the service's tasks): each is now taken over again
# (the lane worker's and processing's cases are in test_lanes.py).


async def test_a_committer_that_crashes_is_taken_over_again(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(broker)
    broker.append(IN, 0, b"k0", b"v0")
    await h.start(TP0)
    await until(lambda: outputs(broker) == [b"v0"])
    # In the commit loop itself, outside the commit (whose errors are commit failures).
    real = committer_module.TokenBucket.take
    crashed: list[bool] = []

    def take_once(bucket: Any) -> None:
        if not crashed:
            crashed.append(True)
            raise RuntimeError("a bug")
        real(bucket)

    monkeypatch.setattr(committer_module.TokenBucket, "take", take_once)
    broker.append_numbered(IN, 0, range(1, 21))
    await until(lambda: broker.committed[("g", TP0)].offset == 21)
    assert crashed
    assert sorted(outputs(broker)) == sorted(b"v%d" % i for i in range(21))  # each once
    assert not h.task.done()  # type: ignore[union-attr]
    await h.stop()


async def test_a_take_over_that_crashes_is_said_and_tried_again(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = ownership_module.Ledger
    crashed: list[bool] = []

    def ledger_once(*args: Any) -> Any:
        if not crashed:
            crashed.append(True)
            raise RuntimeError("a bug")
        return real(*args)

    monkeypatch.setattr(ownership_module, "Ledger", ledger_once)
    h = Harness(broker)
    broker.append(IN, 0, b"a", b"a0")
    await h.start(TP0)
    await until(lambda: outputs(broker) == [b"a0"])
    assert crashed
    assert TP0 not in h.service.stalled()  # cleared by the take-over that worked
    # The crashed take-over's producer was closed, not left open (one per retry).
    owner = h.service.partitions.owned[TP0].producer
    assert all(p.stopped for p in h.producers if p is not owner)
    await h.stop()


async def test_records_below_the_end_offset_at_the_take_over_are_processed_as_replays(
    broker: FakeBroker,
) -> None:
    # Those may have been processed by the partition's previous owner, whose write a
    # watch cache may not show yet: the Recorder reads the host fresh for them. Records
    # that arrive later were never anyone else's.
    broker.append_numbered(IN, 0, range(3))
    broker.committed[("g", TP0)] = OffsetAndMetadata(1, "")
    h = Harness(broker)
    await h.start(TP0)
    await until(lambda: len(outputs(broker)) == 2)
    broker.append(IN, 0, b"k3", b"v3")
    await until(lambda: len(outputs(broker)) == 3)
    assert h.processor.calls == [(0, 1), (0, 2), (0, 3)]
    assert h.processor.replays == {(0, 1), (0, 2)}
    await h.stop()
