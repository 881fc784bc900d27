"""Releasing partitions: revoke and close commit what is decided, once."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tests.fake_kafka import FakeBroker
from tests.unit.engine.harness import IN, TP0, TP1, Harness, now, one_hanging_commit, outputs, until


async def test_close_leaves_the_group_even_when_its_last_commit_is_cut_short(
    broker: FakeBroker,
) -> None:
    # The shutdown budget cancels close() while the final commit hangs on a broker in
    # trouble; the consumer must still be stopped (LeaveGroup: partitions move at once).
    h, part = await one_hanging_commit(broker, 60.0, commit_timeout_s=30.0)
    consumer, producer = h.consumer, part.producer
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(h.service.close(), 0.2)
    assert consumer.stopped
    assert producer.stopped
    await h.ended()


async def test_a_revoke_bounds_its_last_commits_and_commits_nothing_twice(
    broker: FakeBroker,
) -> None:
    # Inside the rebalance (no heartbeat): commits hanging on a broker in trouble must not
    # hold it for commit_timeout_s each, one partition after the other.
    h = Harness(broker, revoke_wait_s=0.1, revoke_commit_s=0.2, commit_timeout_s=30.0)
    await h.start(TP0, TP1)
    parts = [await h.part(TP0), await h.part(TP1)]
    broker.commit_delay_s = 1.0
    broker.append(IN, 0, b"k", b"v0")
    broker.append(IN, 1, b"k", b"v1")
    await until(lambda: all("commit" in p.producer.calls for p in parts))
    started = now()
    await h.consumer.assign([])  # both revoked while their commits hang
    assert now() - started < 0.5
    assert all(p.closed for p in parts)
    await until(lambda: all(p.producer.stopped for p in parts))  # closed in the background
    # The shielded commits land after all (commit_delay_s after they began).
    await until(lambda: sorted(outputs(broker)) == [b"v0", b"v1"])
    broker.commit_delay_s = 0.0
    await h.consumer.assign([TP0, TP1])  # taken over again: nothing published twice
    for old in parts:
        await h.retaken(old, old.tp)
    # A later record on each runs through the new owners' lanes and commits: whatever
    # they would have redone would be published by now.
    broker.append(IN, 0, b"k", b"w0")
    broker.append(IN, 1, b"k", b"w1")
    await until(lambda: len(outputs(broker)) >= 4)
    assert sorted(outputs(broker)) == [b"v0", b"v1", b"w0", b"w1"]
    await h.stop()


async def test_a_revoke_does_not_wait_for_its_producers_to_close(broker: FakeBroker) -> None:
    # Closing a producer whose commit was cut short waits for the broker; inside the
    # rebalance (no heartbeat) that must not add to the revoke's bound. They close in
    # the background, and close() still waits for them.
    broker.stop_delay_s = 2.0
    h, part = await one_hanging_commit(
        broker, 1.0, revoke_wait_s=0.1, revoke_commit_s=0.2, commit_timeout_s=30.0
    )
    started = now()
    await h.consumer.assign([])
    assert now() - started < 0.6
    assert not part.producer.stopped  # still closing
    await h.stop()
    assert part.producer.stopped  # close() waited for it


async def test_a_release_cancelled_mid_commit_leaves_no_commit_running(
    broker: FakeBroker,
) -> None:
    # The shutdown budget cancels run() while its release waits for a hanging commit:
    # the release's own commit tasks must end with it, not go on beside close().
    h, _ = await one_hanging_commit(broker, 1.0)
    h.service.request_stop()
    # run() is releasing: its last commit waits for the hanging one.
    await until(lambda: any("_last_commit" in repr(t.get_coro()) for t in asyncio.all_tasks()))
    assert h.task is not None
    h.task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await h.task
    await asyncio.sleep(0)
    running = [t for t in asyncio.all_tasks() if "_last_commit" in repr(t.get_coro())]
    assert running == []
    await h.service.close()


async def test_no_transaction_begins_after_a_releases_last_commit(broker: FakeBroker) -> None:
    # A record decided during the release's last commit woke the committer, which took
    # the lock after that commit and began a transaction; the release then cancelled it
    # and closed the producer with the transaction open: read_committed readers of the
    # outputs held back until the broker's transaction timeout (nobody re-initialises
    # the id after a scale to 0).
    h = Harness(
        broker, stop_wait_s=0.05, commit_interval_ms=60_000, commit_burst=1, commit_max_records=2
    )
    gate = h.processor.gates[b"a0"] = asyncio.Event()
    broker.append(IN, 0, b"a", b"a0")
    broker.append(IN, 0, b"b", b"b0")
    await h.start(TP0)
    part = await h.part()
    await until(lambda: outputs(broker) == [b"b0"])  # spends the only token
    broker.append(IN, 0, b"c", b"c0")
    await until(lambda: part.ledger.done_uncommitted == 1)  # c0 waits for a token
    broker.commit_delay_s = 0.3
    h.service.request_stop()
    await until(lambda: part.producer.calls.count("commit") == 2)  # the release's last
    gate.set()  # a0 decided while that commit waits for EndTxn
    assert h.task is not None
    await asyncio.wait_for(h.task, 5)
    await h.service.close()
    calls = part.producer.calls
    last_begin = len(calls) - 1 - calls[::-1].index("begin")
    assert calls[last_begin:].count("commit") + calls[last_begin:].count("abort") == 1, calls
    assert sorted(outputs(broker)) == [b"b0", b"c0"]  # a0: the next owner's


async def test_revoke_commits_what_is_decided_and_closes_the_producer(broker: FakeBroker) -> None:
    h = Harness(broker)
    broker.append_numbered(IN, 0, range(4))
    await h.start(TP0)
    await until(lambda: h.service.processed == 4)
    producer = h.service.partitions.owned[TP0].producer
    await h.consumer.assign([TP1])
    assert producer.stopped
    assert TP0 not in h.service.partitions.owned
    assert broker.committed[("g", TP0)].offset == 4
    await h.stop()


async def test_a_revoke_aborts_a_transaction_open_ahead(broker: FakeBroker) -> None:
    h = Harness(broker, revoke_wait_s=0.05)
    broker.append(IN, 0, b"k0", b"v0")
    await h.start(TP0)
    await until(lambda: outputs(broker) == [b"v0"])  # committed: offset 1
    h.processor.gates[b"v1"] = asyncio.Event()  # never decided
    broker.append(IN, 0, b"k1", b"v1")
    producer = h.service.partitions.owned[TP0].producer
    await until(lambda: producer.calls[-2:] == ["begin", "offsets"])
    await h.service._on_revoked([TP0])
    assert producer.calls[-1] == "abort"
    assert not producer.in_transaction
    assert broker.committed[("g", TP0)].offset == 1  # not 2, the offset sent ahead
    await h.stop()
