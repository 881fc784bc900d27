"""The engine tests' in-memory harness: a fake processor, the service on a FakeBroker,
and small helpers shared by the modules of tests/unit/engine."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka.errors import ConsumerStoppedError
from aiokafka.structs import TopicPartition

from service.crs.ports import API_REQUEST_HOOK
from service.stream.codec import InputRef
from service.stream.engine import (
    StreamService,
    StreamSettings,
)
from service.stream.metrics import StreamMetrics
from service.stream.partitioner import partition_for_key
from service.stream.processor import EXPECTED_OUTPUT, OutRecord, Processor, RetryLater
from tests.fake_kafka import FakeBroker, FakeConsumer, FakeProducer
from tests.unit.engine.virtual_time import VirtualTimeLoop

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
    # Values whose decision sends a request to the API server before its gate (a PATCH).
    requests_api: set[bytes] = field(default_factory=set)
    # Values whose decision tells the engine its output ahead, before its gate (a PATCH
    # in flight), mapped to the value it is then decided with (itself: as told).
    told_ahead: dict[bytes, bytes] = field(default_factory=dict)
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
            told = None
            if value in self.told_ahead and (expect := EXPECTED_OUTPUT.get()) is not None:
                told = OutRecord(topic="out", key=key, value=value, headers=[])
                expect(ref.offset, told)  # what the processor does before a PATCH
            if value in self.requests_api and (hook := API_REQUEST_HOOK.get()) is not None:
                hook()  # what the Kubernetes client does before each request
            gate = self.gates.get(value)
            if gate is not None:
                await gate.wait()
            if attempt <= self.retries.get(value, 0):
                raise RetryLater(RuntimeError("api down"), attempt)
            self.metrics.events.labels("placement", "slot_used").inc()
            decided = self.told_ahead.get(value, value)
            if told is not None and decided == value:
                return told  # the very record told ahead: the processor's contract
            return OutRecord(topic="out", key=key, value=decided, headers=[])
        finally:
            self.running -= 1

    def stub(self, ref: InputRef, key: Any, value: Any, code: str, reason: str, **kw: Any) -> Any:
        # The real processor's stub: what the engine publishes is the service's own.
        real = Processor.__new__(Processor)
        real._dlq_topic = self.dlq_topic
        real._metrics = self.metrics
        return Processor.stub(real, ref, key, value, code, reason, **kw)


@dataclass
class FakeClock:
    """The engine's clock (commit pacing, lag), moved only by the test: frozen, a commit
    interval never passes however busy the machine is."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    def __init__(
        self,
        broker: FakeBroker,
        *,
        clock: Callable[[], float] | None = None,
        **settings: Any,
    ) -> None:
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
            clock=clock or now,
            consumer_factory=lambda **kw: FakeConsumer(broker, **kw),
            producer_factory=self._producer,
        )
        self.task: asyncio.Task[None] | None = None

    @classmethod
    async def published(cls, broker: FakeBroker, **settings: Any) -> Harness:
        """Started on partition 0, which has published its first record (key k, value v0)."""
        h = cls(broker, **settings)
        broker.append(IN, 0, b"k", b"v0")
        await h.start(TP0)
        await until(lambda: outputs(broker) == [b"v0"])
        return h

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

    def uncommitted(self, tp: TopicPartition = TP0) -> int:
        """Records of ``tp`` decided and not yet committed (counting waits for the commit)."""
        part = self.service.partitions.owned.get(tp)
        return 0 if part is None else int(part.ledger.done_uncommitted)

    def counted(self) -> float:
        return self.metrics.events.labels("placement", "slot_used")._value.get()  # type: ignore[no-any-return]


def now() -> float:
    """The time of the engine tests' loop, which must be virtual (see conftest.py)."""
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualTimeLoop), f"an engine test on real time: {loop!r}"
    return loop.time()


async def until(pred: Callable[[], bool], limit_s: float = 3.0) -> None:
    """Wait until ``pred()`` holds; fail once ``limit_s`` have passed on the loop's
    (virtual) clock."""
    deadline = now() + limit_s
    while not pred():
        assert now() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def engine_task(name: str) -> asyncio.Task[Any]:
    """The engine's running task called ``name`` (EngineCore._spawn names them): a test
    waits for it to end to know the work it does has had its chance, instead of sleeping."""
    found = [t for t in asyncio.all_tasks() if t.get_name() == name and not t.done()]
    assert len(found) == 1, f"{name}: {len(found)} running"
    return found[0]


async def loop_turns(h: Harness, n: int = 2) -> None:
    """The fetch loop began ``n`` more turns: the one before the last ran whole (its
    fetch or wait, the feeding and the lag update) after the caller's change."""
    for _ in range(n):
        seen = h.service.last_loop
        await until(lambda: h.service.last_loop > seen)  # noqa: B023 (awaited at once)


def outputs(broker: FakeBroker) -> list[bytes]:
    return [r.value for r in broker.outputs if r.value is not None]


def transactions(calls: list[str]) -> list[list[str]]:
    """A producer's calls, one list per transaction (each starts with "begin")."""
    out: list[list[str]] = []
    for call in calls:
        if call == "begin":
            out.append([])
        if out:
            out[-1].append(call)
    return out


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


def straggler(h: Harness, key: bytes = b"s", value: bytes = b"slow") -> asyncio.Event:
    """Append one record to partition 0 that stays undecided until the returned gate is
    set (a PATCH in flight): the partition is under load, so its commits are paced (a
    partition with nothing else in progress commits at once, token or not)."""
    gate = h.processor.gates[value] = asyncio.Event()
    h.broker.append(IN, 0, key, value)
    return gate


async def one_hanging_commit(
    broker: FakeBroker, delay_s: float, **settings: Any
) -> tuple[Harness, Any]:
    """A started partition whose commits take ``delay_s`` (EndTxn on a broker in trouble),
    once one of them (of record k, v) is under way; and its part."""
    h = Harness(broker, **settings)
    await h.start(TP0)
    part = await h.part()
    broker.commit_delay_s = delay_s
    broker.append(IN, 0, b"k", b"v")
    await until(lambda: "commit" in part.producer.calls)
    return h, part


def assert_held_at(broker: FakeBroker, offset: int) -> None:
    """The committed offset of partition 0 stays at ``offset``, a stuck record; its
    metadata says what is done behind it."""
    committed = broker.committed[("g", TP0)]
    assert committed.offset == offset
    assert committed.metadata.startswith("crs1:")


def lag(h: Harness) -> float:
    """crs_consumer_lag of partition 0 of the input."""
    return h.metrics.lag.labels(IN, "0")._value.get()  # type: ignore[no-any-return]


def ahead_count(h: Harness, outcome: str) -> float:
    return h.metrics.opened_ahead.labels(outcome)._value.get()  # type: ignore[no-any-return]


async def gated_record(
    broker: FakeBroker,
    key: bytes = b"k0",
    value: bytes = b"v0",
    *,
    requests_api: bool = False,
    told_as: bytes | None = None,
    **settings: Any,
) -> tuple[Harness, asyncio.Event, FakeProducer]:
    """A partition, taken over, with one record undecided until ``gate`` is set (a PATCH
    in flight). Its decision first tells its output ahead if ``told_as`` (the value it is
    then decided with), then sends a request to the API server if ``requests_api``."""
    h = Harness(broker, **settings)
    gate = h.processor.gates[value] = asyncio.Event()
    if requests_api:
        h.processor.requests_api.add(value)
    if told_as is not None:
        h.processor.told_ahead[value] = told_as
    broker.append(IN, 0, key, value)
    await h.start(TP0)
    producer: FakeProducer = (await h.part()).producer
    return h, gate, producer


async def one_waiting_record(
    broker: FakeBroker, key: bytes = b"k0", value: bytes = b"v0", **settings: Any
) -> tuple[Harness, asyncio.Event, FakeProducer]:
    """A :func:`gated_record` once its transaction has been opened ahead."""
    h, gate, producer = await gated_record(broker, key, value, **settings)
    await until(lambda: producer.calls == ["begin", "offsets"])
    return h, gate, producer


def out_tp(key: bytes, partitions: int = 4) -> TopicPartition:
    return TopicPartition("out", partition_for_key(key, range(partitions), range(partitions)))
