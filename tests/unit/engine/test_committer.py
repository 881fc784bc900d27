"""The committer: commit triggers and pacing, transactions, commits of unknown outcome."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
from aiokafka.structs import OffsetAndMetadata

from service.stream.engine import transaction as transaction_module
from service.stream.partitioner import partition_for_key
from service.stream.processor import OutRecord
from tests.fake_kafka import FakeBroker, FakeProducer
from tests.unit.engine.harness import (
    IN,
    TP0,
    TP1,
    FakeClock,
    Harness,
    one_hanging_commit,
    outputs,
    slow_commits,
    straggler,
    transactions,
    until,
)


def frozen_clock_harness(broker: FakeBroker, **settings: Any) -> tuple[Harness, FakeClock]:
    """A harness whose engine runs on a clock only the test moves; its fetch pacing too
    runs on that clock, so there is no linger."""
    clock = FakeClock()
    return Harness(broker, clock=clock, fetch_linger_ms=0, **settings), clock


async def one_timed_out_commit(
    broker: FakeBroker, backoff_s: float, *, lands: bool
) -> tuple[Harness, Any]:
    """One record (k, v) whose commit outlives its timeout and then ``lands`` or is
    refused by the broker, which is fast again from then on; and the partition's part."""
    h, part = await slow_commits(broker, backoff_s)
    broker.fail_commits = 0 if lands else 1
    broker.append(IN, 0, b"k", b"v")
    if lands:
        await until(lambda: broker.commits == 1)  # landed after the timeout
    else:
        await until(lambda: broker.fail_commits == 0)
    broker.commit_delay_s = 0.0
    return h, part


async def stopped_having_published(
    h: Harness, values: list[bytes], *, calls: list[tuple[int, int]]
) -> None:
    """Stop ``h``; its broker holds ``values``, each counted once, and the processor was
    called for ``calls`` (input partition and offset), in that order."""
    await h.stop()
    assert outputs(h.broker) == values
    assert h.counted() == len(values)
    assert h.processor.calls == calls


async def one_record_left_to_the_revoke(
    broker: FakeBroker, value: bytes
) -> tuple[Harness, asyncio.Event]:
    """Partition 0 published a0 with its only commit token; ``value`` (key b) is decided
    and waits for the 60 s interval behind a straggler in progress (whose gate is
    returned), so only a revoke commits it; commits now take 0.3 s, past the revoke's
    0.1 s bound."""
    h = Harness(
        broker, commit_interval_ms=60_000, commit_burst=1, revoke_commit_s=0.1, revoke_wait_s=0.05
    )
    broker.append(IN, 0, b"a", b"a0")
    await h.start(TP0)
    await until(lambda: outputs(broker) == [b"a0"])  # spends the only token
    broker.append(IN, 0, b"b", value)
    gate = straggler(h)  # in progress: b waits for a token
    await until(lambda: h.uncommitted() == 1)
    broker.commit_delay_s = 0.3
    return h, gate


async def test_a_failed_commit_reprocesses_and_counts_each_event_once(broker: FakeBroker) -> None:
    h = Harness(broker)
    broker.fail_commits = 1
    broker.append_numbered(IN, 0, range(6))
    await h.start(TP0)
    await until(lambda: len(outputs(broker)) == 6)
    await h.stop()
    assert sorted(outputs(broker)) == sorted(b"v%d" % i for i in range(6))
    assert h.counted() == 6
    assert h.metrics.commit_failures.labels("transient")._value.get() == 1
    assert len(h.processor.calls) > 6  # what the failed transaction held was redone


async def test_commit_by_count_without_waiting_for_the_interval(broker: FakeBroker) -> None:
    # On a frozen clock the 60 s interval never passes: only the count commits.
    h, _ = frozen_clock_harness(
        broker, commit_interval_ms=60_000, commit_burst=1, commit_max_records=3
    )
    broker.append_numbered(IN, 0, range(3))
    await h.start(TP0)
    await until(lambda: len(outputs(broker)) == 3, limit_s=2)
    commits = broker.commits
    gate = straggler(h)  # under load: decided records wait for the interval or the count
    broker.append(IN, 0, b"k9", b"v9")
    await until(lambda: h.uncommitted() == 1)  # decided, the committer woken
    assert len(outputs(broker)) == 3  # one waiting record: the interval applies
    # Two more make the count: one commit of all three, so v9 was not committed alone.
    broker.append(IN, 0, b"k10", b"v10")
    broker.append(IN, 0, b"k11", b"v11")
    await until(lambda: len(outputs(broker)) == 6, limit_s=2)
    assert broker.commits == commits + 1
    broker.append(IN, 0, b"k12", b"v12")
    await until(lambda: h.uncommitted() == 1)
    assert len(outputs(broker)) == 6
    gate.set()  # nothing left in progress: committed at once, without a token
    await until(lambda: len(outputs(broker)) == 8, limit_s=2)
    assert broker.commits == commits + 2
    broker.append(IN, 0, b"k13", b"v13")
    await until(lambda: len(outputs(broker)) == 9, limit_s=2)
    await h.stop()


async def test_commit_by_time_at_most_once_per_interval(broker: FakeBroker) -> None:
    # The engine's clock is the test's: the interval passes when the test says so.
    h, clock = frozen_clock_harness(
        broker, commit_interval_ms=1000, commit_burst=1, commit_max_records=1000
    )
    broker.append(IN, 0, b"k", b"v")
    await h.start(TP0)
    # Quiet partition: committed at once (the clock has not moved, so no token was
    # earned: the commit spent the saved one).
    await until(lambda: len(outputs(broker)) == 1, limit_s=2)
    commits = broker.commits
    gate = straggler(h)  # under load from here on
    broker.append(IN, 0, b"j", b"w")
    await until(lambda: h.uncommitted() == 1)
    clock.now += 0.5  # within the interval: it waits for the next commit
    broker.append(IN, 0, b"i", b"x")  # a decision wakes the committer at 0.5 s
    await until(lambda: h.uncommitted() == 2)
    assert broker.commits == commits
    clock.now += 0.5  # the interval has passed
    broker.append(IN, 0, b"h", b"y")
    await until(lambda: len(outputs(broker)) == 4, limit_s=3)
    assert broker.commits == commits + 1  # w, x and y in the one commit: none at 0.5 s
    gate.set()
    await h.stop()


async def committed_one_by_one(h: Harness, n: int) -> None:
    """Append ``n`` records to partition 0, each once the previous one's output is
    committed (k0/v0, k1/v1, ...)."""
    for i in range(n):
        h.broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
        await until(lambda n=i + 1: len(outputs(h.broker)) == n, limit_s=2)  # type: ignore[misc]


async def test_a_quiet_partition_commits_a_burst_at_once_then_is_paced(
    broker: FakeBroker,
) -> None:
    # On a frozen clock no token is earned: the first three commits spend the saved ones.
    h, clock = frozen_clock_harness(
        broker, commit_interval_ms=1000, commit_burst=3, commit_max_records=1000
    )
    await h.start(TP0)
    await committed_one_by_one(h, 3)
    commits = broker.commits
    gate = straggler(h)  # under load from here on
    broker.append(IN, 0, b"k3", b"v3")
    broker.append(IN, 0, b"k4", b"v4")
    await until(lambda: h.uncommitted() == 2)  # decided, the committer woken
    assert broker.commits == commits  # the bucket is empty: paced by the interval
    clock.now += 1.0
    broker.append(IN, 0, b"k5", b"v5")
    await until(lambda: len(outputs(broker)) == 6, limit_s=2)
    assert broker.commits == commits + 1  # all three in the one paced commit
    gate.set()
    await h.stop()


async def test_a_partition_with_nothing_else_in_progress_commits_at_once_without_a_token(
    broker: FakeBroker,
) -> None:
    # Waiting for a token batches only records still in progress; with none, it would
    # only delay the output (bench_latency.py: the low-rate tail). On a frozen clock no
    # token is ever earned after the one saved: every commit after it is token-less.
    h, _ = frozen_clock_harness(
        broker, commit_interval_ms=60_000, commit_burst=1, commit_max_records=1000
    )
    await h.start(TP0)
    await committed_one_by_one(h, 4)
    assert h.uncommitted() == 0
    await h.stop()


async def test_a_commit_hands_over_its_outputs_before_its_offsets(broker: FakeBroker) -> None:
    # Outputs first: aiokafka then adds the group to the transaction while the records
    # are produced (4 sequential requests per transaction instead of 5).
    h = Harness(broker)
    broker.append_numbered(IN, 0, range(3))
    await h.start(TP0)
    await until(lambda: len(outputs(broker)) == 3)
    calls = h.service.partitions.owned[TP0].producer.calls
    await h.stop()
    begin, first_offsets = calls.index("begin"), calls.index("offsets")
    assert first_offsets > begin + 1
    assert set(calls[begin + 1 : first_offsets]) == {"send"}


@pytest.mark.parametrize("window_s", [10.0, 0.0])
async def test_a_transaction_right_after_another_sends_its_offsets_first(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch, window_s: float
) -> None:
    # The broker answers CONCURRENT_TRANSACTIONS until the previous transaction's markers
    # are written; aiokafka retries a first request that adds an output partition after
    # 20 ms, one that adds the group after the short back-off. Window 10 s: every
    # transaction but the first follows "closely"; window 0: none does.
    monkeypatch.setattr(transaction_module, "MARKERS_WINDOW_S", window_s)
    h = Harness(broker, txn_open_ahead_ms=0, fetch_linger_ms=0)
    broker.append(IN, 0, b"a", b"a0")
    await h.start(TP0)
    await until(lambda: outputs(broker) == [b"a0"])
    broker.append(IN, 0, b"b", b"b0")
    await until(lambda: outputs(broker) == [b"a0", b"b0"])
    txns = transactions(h.service.partitions.owned[TP0].producer.calls)
    await h.stop()
    assert txns[0] == ["begin", "send", "offsets", "commit"]
    second = ["begin", "offsets", "send", "commit"] if window_s else txns[0]
    assert txns[1] == second
    assert broker.committed[("g", TP0)].offset == 2


async def test_transactional_producers_get_the_short_retry_backoff(broker: FakeBroker) -> None:
    # aiokafka's default (100 ms) made each back-to-back transaction take 100 ms.
    h = Harness(broker, txn_retry_backoff_ms=7)
    await h.start(TP0)
    assert (await h.part()).producer.kwargs["retry_backoff_ms"] == 7
    # and Kafka's default key hashing, computed faster (service.stream.partitioner)
    assert h.service.partitions.owned[TP0].producer.kwargs["partitioner"] is partition_for_key
    await h.stop()


async def test_a_commit_cut_short_is_never_committed_again(broker: FakeBroker) -> None:
    # A cancel (the shutdown budget) landing while a commit waits for EndTxn: aiokafka
    # shields the EndTxn, so the transaction may commit all the same. Its outcome unknown,
    # the partition must not commit the same outputs again when it is released.
    h, part = await one_hanging_commit(broker, 0.2)
    assert part.committer is not None
    part.committer.cancel()
    await until(lambda: broker.commits == 1)  # the shielded commit lands
    await h.service.close()
    assert outputs(broker) == [b"v"]
    await h.ended()


async def test_a_commit_that_timed_out_but_landed_is_counted_once_on_take_over(
    broker: FakeBroker,
) -> None:
    # The commit outlives commit_timeout_s and lands anyway (aiokafka shields EndTxn):
    # taken over again, the partition starts after those records, so nobody processes
    # them again, and their counts must be applied then, once, or they are never counted.
    h, part = await one_timed_out_commit(broker, 0.5, lands=True)
    assert h.counted() == 0  # the engine does not know yet
    await h.retaken(part)
    await until(lambda: h.counted() == 1)
    broker.append(IN, 0, b"k", b"w")
    await until(lambda: len(outputs(broker)) == 2)
    await stopped_having_published(h, [b"v", b"w"], calls=[(0, 0), (0, 1)])


async def test_a_landed_commit_is_counted_when_a_rebalance_gives_the_partition_back(
    broker: FakeBroker,
) -> None:
    # The commit times out and lands; before the re-acquisition's back-off ends, an eager
    # rebalance revokes the partition and gives it back. The take-over (epoch exactly +1:
    # nobody else initialised the id) must still know the commit was this member's, or
    # its event is published and counted by nobody.
    h, part = await one_timed_out_commit(broker, 1.0, lands=True)
    await h.consumer.assign([TP0])  # revoked, and given back
    await h.retaken(part)
    await until(lambda: h.counted() == 1)
    await stopped_having_published(h, [b"v"], calls=[(0, 0)])  # not redone


async def test_a_commit_cut_short_by_a_revoke_is_counted_when_the_partition_comes_back(
    broker: FakeBroker,
) -> None:
    # The revoke's last commit outlives the revoke's bound and lands. Given back with
    # nobody in between, the take-over finds exactly that commit: counted then, once.
    h, gate = await one_record_left_to_the_revoke(broker, b"b0")
    broker.init_delay_s = 0.5  # the take-over's InitProducerId waits for the EndTxn
    await h.consumer.assign([TP0])  # revoke (its commit cut short, landing later) + assign
    await until(lambda: outputs(broker) == [b"a0", b"b0"])
    broker.commit_delay_s = broker.init_delay_s = 0.0
    await until(lambda: TP0 in h.service.partitions.owned)
    gate.set()  # the straggler, never decided before the revoke, is redone and counted
    await until(lambda: h.counted() == 3)
    await h.stop()
    assert h.processor.calls.count((0, 1)) == 1  # b: not redone


async def test_a_commit_of_unknown_outcome_is_remembered_without_its_records(
    broker: FakeBroker,
) -> None:
    # What a take-over needs to count a commit that landed after all is its position,
    # counts and sender; a partition that moved to another member keeps that entry for
    # the life of the process, so it must not hold the outputs (a dead letter carries its
    # input's value, up to a megabyte) of every partition that ever moved away so.
    h, _ = await one_record_left_to_the_revoke(broker, b"b0" * 1000)  # the straggler stays
    await h.consumer.assign([])  # revoked, its commit cut short, not given back
    await until(lambda: TP0 not in h.service.partitions.owned)
    assert TP0 in h.service.partitions.unsure

    def payloads(obj: object, depth: int = 0) -> list[object]:
        if isinstance(obj, (OutRecord, bytes)) and obj != b"":
            return [obj]
        if depth > 6 or isinstance(obj, (str, int, float, type)):
            return []
        found: list[object] = []
        for ref in gc.get_referents(obj):
            found += payloads(ref, depth + 1)
        return found

    assert payloads(h.service.partitions.unsure[TP0]) == []
    await h.stop()


async def test_landed_commits_clear_the_commit_stall_of_a_quiet_partition(
    broker: FakeBroker,
) -> None:
    # Three commits outlive commit_timeout_s and land; each take-over proves it and
    # counts it. Nothing is left to commit, so no later commit would clear "commit
    # failing": the landed commits themselves must, or /readyz stays 503 on a healthy
    # partition until new input arrives.
    h, part = await slow_commits(broker, 0.3)
    for i in range(3):
        broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
        await until(lambda n=i + 1: broker.commits == n)
        part = await h.retaken(part)
        await until(lambda n=i + 1: h.counted() == n)
    broker.commit_delay_s = 0.0
    stalled = h.service.stalled()
    await h.stop()
    assert outputs(broker) == [b"v0", b"v1", b"v2"]
    assert stalled == {}, stalled


async def test_a_commit_that_timed_out_and_failed_counts_only_its_redo(
    broker: FakeBroker,
) -> None:
    # The same commit timing out, but refused by the broker in the end: redone, counted once.
    h, _ = await one_timed_out_commit(broker, 0.5, lands=False)
    await until(lambda: len(outputs(broker)) == 1)
    await stopped_having_published(h, [b"v"], calls=[(0, 0), (0, 0)])


async def test_a_commit_that_timed_out_is_not_counted_when_another_owner_committed_the_same(
    broker: FakeBroker,
) -> None:
    # The commit times out and does not land; meanwhile another member initialises the
    # partition's transactional id, redoes the record (counting it) and commits the very
    # offset and metadata this one would have. Taken over again, this replica must not
    # count the record a second time.
    h, part = await one_timed_out_commit(broker, 0.5, lands=False)
    txn_id = part.producer.txn_id
    broker.epochs[txn_id] += 1  # the other owner's InitProducerId
    broker.committed[("g", TP0)] = OffsetAndMetadata(1, "")
    await h.retaken(part)
    # The take-over settled the unsure commit (counted or not) before it installed the
    # partition: its decision is made.
    assert TP0 not in h.service.partitions.unsure
    await h.stop()
    assert h.counted() == 0
    assert h.processor.calls == [(0, 0)]


async def test_a_commit_past_its_timeout_is_aborted_but_a_released_one_is_not(
    broker: FakeBroker,
) -> None:
    # A commit cut short by commit_timeout_s aborts its transaction at once, as any failed
    # commit (read_committed readers of the outputs would wait at it otherwise); one cut
    # short while its partition is released (a revoke, where no heartbeat is sent) leaves
    # it to the next owner rather than wait for the broker.
    h = Harness(broker, commit_timeout_s=1.0, revoke_wait_s=0.1, revoke_commit_s=0.2)
    await h.start(TP0)
    part = await h.part()
    broker.offsets_delay_s = 1.5
    broker.append(IN, 0, b"k", b"v")
    await until(lambda: "abort" in part.producer.calls)  # timed out: aborted
    again = await h.retaken(part)
    broker.offsets_delay_s = 5.0
    broker.append(IN, 0, b"k", b"w")
    await until(lambda: "offsets" in again.producer.calls)
    await h.consumer.assign([])  # revoked while the commit hangs
    assert "abort" not in again.producer.calls
    await h.stop()


@pytest.mark.parametrize("exactly_once", [True, False])
async def test_both_delivery_modes_commit_every_record(
    broker: FakeBroker, exactly_once: bool
) -> None:
    h = Harness(broker, exactly_once=exactly_once)
    for i in range(20):
        broker.append(IN, i % 2, b"k%d" % (i % 5), b"v%d" % i)
    await h.start(TP0, TP1)
    await until(lambda: len(outputs(broker)) == 20)
    await h.stop()
    assert broker.committed[("g", TP0)].offset == 10
    assert broker.committed[("g", TP1)].offset == 10
    assert h.counted() == 20


async def test_a_cancelled_error_leaking_out_of_a_commit_is_a_failed_commit(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, the commit's part was closed as if cancelled: left in place, nothing
    # committed, logged or retried.
    real = FakeProducer.send_offsets_to_transaction
    leaked: list[bool] = []

    async def leaking_once(producer: Any, offsets: Any, group_id: str) -> None:
        if not leaked:
            leaked.append(True)
            raise asyncio.CancelledError
        await real(producer, offsets, group_id)

    monkeypatch.setattr(FakeProducer, "send_offsets_to_transaction", leaking_once)
    h = Harness(broker)
    broker.append(IN, 0, b"k0", b"v0")
    await h.start(TP0)
    broker.append_numbered(IN, 0, range(1, 6))
    await until(lambda: ("g", TP0) in broker.committed)
    await until(lambda: broker.committed[("g", TP0)].offset == 6)
    assert leaked
    assert sorted(outputs(broker)) == sorted(b"v%d" % i for i in range(6))  # each once
    await h.stop()
