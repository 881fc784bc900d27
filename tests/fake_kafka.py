"""An in-memory Kafka for the stream engine's unit tests (not for integration tests).

Just enough of the broker's semantics to test the engine's bookkeeping in milliseconds:
partition logs, committed offsets with metadata per group, and transactional ids with
epochs, so a producer initialised under an id fences the previous instance (its commit
raises ``ProducerFenced``) exactly as InitProducerId does. Every behaviour tested with it
is covered once more on the real broker (tests/integration).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from aiokafka.errors import (
    ConsumerStoppedError,
    KafkaConnectionError,
    MessageSizeTooLargeError,
    ProducerFenced,
)
from aiokafka.protocol.commit import (
    OffsetFetchRequest,
    OffsetFetchRequest_v3,
    OffsetFetchResponse_v3,
)
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from service.stream.partitioner import partition_for_key
from service.stream.unreadable import UnreadableRecord


@dataclass
class Rec:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    control: bool = False  # a transaction marker: takes an offset, never handed out
    unreadable: str | None = None  # what aiokafka could not parse: handed out as such


class FakeBroker:
    def __init__(self) -> None:
        self.logs: dict[TopicPartition, list[Rec]] = {}
        self.committed: dict[tuple[str, TopicPartition], OffsetAndMetadata] = {}
        self.epochs: dict[str, int] = {}
        self.outputs: list[Rec] = []  # committed output records, in commit order
        self.max_value_bytes = 1 << 20  # of a whole record: key, value, headers
        self.fail_commits = 0  # the next N commits fail with a connection error
        self.fail_fetches: list[BaseException] = []  # raised by the next fetches, in order
        # Raised by the next fetches *after* draining what they would return, as aiokafka
        # does when a later partition's batch fails to parse: the drained records are lost.
        self.fail_after_draining: list[BaseException] = []
        self.init_delay_s = 0.0  # how long InitProducerId takes (a coordinator loading)
        self.fail_inits = 0  # the next N InitProducerIds fail with a connection error
        self.commit_delay_s = 0.0  # how long EndTxn takes (a broker in trouble)
        self.stop_delay_s = 0.0  # how long closing a producer takes (a broker in trouble)
        self.offsets_delay_s = 0.0  # how long TxnOffsetCommit takes (a broker in trouble)
        # Group-level error codes the next OffsetFetches answer, in order, as Kafka does
        # for v2-v7: at the top of the response, with no partition (a coordinator loading).
        self.offset_fetch_errors: list[int] = []
        self.offset_fetches = 0
        self.commits = 0
        self.data = asyncio.Event()
        # Topics whose metadata the producers know, with their partition counts (what
        # the engine reads to add output partitions to a transaction ahead).
        self.topic_partitions: dict[str, int] = {}

    def append_numbered(self, topic: str, partition: int, numbers: range) -> None:
        """Records numbered as ``numbers``: key k<i>, value v<i>."""
        for i in numbers:
            self.append(topic, partition, b"k%d" % i, b"v%d" % i)

    def append(self, topic: str, partition: int, key: bytes | None, value: bytes) -> None:
        tp = TopicPartition(topic, partition)
        log = self.logs.setdefault(tp, [])
        log.append(Rec(topic, partition, len(log), key, value))
        self.data.set()

    def append_unreadable(self, topic: str, partition: int, reason: str) -> None:
        """A record aiokafka cannot parse (service/stream/unreadable.py hands it out)."""
        tp = TopicPartition(topic, partition)
        log = self.logs.setdefault(tp, [])
        log.append(Rec(topic, partition, len(log), None, None, unreadable=reason))
        self.data.set()

    def append_marker(self, topic: str, partition: int) -> None:
        """The commit marker a transactional producer's transaction ends with."""
        tp = TopicPartition(topic, partition)
        log = self.logs.setdefault(tp, [])
        log.append(Rec(topic, partition, len(log), None, None, control=True))


class _FakeTxnManager:
    """aiokafka's TransactionManager as far as the engine reads it: id and epoch."""

    def __init__(self, producer: FakeProducer) -> None:
        self._producer = producer

    @property
    def producer_id(self) -> int:
        return 7 if self._producer.epoch >= 0 else -1

    @property
    def producer_epoch(self) -> int:
        return self._producer.epoch

    def maybe_add_partition_to_txn(self, tp: TopicPartition) -> None:
        assert self._producer.in_transaction, "a partition added outside a transaction"
        self._producer.calls.append("add")
        self._producer.added.append(tp)


class _FakeMetadata:
    def __init__(self, broker: FakeBroker) -> None:
        self._broker = broker

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        n = self._broker.topic_partitions.get(topic)
        return None if n is None else set(range(n))


class FakeProducer:
    def __init__(self, broker: FakeBroker, **kwargs: Any) -> None:
        self.broker = broker
        self.txn_id: str | None = kwargs.get("transactional_id")
        self.kwargs = kwargs
        self.epoch = -1
        self._txn_manager = _FakeTxnManager(self) if self.txn_id is not None else None
        self.stopped = False
        self._pending: list[Rec] = []
        self._offsets: dict[tuple[str, TopicPartition], OffsetAndMetadata] = {}
        # "begin" / "send" / "offsets" / "commit" / "abort", in the order they were made
        self.calls: list[str] = []
        self.in_transaction = False
        self._metadata = _FakeMetadata(broker)
        # Partitions added to the open transaction ahead of its records (see
        # _FakeTxnManager), cleared when one begins.
        self.added: list[TopicPartition] = []

    def _partition(
        self, topic: str, partition: int | None, key: bytes | None, value: Any, *_: Any
    ) -> int:
        """aiokafka's choice of partition: the service's partitioner on the metadata."""
        found = self._metadata.partitions_for_topic(topic)
        assert found is not None
        assert partition is None
        return partition_for_key(key, sorted(found), sorted(found))

    async def start(self) -> None:
        if self.txn_id is not None:
            await asyncio.sleep(self.broker.init_delay_s)
            if self.broker.fail_inits:
                self.broker.fail_inits -= 1
                raise KafkaConnectionError("init failed (fake)")
            self.epoch = self.broker.epochs.get(self.txn_id, -1) + 1
            self.broker.epochs[self.txn_id] = self.epoch

    async def stop(self) -> None:
        await asyncio.sleep(self.broker.stop_delay_s)
        self.stopped = True

    async def begin_transaction(self) -> None:
        assert not self.in_transaction, "a transaction is already open"
        self.calls.append("begin")
        self.in_transaction = True
        self._pending = []
        self._offsets = {}
        self.added = []

    async def commit_transaction(self) -> None:
        assert self.in_transaction, "no transaction to commit"
        self.calls.append("commit")

        async def end() -> None:
            try:
                await asyncio.sleep(self.broker.commit_delay_s)
                await self._commit()
            finally:
                self.in_transaction = False

        # As aiokafka: the EndTxn is shielded, a cancelled caller stops waiting for it
        # but the commit goes on.
        # (Its outcome is retrieved here so a cancelled caller leaves no stray error.)
        ending = asyncio.ensure_future(end())
        ending.add_done_callback(lambda t: t.cancelled() or t.exception())
        await asyncio.shield(ending)

    async def abort_transaction(self) -> None:
        assert self.in_transaction, "no transaction to abort"
        self.calls.append("abort")
        self.in_transaction = False
        self._pending = []
        self._offsets = {}

    async def send_offsets_to_transaction(
        self, offsets: dict[TopicPartition, OffsetAndMetadata], group_id: str
    ) -> None:
        self.calls.append("offsets")
        assert self.in_transaction, "offsets outside a transaction"
        await asyncio.sleep(self.broker.offsets_delay_s)
        self._check_epoch()
        for tp, om in offsets.items():  # the last one sent in a transaction wins
            self._offsets[(group_id, tp)] = om

    async def send(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[None]:
        self.calls.append("send")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        size = len(key or b"") + len(value or b"")
        size += sum(len(n) + len(v or b"") for n, v in headers or [])
        if size > self.broker.max_value_bytes:
            fut.set_exception(MessageSizeTooLargeError())
        else:
            rec = Rec(topic, 0, -1, key, value, list(headers or []))
            # Without a transaction a record is visible once acknowledged.
            (self._pending if self.txn_id is not None else self.broker.outputs).append(rec)
            fut.set_result(None)
        return fut

    def _check_epoch(self) -> None:
        if self.txn_id is not None and self.broker.epochs.get(self.txn_id) != self.epoch:
            raise ProducerFenced()

    async def _commit(self) -> None:
        await asyncio.sleep(0)
        self._check_epoch()
        if self.broker.fail_commits > 0:
            self.broker.fail_commits -= 1
            raise KafkaConnectionError("broker gone")
        self.broker.outputs.extend(self._pending)
        self.broker.committed.update(self._offsets)
        self.broker.commits += 1


class _Coordinator:
    def __init__(self, consumer: FakeConsumer) -> None:
        self._c = consumer
        # aiokafka's group coordination task: runs for the consumer's life unless an
        # unexpected error ends it (see end_coordination).
        self._coordination_task: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        # Its heartbeat and committed-offsets refresh tasks (None while not running).
        self._heartbeat_task: asyncio.Future[None] | None = None
        self._commit_refresh_task: asyncio.Future[None] | None = None
        self.coordinator_deaths = 0

    def end_task(self, name: str, error: BaseException) -> None:
        """What aiokafka does when one of its group tasks (``_coordination_task``,
        ``_heartbeat_task``, ``_commit_refresh_task``) dies: the task ends with the error,
        and every getmany() from then on raises it."""
        task = asyncio.get_running_loop().create_future()
        task.set_exception(error)
        setattr(self, name, task)
        self._c.broker.fail_fetches = [error] * 1_000_000

    @property
    def group_id(self) -> str:
        return self._c.group_id

    async def ensure_coordinator_known(self) -> None:
        await asyncio.sleep(0)

    def coordinator_dead(self) -> None:
        self.coordinator_deaths += 1

    async def _send_req(self, request: OffsetFetchRequest) -> OffsetFetchResponse_v3:
        """OffsetFetch (the only request the engine sends through the coordinator),
        answered as a v3 broker answers it."""
        broker = self._c.broker
        broker.offset_fetches += 1
        struct = request.build(OffsetFetchRequest_v3)
        if broker.offset_fetch_errors:
            return OffsetFetchResponse_v3(0, [], broker.offset_fetch_errors.pop(0))
        topics = []
        for topic, partitions in struct.topics:
            answers = []
            for p in partitions:
                found = broker.committed.get((struct.consumer_group, TopicPartition(topic, p)))
                if found is None:
                    answers.append((p, -1, "", 0))
                else:
                    answers.append((p, found.offset, found.metadata, 0))
            topics.append((topic, answers))
        return OffsetFetchResponse_v3(0, topics, 0)


class _Fetcher:
    def __init__(self) -> None:
        # aiokafka's fetch task (its ``error_future``): runs for the consumer's life
        # unless an unexpected error ends it; then getmany() returns no record, for good.
        self.error_future: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class _Client:
    def __init__(self) -> None:
        self.closed = False  # its connections and metadata task
        # aiokafka's metadata refresh task (its ``_sync_task``).
        self._sync_task: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def close(self) -> None:
        # As aiokafka's: awaiting a metadata task that ended re-raises its error before
        # any connection is closed.
        sync = self._sync_task
        if sync is not None and sync.done() and (error := sync.exception()) is not None:
            raise error
        self.closed = True


class FakeConsumer:
    def __init__(self, broker: FakeBroker, **kwargs: Any) -> None:
        self.broker = broker
        self.group_id: str = kwargs["group_id"]
        self.max_records: int = kwargs.get("max_poll_records", 500)
        self._assigned: set[TopicPartition] = set()
        self._paused: set[TopicPartition] = set()
        self.positions: dict[TopicPartition, int] = {}
        self.listener: Any = None
        self.stopped = False
        self._coordinator = _Coordinator(self)
        self._fetcher = _Fetcher()
        self._client = _Client()
        self.commits: list[dict[TopicPartition, OffsetAndMetadata]] = []
        self.asked: list[set[TopicPartition]] = []  # the partitions each getmany asked for
        self.asked_at: list[float] = []  # when (the loop's time)
        self.returned: list[tuple[float, int]] = []  # (when, records) of each getmany
        self._lso: dict[TopicPartition, int] = {}
        self._highwater: dict[TopicPartition, int] = {}
        self._polled: dict[TopicPartition, float] = {}
        self.poll_age_s = 0.0
        # A producer's transaction held open on a partition: the offset of its first
        # record, where the last stable offset stays while the log grows past it.
        self.open_transaction_at: dict[TopicPartition, int] = {}
        self.awaiting_reset: set[TopicPartition] = set()

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        self.stopped = True
        # As aiokafka's: the fetcher's close re-raises the error its task ended with,
        # before the client's connections are closed.
        ended = self._fetcher.error_future
        if ended.done() and (error := ended.exception()) is not None:
            raise error
        await self._client.close()

    def subscribe(self, topics: list[str], listener: Any) -> None:
        self.listener = listener

    async def assign(self, tps: list[TopicPartition]) -> None:
        """What a rebalance does: revoke everything, then assign ``tps`` (eager protocol)."""
        old = sorted(self._assigned)
        await self.listener.on_partitions_revoked(old)
        self._assigned = set(tps)
        for tp in tps:
            found = self.broker.committed.get((self.group_id, tp))
            self.positions[tp] = found.offset if found else 0
        await self.listener.on_partitions_assigned(set(tps))

    def assignment(self) -> set[TopicPartition]:
        return set(self._assigned)

    def pause(self, *tps: TopicPartition) -> None:
        self._paused.update(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self._paused.difference_update(tps)

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.positions[tp] = offset

    async def seek_to_end(self, *tps: TopicPartition) -> bool:
        for tp in tps:
            self.positions[tp] = len(self.broker.logs.get(tp, []))
        return True

    @property
    def _subscription(self) -> Any:
        """aiokafka's SubscriptionState as far as the engine reads it: fetch positions,
        valid unless the test put a partition in ``awaiting_reset``."""
        states = {
            tp: SimpleNamespace(
                has_valid_position=tp not in self.awaiting_reset, position=self.positions[tp]
            )
            for tp in self._assigned
            if tp in self.positions
        }
        assignment = SimpleNamespace(state_value=states.get)
        return SimpleNamespace(subscription=SimpleNamespace(assignment=assignment))

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: len(self.broker.logs.get(tp, [])) for tp in tps}

    def highwater(self, tp: TopicPartition) -> int | None:
        return self._highwater.get(tp)

    def last_poll_timestamp(self, tp: TopicPartition) -> int | None:
        # Wall-clock ms of the last fetch answer, as aiokafka; poll_age_s ages it (a
        # partition whose fetches stopped).
        polled = self._polled.get(tp)
        return None if polled is None else int((polled - self.poll_age_s) * 1000)

    def last_stable_offset(self, tp: TopicPartition) -> int | None:
        # As aiokafka: known from fetch responses only, so a partition that is not
        # fetched (paused, or left out of getmany) keeps the value of its last fetch.
        return self._lso.get(tp)

    async def commit(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        self.commits.append(offsets)
        for tp, om in offsets.items():
            self.broker.committed[(self.group_id, tp)] = om

    async def getmany(
        self, *partitions: TopicPartition, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[TopicPartition, list[Rec]]:
        if self.stopped:  # as aiokafka's: a loop left running on a stopped consumer ends
            raise ConsumerStoppedError()
        if self.broker.fail_fetches:
            raise self.broker.fail_fetches.pop(0)
        if self._fetcher.error_future.done():  # nothing is fetched any more
            await asyncio.sleep(timeout_ms / 1000)
            return {}
        limit = max_records or self.max_records
        out: dict[TopicPartition, list[Rec]] = {}
        wanted = set(partitions) if partitions else self._assigned
        self.asked.append(set(wanted))
        self.asked_at.append(asyncio.get_running_loop().time())
        for tp in sorted((self._assigned & wanted) - self._paused):
            log = self.broker.logs.get(tp, [])
            self._lso[tp] = min(len(log), self.open_transaction_at.get(tp, len(log)))
            self._highwater[tp] = len(log)
            self._polled[tp] = time.time()
            pos = self.positions.get(tp, 0)
            chunk = log[pos : min(pos + limit, self._lso[tp])]  # read_committed
            if chunk:
                self.positions[tp] = pos + len(chunk)
                if records := [_handed_out(r) for r in chunk if not r.control]:
                    out[tp] = records
        if out and self.broker.fail_after_draining:
            raise self.broker.fail_after_draining.pop(0)
        if not out:
            self.broker.data.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.broker.data.wait(), timeout_ms / 1000)
        self.returned.append((asyncio.get_running_loop().time(), sum(len(r) for r in out.values())))
        return out


def _handed_out(rec: Rec) -> Any:
    if rec.unreadable is None:
        return rec
    return UnreadableRecord.at(rec.topic, rec.partition, rec.offset, rec.unreadable)
