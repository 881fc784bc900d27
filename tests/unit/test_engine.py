"""The stream engine's bookkeeping against an in-memory Kafka (milliseconds per test).

Key lanes, the committed watermark with done-above metadata, commit triggers, back-
pressure, fencing, re-acquisition after a failed commit, stub dead letters and counting
on commit. The same behaviours run on the real broker in tests/integration
(test_service_resilience.py, test_engine_faults.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio
from aiokafka.errors import ConsumerStoppedError, KafkaConnectionError, KafkaError
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from service.stream.codec import InputRef, encode_input
from service.stream.engine import (
    KafkaClientEnded,
    StreamService,
    StreamSettings,
    transactional_id_for,
)
from service.stream.engine import committer as committer_module
from service.stream.engine import lanes as lanes_module
from service.stream.engine import ownership as ownership_module
from service.stream.engine import transaction as transaction_module
from service.stream.metrics import StreamMetrics
from service.stream.partitioner import partition_for_key
from service.stream.processor import OutRecord, Processor, RetryLater
from tests import e2e
from tests.fake_kafka import FakeBroker, FakeConsumer, FakeProducer

IN = "in"
TP0 = TopicPartition(IN, 0)
TP1 = TopicPartition(IN, 1)


@dataclass
class FakeProcessor:
    metrics: StreamMetrics
    dlq_topic: str = "dlq"
    output_topic: str = "out"
    gates: dict[bytes, asyncio.Event] = field(default_factory=dict)
    retries: dict[bytes, int] = field(default_factory=dict)
    calls: list[tuple[int, int]] = field(default_factory=list)
    replays: set[tuple[int, int]] = field(default_factory=set)  # processed as a replay
    running: int = 0
    max_running: int = 0

    async def process(
        self,
        ref: InputRef,
        key: bytes | None,
        value: bytes | None,
        headers: Any,
        *,
        attempt: int = 1,
        replay: bool = False,
    ) -> OutRecord:
        assert value is not None
        self.calls.append((ref.partition, ref.offset))
        if replay:
            self.replays.add((ref.partition, ref.offset))
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            gate = self.gates.get(value)
            if gate is not None:
                await gate.wait()
            if attempt <= self.retries.get(value, 0):
                raise RetryLater(RuntimeError("api down"), attempt)
            self.metrics.events.labels("placement", "slot_used").inc()
            return OutRecord(topic="out", key=key, value=value, headers=[])
        finally:
            self.running -= 1

    def stub(self, ref: InputRef, key: Any, value: Any, code: str, reason: str, **kw: Any) -> Any:
        # The real processor's stub: what the engine publishes is the service's own.
        real = Processor.__new__(Processor)
        real._dlq_topic = self.dlq_topic
        real._metrics = self.metrics
        return Processor.stub(real, ref, key, value, code, reason, **kw)


class Harness:
    def __init__(self, broker: FakeBroker, **settings: Any) -> None:
        self.broker = broker
        self.metrics = StreamMetrics()
        self.processor = FakeProcessor(self.metrics)
        self.producers: list[FakeProducer] = []
        base: dict[str, Any] = {
            "input_topic": IN,
            "group_id": "g",
            "retry_backoff_s": 0.01,
            "retry_backoff_max_s": 0.05,
            "poll_timeout_ms": 20,
            "commit_interval_ms": 5,
            "fence_recheck_s": 0.05,
            "revoke_wait_s": 0.5,
        }
        self.service = StreamService(
            StreamSettings(**(base | settings)),
            self.processor,  # type: ignore[arg-type]
            self.metrics,
            consumer_factory=lambda **kw: FakeConsumer(broker, **kw),
            producer_factory=self._producer,
        )
        self.task: asyncio.Task[None] | None = None

    def _producer(self, **kwargs: Any) -> FakeProducer:
        producer = FakeProducer(self.broker, **kwargs)
        self.producers.append(producer)
        return producer

    def gated_records(self, n: int) -> asyncio.Event:
        """``n`` records on partition 0 (keys k0.., values v0..), each processed only once
        the returned gate is set (records stuck on the Kubernetes API)."""
        gate = asyncio.Event()
        for i in range(n):
            self.processor.gates[b"v%d" % i] = gate
            self.broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
        return gate

    @property
    def consumer(self) -> FakeConsumer:
        return self.service._consumer  # type: ignore[no-any-return]

    async def start(self, *tps: TopicPartition) -> None:
        await self.service.start()
        await self.consumer.assign(list(tps))
        self.task = asyncio.create_task(self.service.run())

    async def part(self, tp: TopicPartition = TP0) -> Any:
        """``tp``'s partition state, once it has been taken over."""
        await until(lambda: tp in self.service.partitions.owned)
        return self.service.partitions.owned[tp]

    async def retaken(self, old: Any, tp: TopicPartition = TP0) -> Any:
        """``tp``'s partition state once it has been taken over again after ``old``."""
        await until(lambda: self.service.partitions.owned.get(tp) not in (None, old))
        return self.service.partitions.owned[tp]

    async def stop(self) -> None:
        self.service.request_stop()
        assert self.task is not None
        await asyncio.wait_for(self.task, 5)
        await self.service.close()

    async def ended(self) -> None:
        """The run loop ended, after a close() without request_stop(): it must not turn
        on for the rest of the session beside every later test."""
        assert self.task is not None
        with contextlib.suppress(ConsumerStoppedError, asyncio.CancelledError):
            await asyncio.wait_for(self.task, 5)

    async def crash(self) -> None:
        """Gone without committing or closing anything (SIGKILL)."""
        assert self.task is not None
        self.task.cancel()
        for part in list(self.service.partitions.owned.values()):
            for t in [*part.tasks, *([part.committer] if part.committer else [])]:
                t.cancel()

    def counted(self) -> float:
        return self.metrics.events.labels("placement", "slot_used")._value.get()  # type: ignore[no-any-return]


@pytest_asyncio.fixture
async def broker() -> AsyncIterator[FakeBroker]:
    yield FakeBroker()


async def until(pred: Callable[[], bool], limit_s: float = 3.0) -> None:
    deadline = time.monotonic() + limit_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def outputs(broker: FakeBroker) -> list[bytes]:
    return [r.value for r in broker.outputs if r.value is not None]


async def test_different_keys_run_concurrently_and_one_key_in_order(broker: FakeBroker) -> None:
    h = Harness(broker)
    gate = h.processor.gates[b"a0"] = asyncio.Event()
    for v in (b"a0", b"b0", b"a1", b"b1", b"a2"):
        broker.append(IN, 0, v[:1], v)
    await h.start(TP0)
    await until(lambda: outputs(broker) == [b"b0", b"b1"])
    assert (0, 2) not in h.processor.calls  # a1 waits for a0: same key
    gate.set()
    await until(lambda: len(outputs(broker)) == 5)
    assert [v for v in outputs(broker) if v.startswith(b"a")] == [b"a0", b"a1", b"a2"]
    await h.stop()
    assert broker.committed[("g", TP0)].offset == 5


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


async def test_a_stuck_record_holds_neither_other_keys_nor_other_partitions(
    broker: FakeBroker,
) -> None:
    h = Harness(broker)
    gate = h.processor.gates[b"x0"] = asyncio.Event()
    broker.append(IN, 0, b"x", b"x0")
    broker.append(IN, 0, b"y", b"y0")
    broker.append(IN, 1, b"z", b"z0")
    await h.start(TP0, TP1)
    await until(lambda: sorted(outputs(broker)) == [b"y0", b"z0"])
    # The committed offset stays at the stuck record; the metadata says 1 is done.
    committed = broker.committed[("g", TP0)]
    assert committed.offset == 0
    assert committed.metadata.startswith("crs1:")
    gate.set()
    await until(lambda: len(outputs(broker)) == 3)
    await h.stop()
    assert broker.committed[("g", TP0)].offset == 2


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
    zombie = Harness(broker)
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
    zombie.consumer._assigned = set()
    zombie.service._table.assigned.clear()
    await asyncio.sleep(0.1)
    assert broker.epochs[transactional_id_for("g", TP0)] == successor.epoch
    zombie.service.request_stop()
    assert zombie.task is not None
    await asyncio.wait_for(zombie.task, 5)


async def test_a_failed_commit_reprocesses_and_counts_each_event_once(broker: FakeBroker) -> None:
    h = Harness(broker)
    broker.fail_commits = 1
    for i in range(6):
        broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
    await h.start(TP0)
    await until(lambda: len(outputs(broker)) == 6)
    await h.stop()
    assert sorted(outputs(broker)) == sorted(b"v%d" % i for i in range(6))
    assert h.counted() == 6
    assert h.metrics.commit_failures.labels("transient")._value.get() == 1
    assert len(h.processor.calls) > 6  # what the failed transaction held was redone


async def test_commit_by_count_without_waiting_for_the_interval(broker: FakeBroker) -> None:
    h = Harness(broker, commit_interval_ms=60_000, commit_burst=1, commit_max_records=3)
    for i in range(3):
        broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
    await h.start(TP0)
    await until(lambda: len(outputs(broker)) == 3, limit_s=2)
    broker.append(IN, 0, b"k9", b"v9")
    await asyncio.sleep(0.3)
    assert len(outputs(broker)) == 3  # one waiting record: the interval applies
    await h.stop()  # stopping commits what is decided
    assert len(outputs(broker)) == 4


async def test_commit_by_time_at_most_once_per_interval(broker: FakeBroker) -> None:
    # A 1 s interval: the margins below must outlast a busy machine's loop stalls.
    h = Harness(broker, commit_interval_ms=1000, commit_burst=1, commit_max_records=1000)
    broker.append(IN, 0, b"k", b"v")
    await h.start(TP0)
    started = time.monotonic()
    await until(lambda: len(outputs(broker)) == 1, limit_s=2)
    assert time.monotonic() - started < 0.8  # quiet partition: committed at once
    commits = broker.commits
    broker.append(IN, 0, b"j", b"w")
    await asyncio.sleep(0.1)
    assert broker.commits == commits  # within the interval: it waits for the next commit
    await until(lambda: len(outputs(broker)) == 2, limit_s=3)
    assert time.monotonic() - started >= 0.95
    await h.stop()


async def test_a_quiet_partition_commits_a_burst_at_once_then_is_paced(
    broker: FakeBroker,
) -> None:
    # A 1 s interval: the margins below must outlast a busy machine's loop stalls.
    h = Harness(broker, commit_interval_ms=1000, commit_burst=3, commit_max_records=1000)
    await h.start(TP0)
    started = time.monotonic()
    for i in range(3):  # one by one, each after the previous one's commit
        broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
        await until(lambda n=i + 1: len(outputs(broker)) == n, limit_s=2)  # type: ignore[misc]
    assert time.monotonic() - started < 0.8  # three saved commits: none waited
    commits = broker.commits
    broker.append(IN, 0, b"k3", b"v3")
    broker.append(IN, 0, b"k4", b"v4")
    await asyncio.sleep(0.1)
    assert broker.commits == commits  # the bucket is empty: paced by the interval
    await until(lambda: len(outputs(broker)) == 5, limit_s=2)
    assert broker.commits == commits + 1  # both in the one paced commit
    await h.stop()


async def test_fetch_linger_paces_fetches_that_bring_records_only(broker: FakeBroker) -> None:
    h = Harness(broker, fetch_linger_ms=150)
    await h.start(TP0)
    await h.part()
    for i in range(3):  # each fetch brings one record: the next waits out the linger
        broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
        await until(lambda n=i + 1: len(outputs(broker)) == n, limit_s=2)  # type: ignore[misc]
    await asyncio.sleep(0.4)  # idle: empty fetches (poll_timeout_ms = 20 ms)
    await h.stop()
    calls, returns = h.consumer.asked_at, h.consumer.returned
    after_records = [
        calls[k + 1] - returned
        for k, (returned, n) in enumerate(returns)
        if n and k + 1 < len(calls)
    ]
    assert len(after_records) >= 2
    assert min(after_records) >= 0.14  # the next fetch waited out the linger
    after_empty = [
        calls[k + 1] - t for k, (t, n) in enumerate(returns) if not n and k + 1 < len(calls)
    ]
    assert after_empty
    assert min(after_empty) < 0.05  # an empty fetch is followed at once


async def test_a_commit_hands_over_its_outputs_before_its_offsets(broker: FakeBroker) -> None:
    # Outputs first: aiokafka then adds the group to the transaction while the records
    # are produced (4 sequential requests per transaction instead of 5).
    h = Harness(broker)
    for i in range(3):
        broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
    await h.start(TP0)
    await until(lambda: len(outputs(broker)) == 3)
    calls = h.service.partitions.owned[TP0].producer.calls
    await h.stop()
    begin, first_offsets = calls.index("begin"), calls.index("offsets")
    assert first_offsets > begin + 1
    assert set(calls[begin + 1 : first_offsets]) == {"send"}


def transactions(calls: list[str]) -> list[list[str]]:
    """A producer's calls, one list per transaction (each starts with "begin")."""
    out: list[list[str]] = []
    for call in calls:
        if call == "begin":
            out.append([])
        if out:
            out[-1].append(call)
    return out


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


async def test_backpressure_stops_asking_for_the_partition_without_pausing_it(
    broker: FakeBroker,
) -> None:
    # Not consumer.pause(): aiokafka drops a paused partition's fetched records and
    # fetches them again on resume.
    h = Harness(broker, max_in_flight=4, max_batch=2)
    gate = h.gated_records(10)
    await h.start(TP0)
    await until(lambda: h.service.partitions.owned[TP0].backpressured)
    asked = len(h.consumer.asked)
    await asyncio.sleep(0.1)
    assert all(TP0 not in a for a in h.consumer.asked[asked:])
    assert TP0 not in h.consumer.paused()
    assert h.processor.max_running <= 4
    gate.set()
    await until(lambda: len(outputs(broker)) == 10)
    # Lifted once the commit has returned, which the outputs may be seen before.
    await until(lambda: not h.service.partitions.owned[TP0].backpressured)
    await h.stop()


async def test_a_bound_of_one_record_in_flight_keeps_the_partition_flowing(
    broker: FakeBroker,
) -> None:
    # CRS_MAX_IN_FLIGHT=1 (strictly one record at a time) is a valid setting: the
    # backpressure it sets after each record must lift once that record is committed,
    # not wait for the keep-alive's one record per poll_keepalive_s.
    h = Harness(broker, max_in_flight=1, poll_keepalive_s=60.0)
    broker.append(IN, 0, b"k0", b"v0")
    await h.start(TP0)
    await until(lambda: len(outputs(broker)) == 1)
    broker.append(IN, 0, b"k1", b"v1")
    await until(lambda: len(outputs(broker)) == 2, limit_s=3.0)
    # Lifted once the commit has returned, which the outputs may be seen before (a busy
    # CI machine saw it still set).
    await until(lambda: not h.service.partitions.owned[TP0].backpressured)
    await h.stop()


async def test_a_partition_full_for_long_is_still_asked_for_one_record_now_and_then(
    broker: FakeBroker,
) -> None:
    # aiokafka makes a member leave the group when getmany() was not called for
    # max_poll_interval_ms; a full partition must not stop the calls for that long.
    h = Harness(broker, max_in_flight=4, max_batch=2, poll_keepalive_s=0.05)
    gate = h.gated_records(40)
    await h.start(TP0)
    await until(lambda: h.service.partitions.owned[TP0].backpressured)
    calls, started = len(h.consumer.asked), time.monotonic()
    await until(lambda: len(h.consumer.asked) - calls >= 6)  # kept asking while full
    in_flight, elapsed = (
        h.service.partitions.owned[TP0].ledger.in_flight,
        time.monotonic() - started,
    )
    assert in_flight <= 4 + 1 + elapsed / 0.05  # one record per keep-alive at most
    gate.set()
    await until(lambda: len(outputs(broker)) == 40)
    await h.stop()


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
    await asyncio.sleep(0.01)  # waiting for the worker
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
    for i in range(5):
        broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
    await h.start(TP0)
    await until(lambda: len(outputs(broker)) == 5)
    first = h.service.partitions.owned[TP0]
    await h.service._acquire(TP0)
    second = h.service.partitions.owned[TP0]
    assert second is not first
    assert first.closed
    assert first.producer.stopped
    for i in range(5, 10):
        broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
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
    for i in range(5):
        broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
    started = time.monotonic()
    await h.start(TP0)
    assert time.monotonic() - started < 0.4
    assert TP0 in h.consumer.paused()  # nothing handed out before the fence is up
    await until(lambda: len(outputs(broker)) == 5)
    assert sorted(outputs(broker)) == [b"v%d" % i for i in range(5)]
    # Revoked while a take-over is still under way: it is called off, its producer closed.
    broker.append(IN, 1, b"k", b"w")
    await h.consumer.assign([TP0, TP1])
    await h.consumer.assign([TP0])
    await asyncio.sleep(0.6)
    assert TP1 not in h.service.partitions.owned
    assert all(p.stopped for p in h.producers if p.txn_id and p.txn_id.endswith("-1"))
    await h.stop()


async def test_a_record_without_a_key_takes_the_lane_of_its_instance_uuid(
    broker: FakeBroker,
) -> None:
    # One VM's events stay in order whether or not (and in whichever case) the producer
    # keyed them: the lane of a keyless record is its event's instance UUID.
    h = Harness(broker)
    vm, other = str(uuid.uuid4()), str(uuid.uuid4())
    values = []
    for instance in (vm, vm, other):
        _, decision, request = e2e.outcome("hv-1", ["hv-1"], vm=instance)
        values.append(encode_input(decision, request)[0])
    gate = h.processor.gates[values[0]] = asyncio.Event()
    broker.append(IN, 0, vm.upper().encode(), values[0])  # keyed, upper case
    broker.append(IN, 0, None, values[1])  # the same VM, no key
    broker.append(IN, 0, None, values[2])  # another VM, no key
    await h.start(TP0)
    await until(lambda: outputs(broker) == [values[2]])
    assert (0, 1) not in h.processor.calls  # waits behind its VM's first event
    gate.set()
    await until(lambda: len(outputs(broker)) == 3)
    assert outputs(broker) == [values[2], values[0], values[1]]
    await h.stop()


async def test_a_stop_during_a_fetch_back_off_ends_the_loop_at_once(broker: FakeBroker) -> None:
    # Fetches failing (an ACL revoked, the broker away) sleep the back-off, up to
    # CRS_RETRY_BACKOFF_MAX_S; a SIGTERM must not wait that out of the shutdown budget.
    h = Harness(broker, retry_backoff_s=20.0, retry_backoff_max_s=20.0)
    broker.fail_fetches = [KafkaConnectionError("broker away (fake)")] * 3
    await h.start(TP0)
    await until(lambda: h.service.fetch_error is not None)
    started = time.monotonic()
    await h.stop()
    assert time.monotonic() - started < 1.0


async def test_close_leaves_the_group_even_when_its_last_commit_is_cut_short(
    broker: FakeBroker,
) -> None:
    # The shutdown budget cancels close() while the final commit hangs on a broker in
    # trouble; the consumer must still be stopped (LeaveGroup: partitions move at once).
    h = Harness(broker, commit_timeout_s=30.0)
    await h.start(TP0)
    await h.part()
    broker.commit_delay_s = 60.0
    broker.append(IN, 0, b"k", b"v")
    await until(lambda: "commit" in h.service.partitions.owned[TP0].producer.calls)
    consumer, producer = h.consumer, h.service.partitions.owned[TP0].producer
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(h.service.close(), 0.2)
    assert consumer.stopped
    assert producer.stopped
    await h.ended()


async def test_a_commit_cut_short_is_never_committed_again(broker: FakeBroker) -> None:
    # A cancel (the shutdown budget) landing while a commit waits for EndTxn: aiokafka
    # shields the EndTxn, so the transaction may commit all the same. Its outcome unknown,
    # the partition must not commit the same outputs again when it is released.
    h = Harness(broker)
    await h.start(TP0)
    part = await h.part()
    broker.commit_delay_s = 0.2
    broker.append(IN, 0, b"k", b"v")
    await until(lambda: "commit" in part.producer.calls)
    assert part.committer is not None
    part.committer.cancel()
    await asyncio.sleep(0.4)  # the shielded commit lands
    await h.service.close()
    assert outputs(broker) == [b"v"]
    await h.ended()


async def slow_commits(broker: FakeBroker, backoff_s: float) -> tuple[Harness, Any]:
    """A started partition whose commits take 0.2 s, past its 0.1 s commit timeout (they
    time out and land all the same), retried after ``backoff_s``; and its part."""
    h = Harness(
        broker, commit_timeout_s=0.1, retry_backoff_s=backoff_s, retry_backoff_max_s=backoff_s
    )
    await h.start(TP0)
    part = await h.part()
    broker.commit_delay_s = 0.2
    return h, part


async def test_a_commit_that_timed_out_but_landed_is_counted_once_on_take_over(
    broker: FakeBroker,
) -> None:
    # The commit outlives commit_timeout_s and lands anyway (aiokafka shields EndTxn):
    # taken over again, the partition starts after those records, so nobody processes
    # them again, and their counts must be applied then, once, or they are never counted.
    h, part = await slow_commits(broker, 0.5)
    broker.append(IN, 0, b"k", b"v")
    await until(lambda: broker.commits == 1)
    assert h.counted() == 0  # the engine does not know yet
    broker.commit_delay_s = 0.0
    await h.retaken(part)
    await until(lambda: h.counted() == 1)
    broker.append(IN, 0, b"k", b"w")
    await until(lambda: len(outputs(broker)) == 2)
    await h.stop()
    assert outputs(broker) == [b"v", b"w"]
    assert h.counted() == 2
    assert h.processor.calls == [(0, 0), (0, 1)]


async def test_a_landed_commit_is_counted_when_a_rebalance_gives_the_partition_back(
    broker: FakeBroker,
) -> None:
    # The commit times out and lands; before the re-acquisition's back-off ends, an eager
    # rebalance revokes the partition and gives it back. The take-over (epoch exactly +1:
    # nobody else initialised the id) must still know the commit was this member's, or
    # its event is published and counted by nobody.
    h, part = await slow_commits(broker, 1.0)
    broker.append(IN, 0, b"k", b"v")
    await until(lambda: broker.commits == 1)  # landed after the timeout
    broker.commit_delay_s = 0.0
    await h.consumer.assign([TP0])  # revoked, and given back
    await h.retaken(part)
    await until(lambda: h.counted() == 1)
    await h.stop()
    assert outputs(broker) == [b"v"]
    assert h.processor.calls == [(0, 0)]  # not redone


async def test_a_commit_cut_short_by_a_revoke_is_counted_when_the_partition_comes_back(
    broker: FakeBroker,
) -> None:
    # The revoke's last commit outlives the revoke's bound and lands. Given back with
    # nobody in between, the take-over finds exactly that commit: counted then, once.
    h = Harness(broker, commit_interval_ms=60_000, commit_burst=1, revoke_commit_s=0.1)
    broker.append(IN, 0, b"a", b"a0")
    await h.start(TP0)
    await until(lambda: outputs(broker) == [b"a0"])  # spends the only token
    broker.append(IN, 0, b"b", b"b0")
    await until(lambda: h.service.partitions.owned[TP0].ledger.done_uncommitted == 1)
    broker.commit_delay_s = 0.3
    broker.init_delay_s = 0.5  # the take-over's InitProducerId waits for the EndTxn
    await h.consumer.assign([TP0])  # revoke (its commit cut short, landing later) + assign
    await until(lambda: outputs(broker) == [b"a0", b"b0"])
    broker.commit_delay_s = broker.init_delay_s = 0.0
    await until(lambda: TP0 in h.service.partitions.owned)
    await until(lambda: h.counted() == 2)
    await h.stop()
    assert h.processor.calls == [(0, 0), (0, 1)]  # not redone


async def test_a_commit_of_unknown_outcome_is_remembered_without_its_records(
    broker: FakeBroker,
) -> None:
    # What a take-over needs to count a commit that landed after all is its position,
    # counts and sender; a partition that moved to another member keeps that entry for
    # the life of the process, so it must not hold the outputs (a dead letter carries its
    # input's value, up to a megabyte) of every partition that ever moved away so.
    h = Harness(broker, commit_interval_ms=60_000, commit_burst=1, revoke_commit_s=0.1)
    broker.append(IN, 0, b"a", b"a0")
    await h.start(TP0)
    await until(lambda: outputs(broker) == [b"a0"])  # spends the only token
    broker.append(IN, 0, b"b", b"b0" * 1000)
    await until(lambda: h.service.partitions.owned[TP0].ledger.done_uncommitted == 1)
    broker.commit_delay_s = 0.3
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
    await until(lambda: h.service.partitions.owned[TP0].ledger.done_uncommitted == 1)
    if failure == "fenced":
        other = FakeProducer(broker, transactional_id=transactional_id_for("g", TP0))
        await other.start()  # the member that took the partition over meanwhile
        await other.stop()
    else:
        broker.fail_commits = 1
    await h.consumer.assign([TP0])
    started = time.monotonic()
    await until(lambda: TP0 in h.service.partitions.owned, limit_s=5)
    waited = time.monotonic() - started
    await until(lambda: outputs(broker) == [b"a0", b"b0"])
    await h.stop()
    assert waited < 0.5, f"taken over again only after {waited:.2f}s"


async def test_a_commit_that_timed_out_and_failed_counts_only_its_redo(
    broker: FakeBroker,
) -> None:
    # The same commit timing out, but refused by the broker in the end: redone, counted once.
    h, _ = await slow_commits(broker, 0.5)
    broker.fail_commits = 1
    broker.append(IN, 0, b"k", b"v")
    await until(lambda: broker.fail_commits == 0)
    broker.commit_delay_s = 0.0
    await until(lambda: len(outputs(broker)) == 1)
    await h.stop()
    assert outputs(broker) == [b"v"]
    assert h.counted() == 1
    assert h.processor.calls == [(0, 0), (0, 0)]


async def test_a_commit_that_timed_out_is_not_counted_when_another_owner_committed_the_same(
    broker: FakeBroker,
) -> None:
    # The commit times out and does not land; meanwhile another member initialises the
    # partition's transactional id, redoes the record (counting it) and commits the very
    # offset and metadata this one would have. Taken over again, this replica must not
    # count the record a second time.
    h, part = await slow_commits(broker, 0.5)
    broker.fail_commits = 1
    broker.append(IN, 0, b"k", b"v")
    await until(lambda: broker.fail_commits == 0)
    broker.commit_delay_s = 0.0
    txn_id = part.producer.txn_id
    broker.epochs[txn_id] += 1  # the other owner's InitProducerId
    broker.committed[("g", TP0)] = OffsetAndMetadata(1, "")
    await h.retaken(part)
    await asyncio.sleep(0.1)
    await h.stop()
    assert h.counted() == 0
    assert h.processor.calls == [(0, 0)]


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
    started = time.monotonic()
    await h.consumer.assign([])  # both revoked while their commits hang
    assert time.monotonic() - started < 0.5
    assert all(p.closed for p in parts)
    await until(lambda: all(p.producer.stopped for p in parts))  # closed in the background
    await asyncio.sleep(1.0)  # the shielded commits land after all
    await h.consumer.assign([TP0, TP1])  # taken over again: nothing published twice
    await asyncio.sleep(0.3)
    assert sorted(outputs(broker)) == [b"v0", b"v1"]
    await h.stop()


async def test_a_revoke_does_not_wait_for_its_producers_to_close(broker: FakeBroker) -> None:
    # Closing a producer whose commit was cut short waits for the broker; inside the
    # rebalance (no heartbeat) that must not add to the revoke's bound. They close in
    # the background, and close() still waits for them.
    h = Harness(broker, revoke_wait_s=0.1, revoke_commit_s=0.2, commit_timeout_s=30.0)
    await h.start(TP0)
    part = await h.part()
    broker.commit_delay_s = 1.0
    broker.stop_delay_s = 2.0
    broker.append(IN, 0, b"k", b"v")
    await until(lambda: "commit" in part.producer.calls)
    started = time.monotonic()
    await h.consumer.assign([])
    assert time.monotonic() - started < 0.6
    assert not part.producer.stopped  # still closing
    await h.stop()
    assert part.producer.stopped  # close() waited for it


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


async def test_an_oversized_record_without_a_key_is_not_parsed_for_its_lane(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Keying an unkeyed record by its instance UUID decodes it in the fetch loop; one
    # above the event size limit is dead-lettered unread, so it must not be parsed here.
    parsed: list[int] = []
    real = lanes_module.decode_input

    def counting(value: Any, headers: Any, **kwargs: Any) -> Any:
        if len(value) <= kwargs["max_bytes"]:  # above it, decode_input refuses unread
            parsed.append(len(value))
        return real(value, headers, **kwargs)

    monkeypatch.setattr(lanes_module, "decode_input", counting)
    h = Harness(broker, max_event_bytes=3000)
    _, decision, request = e2e.outcome("hv-1", ["hv-1"])
    small = encode_input(decision, request)[0]
    broker.append(IN, 0, None, small)
    broker.append(IN, 0, None, b"[" + b"{}," * 2000 + b"{}]")
    await h.start(TP0)
    await until(lambda: len(outputs(broker)) == 2)
    await h.stop()
    assert parsed == [len(small)]


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


async def test_a_release_cancelled_mid_commit_leaves_no_commit_running(
    broker: FakeBroker,
) -> None:
    # The shutdown budget cancels run() while its release waits for a hanging commit:
    # the release's own commit tasks must end with it, not go on beside close().
    h = Harness(broker)
    await h.start(TP0)
    part = await h.part()
    broker.commit_delay_s = 1.0
    broker.append(IN, 0, b"k", b"v")
    await until(lambda: "commit" in part.producer.calls)
    h.service.request_stop()
    await asyncio.sleep(0.1)  # run() is releasing: its commit waits for the hanging one
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


async def test_key_concurrency_is_bounded(broker: FakeBroker) -> None:
    h = Harness(broker, key_concurrency=3)
    gate = h.gated_records(8)
    await h.start(TP0)
    await until(lambda: h.processor.running == 3)
    await asyncio.sleep(0.05)
    assert h.processor.max_running == 3
    gate.set()
    await until(lambda: len(outputs(broker)) == 8)
    await h.stop()


async def test_retry_later_waits_in_its_lane_only(broker: FakeBroker) -> None:
    h = Harness(broker)
    h.processor.retries[b"slow"] = 2
    broker.append(IN, 0, b"s", b"slow")
    broker.append(IN, 0, b"f", b"fast")
    await h.start(TP0)
    await until(lambda: len(outputs(broker)) == 2)
    # Counted once the commit's await returns, a loop turn after the fake broker shows
    # the outputs: waiting for the outputs alone raced with it (one failure under load).
    await until(lambda: h.counted() == 2)
    await h.stop()
    assert outputs(broker)[0] == b"fast"
    assert h.processor.calls.count((0, 0)) == 3
    assert h.counted() == 2


async def test_an_output_too_large_for_the_broker_becomes_a_stub_dead_letter(
    broker: FakeBroker,
) -> None:
    h = Harness(broker)
    broker.max_value_bytes = 1000
    broker.append(IN, 0, b"k", b"x" * 5000)
    broker.append(IN, 0, b"j", b"small")
    await h.start(TP0)
    await until(lambda: len(broker.outputs) == 2)
    await h.stop()
    stub = next(r for r in broker.outputs if r.topic == "dlq")
    headers = dict(stub.headers)
    assert headers["crs.stub"] == b"true"
    assert headers["crs.source.offset"] == b"0"
    assert headers["crs.value.size"] == b"5000"
    assert headers["crs.error"] == b"output_rejected"
    assert stub.value is None
    assert h.metrics.commit_failures.labels("record_too_large")._value.get() == 1
    # Counted where it went: a dead letter (the classification was made, and is counted).
    assert h.metrics.dead_letters.labels("output_rejected")._value.get() == 1


async def test_a_rejected_stub_stalls_the_partition_instead_of_looping(
    broker: FakeBroker,
) -> None:
    h = Harness(broker, retry_backoff_max_s=0.2)
    broker.max_value_bytes = 10  # not even a stub fits: a broken topic configuration
    broker.append(IN, 0, b"k", b"x" * 50)
    await h.start(TP0)
    await until(lambda: bool(h.service.stalled()))
    await asyncio.sleep(0.3)
    assert h.metrics.commit_failures.labels("record_too_large")._value.get() == 1
    assert h.metrics.stalled.labels(IN, "0")._value.get() == 1
    await h.stop()


async def test_revoke_commits_what_is_decided_and_closes_the_producer(broker: FakeBroker) -> None:
    h = Harness(broker)
    for i in range(4):
        broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
    await h.start(TP0)
    await until(lambda: h.service.processed == 4)
    producer = h.service.partitions.owned[TP0].producer
    await h.consumer.assign([TP1])
    assert producer.stopped
    assert TP0 not in h.service.partitions.owned
    assert broker.committed[("g", TP0)].offset == 4
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


async def test_thousands_of_waiting_lanes_drain_without_recursion(broker: FakeBroker) -> None:
    # key_concurrency 1 and a stuck first key: every other key queues as "ready", and
    # then finishes eagerly, one after another, once the slot frees.
    h = Harness(broker, key_concurrency=1, max_in_flight=5000, max_batch=5000)
    gate = h.processor.gates[b"first"] = asyncio.Event()
    broker.append(IN, 0, b"k", b"first")
    for i in range(3000):
        broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
    await h.start(TP0)
    await until(lambda: len(h.service.partitions.owned[TP0].ready) == 3000)
    gate.set()
    await until(lambda: len(outputs(broker)) == 3001, limit_s=10)
    await h.stop()


async def test_a_failing_fetch_keeps_the_loop_turning_and_says_why(broker: FakeBroker) -> None:
    from aiokafka.errors import GroupAuthorizationFailedError

    h = Harness(broker, retry_backoff_max_s=0.05)
    broker.fail_fetches = [KafkaConnectionError("gone"), GroupAuthorizationFailedError()]
    broker.append(IN, 0, b"k", b"v")
    await h.start(TP0)
    await until(lambda: h.service.fetch_error is not None)
    await until(lambda: outputs(broker) == [b"v"])
    assert h.service.fetch_error is None  # cleared by the first good fetch
    assert not h.task.done()  # type: ignore[union-attr]
    await h.stop()


@pytest.mark.parametrize(
    "task",
    ["_coordination_task", "_heartbeat_task", "_commit_refresh_task", "fetching", "metadata"],
)
async def test_an_ended_client_task_commits_the_work_in_hand_and_ends_run(
    broker: FakeBroker, task: str
) -> None:
    # aiokafka starts none of its consumer tasks again on its own. Once a group task has
    # ended every getmany() raises: the loop retried that for good, up and never fetching
    # again (tests/integration/test_foreign_group_member.py: coordination;
    # test_kafka_security.py, the group ACL revoked for a moment: heartbeat). Once the
    # fetch task has, getmany() returns nothing, for good, and nothing looked wrong.
    h = Harness(broker, stop_wait_s=5.0)
    gate = h.processor.gates[b"v1"] = asyncio.Event()
    for i in range(3):
        broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
    await h.start(TP0)
    await until(lambda: sorted(outputs(broker)) == [b"v0", b"v2"])
    if task == "fetching":
        h.consumer._fetcher.error_future.set_exception(
            KafkaError("Unexpected error during data retrieval")
        )
    elif task == "metadata":  # nothing raised: fetches return nothing, for good
        h.consumer._client._sync_task.set_exception(RuntimeError("Unexpected error during"))
        broker.data.set()
    else:
        h.consumer._coordinator.end_task(task, KafkaError("Unexpected error during coordination"))
    await until(lambda: h.service.fetch_error is not None)
    assert not h.task.done()  # type: ignore[union-attr]
    gate.set()  # the record in hand is finished and committed before run() ends
    with pytest.raises(KafkaClientEnded, match="Unexpected error during"):
        await asyncio.wait_for(h.task, 5)  # type: ignore[arg-type]
    assert sorted(outputs(broker)) == [b"v0", b"v1", b"v2"]
    assert broker.committed[("g", TP0)].offset == 3
    await h.service.close()
    # Its connections are closed too (aiokafka's stop() raises before it closes them
    # when the fetch task ended): one set left open per restart otherwise.
    assert h.consumer._client.closed


async def test_a_heartbeat_ended_during_a_rebalance_is_left_to_aiokafka(
    broker: FakeBroker,
) -> None:
    # aiokafka drops a heartbeat task that ended while it rejoins and starts a new one
    # after the join: no sign of trouble reaches getmany(), so the client goes on.
    h = Harness(broker)
    broker.append(IN, 0, b"k", b"v0")
    await h.start(TP0)
    await until(lambda: outputs(broker) == [b"v0"])
    ended = asyncio.get_running_loop().create_future()
    ended.set_exception(KafkaError("Heartbeat failed"))
    h.consumer._coordinator._heartbeat_task = ended
    await asyncio.sleep(0.1)  # fetches that returned nothing
    h.consumer._coordinator._heartbeat_task = None  # the rejoin dropped it
    broker.append(IN, 0, b"k", b"v1")
    await until(lambda: outputs(broker) == [b"v0", b"v1"])
    assert not h.task.done()  # type: ignore[union-attr]
    assert h.service.fetch_error is None
    await h.stop()


# A partition's own tasks ending by an error nobody foresaw (a bug, a MemoryError, a
# cancellation leaking out of a callee) left the partition stuck while every probe stayed
# green (found by an audit of the service's tasks): each is now taken over again.


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
    for i in range(1, 21):
        broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
    await until(lambda: broker.committed[("g", TP0)].offset == 21)
    assert crashed
    assert sorted(outputs(broker)) == sorted(b"v%d" % i for i in range(21))  # each once
    assert not h.task.done()  # type: ignore[union-attr]
    await h.stop()


async def test_a_lane_worker_that_crashes_does_not_orphan_its_key(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = ownership_module.Ledger.complete
    crashed: list[bool] = []

    def complete_once(ledger: Any, offset: int, done: Any) -> None:
        if offset == 0 and not crashed:
            crashed.append(True)
            raise RuntimeError("a bug")
        real(ledger, offset, done)

    monkeypatch.setattr(ownership_module.Ledger, "complete", complete_once)
    h = Harness(broker)
    for v in (b"x0", b"y0", b"x1"):
        broker.append(IN, 0, v[:1], v)
    await h.start(TP0)
    await until(lambda: ("g", TP0) in broker.committed)
    await until(lambda: broker.committed[("g", TP0)].offset == 3)
    assert crashed
    assert sorted(outputs(broker)) == [b"x0", b"x1", b"y0"]  # each once
    await h.stop()


async def test_a_cancelled_error_leaking_out_of_processing_is_the_records_stub(
    broker: FakeBroker,
) -> None:
    # Not a cancel of the worker: a bug in a callee. As any processing error, the record
    # becomes an internal_error stub; ending the worker instead re-took the partition and
    # met the same record again, for good, and held the other keys' commits.
    h = Harness(broker)
    process = h.processor.process

    async def leaking(ref: InputRef, key: Any, value: Any, headers: Any, **kw: Any) -> Any:
        if value == b"x0":
            raise asyncio.CancelledError
        return await process(ref, key, value, headers, **kw)

    h.processor.process = leaking  # type: ignore[method-assign]
    for v in (b"x0", b"y0", b"y1"):
        broker.append(IN, 0, v[:1], v)
    await h.start(TP0)
    await until(lambda: ("g", TP0) in broker.committed)
    await until(lambda: broker.committed[("g", TP0)].offset == 3)
    (stub,) = [r for r in broker.outputs if r.topic == "dlq"]
    assert dict(stub.headers)["crs.error"] == b"internal_error"
    assert [r.value for r in broker.outputs if r.topic == "out"] == [b"y0", b"y1"]
    await h.stop()


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
    for i in range(1, 6):
        broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
    await until(lambda: ("g", TP0) in broker.committed)
    await until(lambda: broker.committed[("g", TP0)].offset == 6)
    assert leaked
    assert sorted(outputs(broker)) == sorted(b"v%d" % i for i in range(6))  # each once
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


async def test_a_record_the_client_cannot_read_is_one_stub_dead_letter(
    broker: FakeBroker,
) -> None:
    # service/stream/unreadable.py hands such a record out instead of raising; the engine
    # publishes a stub for it (code unreadable) in the partition's order and goes on.
    h = Harness(broker)
    broker.append(IN, 0, b"k", b"v0")
    broker.append_unreadable(IN, 0, "UnicodeDecodeError: invalid start byte")
    broker.append(IN, 0, b"k", b"v2")
    await h.start(TP0)
    await until(lambda: outputs(broker) == [b"v0", b"v2"])
    await until(lambda: broker.committed[("g", TP0)].offset == 3)
    (stub,) = [r for r in broker.outputs if r.topic == "dlq"]
    headers = dict(stub.headers)
    assert headers["crs.error"] == b"unreadable"
    assert headers["crs.stub"] == b"true"
    assert headers["crs.source.offset"] == b"1"
    assert headers["crs.reason"] == b"UnicodeDecodeError: invalid start byte"
    assert (0, 1) not in h.processor.calls
    await until(lambda: h.metrics.dead_letters.labels("unreadable")._value.get() == 1)
    assert not h.task.done()  # type: ignore[union-attr]
    await h.stop()


@pytest.mark.parametrize("received_before", [1, 0], ids=["later-fetch", "first-fetch"])
async def test_records_a_failing_fetch_drained_and_dropped_are_fetched_again(
    broker: FakeBroker, received_before: int
) -> None:
    # aiokafka's getmany() moves each partition's position as it drains it and raises
    # when a later one fails to parse: the records drained first are gone from the
    # client. Before the rewind they were committed past without an output. And an error
    # that is not a KafkaError ended run(), and with it the process. first-fetch: a
    # partition without a committed offset that has received nothing yet, where the
    # rewind first had no offset to go back to (review).
    h = Harness(broker, retry_backoff_max_s=0.05)
    values = [b"v%d" % i for i in range(4)]
    for v in values[:received_before]:
        broker.append(IN, 0, b"k", v)
    await h.start(TP0)
    await until(lambda: outputs(broker) == values[:received_before])
    broker.fail_after_draining = [ValueError("a batch header that does not parse (fake)")]
    for v in values[received_before:]:
        broker.append(IN, 0, b"k", v)
    await until(lambda: outputs(broker) == values)
    assert not broker.fail_after_draining  # the failure did happen
    await until(lambda: broker.committed[("g", TP0)].offset == 4)
    assert not h.task.done()  # type: ignore[union-attr]
    await h.stop()


async def test_a_member_without_partitions_still_takes_the_group_errors(
    broker: FakeBroker,
) -> None:
    # aiokafka's group coordinator waits until the user has taken a group error (from
    # getmany) before it joins again: a fetch loop that stopped asking while it had no
    # partition left the member without any for good (seen after a broker restart).

    h = Harness(broker, retry_backoff_max_s=0.05)
    broker.fail_fetches = [KafkaError("SyncGroup: GroupLoadInProgressError")]
    await h.start()  # no partition assigned
    await until(lambda: not broker.fail_fetches)
    await until(lambda: h.service.fetch_error is None)  # asked again, and it worked
    await h.stop()


def lag(h: Harness) -> float:
    """crs_consumer_lag of partition 0 of the input."""
    return h.metrics.lag.labels(IN, "0")._value.get()  # type: ignore[no-any-return]


async def test_lag_is_reported_from_assignment_on(broker: FakeBroker) -> None:
    h = Harness(broker)
    gate = h.processor.gates[b"v0"] = asyncio.Event()
    for i in range(3):
        broker.append(IN, 0, b"k", b"v%d" % i)
    await h.start(TP0)
    assert lag(h) == 3
    gate.set()
    await until(lambda: lag(h) == 0)
    await h.stop()


async def test_a_transaction_held_open_on_the_input_is_shown_while_the_lag_reads_0(
    broker: FakeBroker,
) -> None:
    # A producer killed mid-transaction (a dlq redrive): the records behind its first one
    # are invisible to a read_committed consumer, and the lag, measured to the last stable
    # offset, reads 0. How long that offset has not moved is what shows it.
    h = Harness(broker)
    broker.append(IN, 0, b"k", b"v0")
    await h.start(TP0)
    await until(lambda: outputs(broker) == [b"v0"])
    h.consumer.open_transaction_at[TP0] = 1
    broker.append(IN, 0, b"k", b"v1")  # the open transaction's record
    broker.append(IN, 0, b"k", b"v2")  # a producer's record behind it

    def stuck() -> float | None:
        return h.metrics.registry.get_sample_value(
            "crs_input_stable_offset_stuck_seconds", {"topic": IN, "partition": "0"}
        )

    await until(lambda: (stuck() or 0.0) > 0.2)
    assert outputs(broker) == [b"v0"]
    assert (
        h.metrics.registry.get_sample_value("crs_consumer_lag", {"topic": IN, "partition": "0"})
        == 0
    )
    del h.consumer.open_transaction_at[TP0]  # aborted (here: as if committed)
    broker.append(IN, 0, b"k", b"v3")
    await until(lambda: stuck() == 0.0 and len(outputs(broker)) == 4)
    await h.stop()


async def test_a_partition_not_fetched_is_not_shown_as_held_by_a_transaction(
    broker: FakeBroker,
) -> None:
    # aiokafka learns the high watermark and the last stable offset from fetch answers
    # only: a partition left out by backpressure (records stuck on the Kubernetes API)
    # keeps those of its last fetch, which saw a transaction that has since ended. Its
    # gauge climbed for as long as the outage lasted (CrsInputTransactionOpen firing).
    h = Harness(broker, max_in_flight=2, poll_keepalive_s=600.0)
    gate = h.gated_records(2)
    await h.service.start()
    h.consumer.open_transaction_at[TP0] = 2
    broker.append(IN, 0, b"t", b"t2")  # the open transaction's record
    await h.consumer.assign([TP0])
    h.task = asyncio.create_task(h.service.run())
    await until(
        lambda: TP0 in h.service.partitions.owned and h.service.partitions.owned[TP0].backpressured
    )
    del h.consumer.open_transaction_at[TP0]  # it commits; the partition is not fetched
    h.consumer.poll_age_s = 60.0  # the last fetch answer: a minute ago
    await asyncio.sleep(0.2)
    assert h.metrics.registry.get_sample_value(
        "crs_input_stable_offset_stuck_seconds", {"topic": IN, "partition": "0"}
    ) in (None, 0.0)
    h.consumer.poll_age_s = 0.0
    gate.set()
    await until(lambda: len(outputs(broker)) == 3)
    await h.stop()


async def test_the_offset_reset_series_exists_from_take_over(broker: FakeBroker) -> None:
    # increase() over a counter whose series appears at 1 is 0: CrsOffsetReset would miss
    # a partition's first reset, usually its only one.
    h = Harness(broker)
    await h.start(TP0)
    await h.part()
    assert (
        h.metrics.registry.get_sample_value(
            "crs_offset_resets_total", {"topic": IN, "partition": "0"}
        )
        == 0.0
    )
    await h.stop()


async def test_lag_keeps_growing_while_the_partition_is_left_out_by_backpressure(
    broker: FakeBroker,
) -> None:
    # aiokafka learns the last stable offset from fetch responses only, and a partition
    # left out of getmany() (full: records stuck on the Kubernetes API) is not fetched.
    # Its lag must still follow the backlog (read with ListOffsets now and then), or the
    # lag alert cannot fire during the very outage that builds the backlog.
    h = Harness(broker, max_in_flight=4, max_batch=2, lag_refresh_s=0.05)
    gate = asyncio.Event()
    for i in range(60):
        h.processor.gates[b"v%d" % i] = gate
    for i in range(10):
        broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
    await h.start(TP0)
    await until(lambda: h.service.partitions.owned[TP0].backpressured)
    for i in range(10, 60):
        broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
    await until(lambda: lag(h) == 60)
    gate.set()
    await until(lambda: lag(h) == 0)
    await h.stop()


async def test_lag_is_zero_once_a_transactional_input_is_processed(broker: FakeBroker) -> None:
    # Each transaction of a transactional producer ends with a marker that takes an
    # offset and is never handed out: the committed offset stops on it, one short of
    # the end. With everything processed the lag is 0 (the fetch position), not 1.
    h = Harness(broker)
    for i in range(3):
        broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
    broker.append_marker(IN, 0)
    await h.start(TP0)
    await until(lambda: len(outputs(broker)) == 3)
    await until(lambda: lag(h) == 0)
    await h.stop()


async def test_lag_never_waits_for_a_position_being_reset(broker: FakeBroker) -> None:
    # aiokafka's position() waits for an offset reset (request_timeout_ms, again and
    # again): the lag must not ask it, or the consume loop would stand still meanwhile.
    h = Harness(broker)
    for i in range(3):
        broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
    broker.append_marker(IN, 0)
    broker.append(IN, 1, b"k", b"w")
    await h.start(TP0, TP1)
    await until(lambda: len(outputs(broker)) == 4)
    h.consumer.awaiting_reset.add(TP0)
    await until(lambda: lag(h) == 1)  # the committed's
    turned = h.service.last_loop
    await until(lambda: h.service.last_loop > turned + 0.5)  # the loop keeps turning
    h.consumer.awaiting_reset.clear()
    await until(lambda: lag(h) == 0)
    await h.stop()


def ahead_count(h: Harness, outcome: str) -> float:
    return h.metrics.opened_ahead.labels(outcome)._value.get()  # type: ignore[no-any-return]


async def one_waiting_record(
    broker: FakeBroker, key: bytes = b"k0", value: bytes = b"v0", **settings: Any
) -> tuple[Harness, asyncio.Event, FakeProducer]:
    """A partition with one record undecided until ``gate`` is set (a PATCH in flight),
    once its transaction has been opened ahead."""
    h = Harness(broker, **settings)
    gate = h.processor.gates[value] = asyncio.Event()
    broker.append(IN, 0, key, value)
    await h.start(TP0)
    producer: FakeProducer = (await h.part()).producer
    await until(lambda: producer.calls == ["begin", "offsets"])
    return h, gate, producer


async def test_a_partition_waiting_on_the_api_opens_its_transaction_ahead(
    broker: FakeBroker,
) -> None:
    # The record is undecided (a PATCH in flight): the transaction is begun and its
    # offset sent meanwhile; after the decision only the output and the end remain.
    h, gate, producer = await one_waiting_record(broker)
    assert outputs(broker) == []
    assert ("g", TP0) not in broker.committed
    gate.set()
    await until(lambda: outputs(broker) == [b"v0"])
    assert producer.calls == ["begin", "offsets", "send", "commit"]  # the offset not again
    assert broker.committed[("g", TP0)].offset == 1
    # Counted once commit_transaction() has returned, a loop turn or two after the
    # fake broker shows the output.
    await until(lambda: ahead_count(h, "committed") == 1)
    await h.stop()


def out_tp(key: bytes, partitions: int = 4) -> TopicPartition:
    return TopicPartition("out", partition_for_key(key, range(partitions), range(partitions)))


async def test_a_transaction_opened_ahead_adds_the_waiting_records_output_partitions(
    broker: FakeBroker,
) -> None:
    # aiokafka would add the output partition when the output is sent: one round trip
    # after the decision. Added ahead, only the output and the end remain after it.
    broker.topic_partitions["out"] = 4
    h = Harness(broker)
    gates = {v: h.processor.gates.setdefault(v, asyncio.Event()) for v in (b"a0", b"b0")}
    broker.append(IN, 0, b"key-a", b"a0")
    broker.append(IN, 0, b"key-b", b"b0")
    await h.start(TP0)
    producer: FakeProducer = (await h.part()).producer
    await until(lambda: producer.calls == ["begin", "add", "add", "offsets"])
    assert sorted(producer.added) == sorted({out_tp(b"key-a"), out_tp(b"key-b")})
    for gate in gates.values():
        gate.set()
    await until(lambda: sorted(outputs(broker)) == [b"a0", b"b0"])
    assert producer.calls[4:] == ["send", "send", "commit"]
    assert broker.committed[("g", TP0)].offset == 2
    await h.stop()


async def test_right_after_a_commit_no_partition_is_added_ahead(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The broker answers a transaction's first request CONCURRENT_TRANSACTIONS while it
    # writes the previous one's markers; aiokafka retries the group sooner than a
    # partition, so a transaction opened right after a commit sends its offset first,
    # and its outputs add their partitions as usual. "Right after" is widened to 10 s
    # here: the real 20 ms was missed when the loop stalled on a busy machine.
    monkeypatch.setattr(transaction_module, "MARKERS_WINDOW_S", 10.0)
    broker.topic_partitions["out"] = 4
    h = Harness(broker, commit_burst=5, fetch_linger_ms=0)
    broker.append(IN, 0, b"k0", b"v0")
    await h.start(TP0)
    await until(lambda: outputs(broker) == [b"v0"])
    producer: FakeProducer = (await h.part()).producer
    h.processor.gates[b"v1"] = gate = asyncio.Event()
    broker.append(IN, 0, b"k1", b"v1")
    await until(lambda: producer.calls[-2:] == ["begin", "offsets"])
    gate.set()
    await until(lambda: outputs(broker) == [b"v0", b"v1"])
    assert producer.calls[-4:] == ["begin", "offsets", "send", "commit"]
    assert producer.added == []
    await h.stop()


async def test_no_output_partition_is_added_ahead_before_the_topic_is_known(
    broker: FakeBroker,
) -> None:
    h, gate, producer = await one_waiting_record(broker)  # no metadata for "out" yet
    assert producer.added == []
    gate.set()
    await until(lambda: outputs(broker) == [b"v0"])
    await h.stop()


async def test_an_offset_that_moved_while_open_ahead_is_sent_again(broker: FakeBroker) -> None:
    h, gate, producer = await one_waiting_record(broker, b"x", b"x0")  # offset 1 sent ahead
    broker.append(IN, 0, b"y", b"y0")  # decided at once, behind the stuck x0
    await until(lambda: outputs(broker) == [b"y0"])
    assert producer.calls == ["begin", "offsets", "send", "offsets", "commit"]
    committed = broker.committed[("g", TP0)]
    assert committed.offset == 0
    assert committed.metadata.startswith("crs1:")
    gate.set()
    await until(lambda: len(outputs(broker)) == 2)
    await h.stop()
    assert broker.committed[("g", TP0)].offset == 2


async def test_a_transaction_open_ahead_too_long_is_aborted(broker: FakeBroker) -> None:
    h = Harness(broker, txn_open_ahead_max_s=0.05)
    gate = h.processor.gates[b"v0"] = asyncio.Event()
    broker.append(IN, 0, b"k0", b"v0")
    await h.start(TP0)
    await until(lambda: ahead_count(h, "aborted") >= 1)
    producer = h.service.partitions.owned[TP0].producer
    # Counted just before the abort is sent (in a task of its own): wait for the call.
    await until(lambda: "abort" in producer.calls)
    assert producer.calls[:3] == ["begin", "offsets", "abort"]
    assert ("g", TP0) not in broker.committed  # the offset sent ahead was not committed
    gate.set()
    await until(lambda: outputs(broker) == [b"v0"])
    await h.stop()
    assert broker.committed[("g", TP0)].offset == 1
    assert h.counted() == 1


async def test_stopping_aborts_a_transaction_open_ahead(broker: FakeBroker) -> None:
    h, _, producer = await one_waiting_record(broker, stop_wait_s=0.05)  # never decided
    await h.stop()
    # Ended without committing the offset sent ahead: aborted, or (here, a partition
    # never committed before) committed at the undecided record itself.
    assert producer.calls[-1] in ("abort", "commit")
    assert not producer.in_transaction
    assert producer.stopped
    assert broker.committed.get(("g", TP0), OffsetAndMetadata(0, "")).offset == 0
    assert outputs(broker) == []


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


async def test_opening_ahead_can_be_turned_off(broker: FakeBroker) -> None:
    h = Harness(broker, txn_open_ahead_ms=0)
    gate = h.processor.gates[b"v0"] = asyncio.Event()
    broker.append(IN, 0, b"k0", b"v0")
    await h.start(TP0)
    await until(lambda: h.processor.calls == [(0, 0)])
    await asyncio.sleep(0.05)
    assert h.service.partitions.owned[TP0].producer.calls == []
    gate.set()
    await until(lambda: outputs(broker) == [b"v0"])
    assert h.service.partitions.owned[TP0].producer.calls == ["begin", "send", "offsets", "commit"]
    await h.stop()


async def test_a_closed_engine_leaves_no_partition_series_behind(broker: FakeBroker) -> None:
    # The metrics outlive the engine when the Kafka clients restart in-process: the old
    # engine's partitions must not stay on /metrics (a lag, a stall) as if still held.
    h = Harness(broker)
    gate = h.processor.gates[b"v0"] = asyncio.Event()
    broker.append(IN, 0, b"k", b"v0")
    await h.start(TP0)
    await until(lambda: lag(h) == 1)
    h.service._table.stalled[TP0] = "commit failing"
    h.metrics.stalled.labels(IN, "0").set(1)
    gate.set()
    await h.stop()
    names = {s.name for f in h.metrics.registry.collect() for s in f.samples}
    per_partition = {"crs_consumer_lag", "crs_partition_stalled", "crs_partition_in_flight"}
    assert not names & per_partition, names & per_partition
    assert h.metrics.assigned._value.get() == 0


async def test_records_below_the_end_offset_at_the_take_over_are_processed_as_replays(
    broker: FakeBroker,
) -> None:
    # Those may have been processed by the partition's previous owner, whose write a
    # watch cache may not show yet: the Recorder reads the host fresh for them. Records
    # that arrive later were never anyone else's.
    for i in range(3):
        broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
    broker.committed[("g", TP0)] = OffsetAndMetadata(1, "")
    h = Harness(broker)
    await h.start(TP0)
    await until(lambda: len(outputs(broker)) == 2)
    broker.append(IN, 0, b"k3", b"v3")
    await until(lambda: len(outputs(broker)) == 3)
    assert h.processor.calls == [(0, 1), (0, 2), (0, 3)]
    assert h.processor.replays == {(0, 1), (0, 2)}
    await h.stop()
