"""The consume-decide-produce loop.

Design, in the order the pitfalls of Python Kafka consumers taught it:

* Records are fetched in batches (``getmany`` with ``max_records``): the batch size is the
  bound on in-flight events (backpressure). Within a batch, partitions run concurrently
  and each partition's records run in offset order.
* Exactly-once on the Kafka side: a batch's outputs (classifications and dead letters)
  and its input offsets are committed in one transaction. The offsets are added before
  the records (aiokafka#1004). The Kubernetes write is idempotent (the UUID check), so a
  batch replayed after a crash writes nothing twice. Without exactly-once, the offsets are
  committed only after every output is acknowledged (at-least-once).
* A retryable failure stops its partition at that offset: the batch commits what came
  before it, the partition is rewound to the failed record and paused for a capped
  exponential back-off, and the other partitions keep going. Nothing is skipped; after
  ``max_attempts`` the processor dead-letters the event.
* Work per poll is bounded in time (``partition_budget_s``), so a slow cluster cannot hold
  the loop past ``max.poll.interval.ms`` and trigger a rebalance storm (aiokafka#848).
* On revoke, the listener waits (bounded) for the batch in progress to commit, so the
  partitions are handed over with their offsets committed (faust#133).
* The lag series of a revoked partition is removed (faust PR #610).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka.errors import KafkaError, ProducerFenced
from aiokafka.structs import ConsumerRecord, TopicPartition

from service.stream.codec import InputRef
from service.stream.metrics import StreamMetrics
from service.stream.processor import OutRecord, Processor, RetryLater

__all__ = ["StreamService", "StreamSettings"]

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class StreamSettings:
    input_topic: str
    group_id: str
    exactly_once: bool = True
    transactional_id: str | None = None
    max_batch: int = 500
    retry_backoff_s: float = 0.5
    retry_backoff_max_s: float = 30.0
    # The revoke wait must outlast a batch (its budget plus one slow Kubernetes call), or
    # a slow batch would still be running when its partitions move.
    partition_budget_s: float = 20.0
    revoke_wait_s: float = 45.0
    poll_timeout_ms: int = 500
    client_args: dict[str, Any] = field(default_factory=dict)
    consumer_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class _PartitionResult:
    tp: TopicPartition
    out: list[OutRecord]
    next_offset: int | None  # the offset to commit (last done + 1); None: nothing done
    rewind_to: int | None = None  # stopped early: seek here before the next poll
    retry: RetryLater | None = None


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, service: StreamService) -> None:
        self._service = service

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self._service._on_revoked(list(revoked))

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        self._service._on_assigned(list(assigned))


class StreamService:
    """Runs the loop until :meth:`request_stop`; then commits, leaves the group, returns."""

    def __init__(
        self,
        settings: StreamSettings,
        processor: Processor,
        metrics: StreamMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._s = settings
        self._processor = processor
        self._metrics = metrics
        self._clock = clock
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._stopping = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._attempts: dict[tuple[TopicPartition, int], int] = {}
        self._resume_at: dict[TopicPartition, float] = {}
        self._assigned: set[TopicPartition] = set()
        self._positions: dict[TopicPartition, int] = {}
        self._commit_failures = 0
        self._revoked_in_batch: set[TopicPartition] = set()
        self.started = False
        self.last_loop = clock()
        self.processed = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        s = self._s
        self._consumer = AIOKafkaConsumer(
            **s.client_args,
            group_id=s.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            max_poll_records=s.max_batch,
            **s.consumer_args,
        )
        self._producer = await self._start_producer()
        try:
            await self._consumer.start()
        except BaseException:
            await self._producer.stop()
            raise
        self._consumer.subscribe([s.input_topic], listener=_Listener(self))
        self.started = True
        log.info("consumer_started", topic=s.input_topic, group=s.group_id, eos=s.exactly_once)

    async def _start_producer(self) -> AIOKafkaProducer:
        s = self._s
        producer_args: dict[str, Any] = dict(s.client_args)
        if s.exactly_once:
            producer_args["transactional_id"] = s.transactional_id
        else:
            producer_args["enable_idempotence"] = True
            producer_args["acks"] = "all"
        producer = AIOKafkaProducer(**producer_args)
        await producer.start()
        return producer

    async def _replace_producer(self) -> None:
        """A fresh producer after a failed commit.

        After a rejected batch aiokafka keeps the producer's sequence numbers, and every
        later transaction fails with OutOfOrderSequenceNumber (it lacks the Java client's
        epoch bump, KIP-360). Re-initialising under the same transactional.id fences the
        old instance, aborts whatever it left open and starts the sequences afresh.
        """
        old = self._producer
        if old is not None:
            try:
                await old.stop()
            except Exception as exc:  # a broken producer may fail to close; it is discarded
                log.warning("producer_close_failed", error=str(exc))
        self._producer = None
        attempt = 0
        while True:
            try:
                self._producer = await self._start_producer()
                return
            except ProducerFenced:
                raise
            except KafkaError as exc:  # the brokers may be down: wait, do not crash-loop
                attempt += 1
                delay = self._backoff(attempt)
                log.warning("producer_restart_failed", error=str(exc), retry_in_s=delay)
                if self._stopping.is_set():
                    raise
                await asyncio.sleep(delay)

    def request_stop(self) -> None:
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def close(self) -> None:
        """Leave the group and flush; safe to call after a failed start."""
        if self._consumer is not None:
            await self._consumer.stop()  # sends LeaveGroup: partitions move at once
        if self._producer is not None:
            await self._producer.stop()
        self.started = False
        log.info("consumer_stopped", processed=self.processed)

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        assert self._consumer is not None, "start() first"
        while not self._stopping.is_set():
            self.last_loop = self._clock()
            self._resume_due()
            timeout = self._s.poll_timeout_ms
            if self._resume_at:
                timeout = min(timeout, 100)
            batch = await self._fetch(timeout)
            if batch:
                self._idle.clear()
                try:
                    await self._process_batch(batch)
                finally:
                    self._idle.set()
            await self._update_lag()

    async def _fetch(self, timeout_ms: int) -> dict[TopicPartition, list[ConsumerRecord]]:
        """One batch of at most ``max_batch`` records, shared fairly among partitions.

        aiokafka fills ``getmany(max_records=N)`` partition by partition from its fetch
        buffers, so with a few hundred records buffered per partition a batch covered one
        or two partitions and the rest waited: no concurrency across partitions. Each
        partition gets an equal share instead; the first call waits for data, the others
        take what is already buffered.
        """
        assert self._consumer is not None
        consumer = self._consumer
        paused = consumer.paused()
        active = [tp for tp in consumer.assignment() if tp not in paused]
        share = max(1, self._s.max_batch // max(1, len(active)))
        batch: dict[TopicPartition, list[ConsumerRecord]] = await consumer.getmany(
            timeout_ms=timeout_ms, max_records=share
        )
        if batch:
            for tp in active:
                if tp not in batch:
                    more = await consumer.getmany(tp, timeout_ms=0, max_records=share)
                    batch.update(more)
        return batch

    async def _process_batch(self, batch: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        self._revoked_in_batch.clear()
        results = await asyncio.gather(
            *(self._process_partition(tp, records) for tp, records in batch.items())
        )
        # A partition revoked while this batch ran belongs to another member now (or will
        # be re-fetched from its committed offset): committing its offsets or publishing
        # its outputs here could duplicate them. The Kubernetes writes already made are
        # idempotent, so its new owner's replay finds them in place.
        dropped = [res.tp for res in results if res.tp in self._revoked_in_batch]
        if dropped:
            log.warning("dropping_results_of_revoked_partitions", partitions=dropped)
            results = [res for res in results if res.tp not in self._revoked_in_batch]
        out = [r for res in results for r in res.out]
        offsets = {res.tp: res.next_offset for res in results if res.next_offset is not None}
        if out or offsets:
            try:
                await self._commit(out, offsets)
            except ProducerFenced:
                log.error("producer_fenced", transactional_id=self._s.transactional_id)
                raise
            except KafkaError as exc:
                # Nothing of this batch is visible: process it again from its first offsets.
                self._commit_failures += 1
                delay = self._backoff(self._commit_failures)
                log.warning("commit_failed_replaying_batch", error=str(exc), retry_in_s=delay)
                self._metrics.retries.labels("kafka_commit").inc()
                for tp, records in batch.items():
                    self._rewind(tp, records[0].offset)
                await asyncio.sleep(delay)
                await self._replace_producer()
                return
        self._commit_failures = 0
        self.processed += sum(len(res.out) for res in results)
        self._positions.update(offsets)
        for res in results:
            if res.rewind_to is not None:
                self._rewind(res.tp, res.rewind_to)
            if res.retry is not None:
                self._pause(res.tp, self._backoff(res.retry.attempt))

    async def _process_partition(
        self, tp: TopicPartition, records: list[ConsumerRecord]
    ) -> _PartitionResult:
        result = _PartitionResult(tp=tp, out=[], next_offset=None)
        deadline = self._clock() + self._s.partition_budget_s
        for record in records:
            if self._clock() > deadline or self._stopping.is_set() or tp in self._revoked_in_batch:
                # Over budget: the rest comes with the next poll. Stopping or revoked: the
                # rest is left for whoever consumes this partition next.
                result.rewind_to = record.offset
                break
            key = (tp, record.offset)
            attempt = self._attempts.get(key, 0) + 1
            ref = InputRef(topic=tp.topic, partition=tp.partition, offset=record.offset)
            try:
                produced = await self._processor.process(
                    ref, record.key, record.value, record.headers, attempt=attempt
                )
            except RetryLater as retry:
                self._attempts[key] = attempt
                result.rewind_to = record.offset
                result.retry = retry
                break
            self._attempts.pop(key, None)
            result.out.append(produced)
            result.next_offset = record.offset + 1
        return result

    async def _commit(self, out: list[OutRecord], offsets: dict[TopicPartition, int]) -> None:
        assert self._producer is not None
        started = time.perf_counter()
        producer = self._producer
        if self._s.exactly_once:
            async with producer.transaction():
                if offsets:
                    await producer.send_offsets_to_transaction(offsets, self._s.group_id)
                futures = [
                    await producer.send(r.topic, r.value, key=r.key, headers=r.headers) for r in out
                ]
                # aiokafka commits a transaction even when one of its batches was rejected
                # (e.g. MessageSizeTooLarge): the record would be lost while its offset is
                # committed. Awaiting every delivery first turns that into an abort.
                if futures:
                    await asyncio.gather(*futures)
        else:
            futures = [
                await producer.send(r.topic, r.value, key=r.key, headers=r.headers) for r in out
            ]
            if futures:
                await asyncio.gather(*futures)
            assert self._consumer is not None
            if offsets:
                await self._consumer.commit(offsets)
        self._metrics.commit.observe(time.perf_counter() - started)

    # ------------------------------------------------------------------ pause / resume

    def _backoff(self, attempt: int) -> float:
        """Capped exponential: backoff, 2x, 4x, ... up to the configured maximum."""
        return min(self._s.retry_backoff_s * 2.0 ** (attempt - 1), self._s.retry_backoff_max_s)

    def _rewind(self, tp: TopicPartition, offset: int) -> None:
        assert self._consumer is not None
        if tp in self._consumer.assignment():
            self._consumer.seek(tp, offset)

    def _pause(self, tp: TopicPartition, delay: float) -> None:
        assert self._consumer is not None
        if tp in self._consumer.assignment():
            self._consumer.pause(tp)
            self._resume_at[tp] = self._clock() + delay
            log.info("partition_paused", topic=tp.topic, partition=tp.partition, seconds=delay)

    def _resume_due(self) -> None:
        assert self._consumer is not None
        now = self._clock()
        for tp, at in list(self._resume_at.items()):
            if at <= now:
                del self._resume_at[tp]
                if tp in self._consumer.assignment():
                    self._consumer.resume(tp)

    # ------------------------------------------------------------------ rebalance

    async def _on_revoked(self, revoked: list[TopicPartition]) -> None:
        # Wait for the batch in flight to commit before the partitions move, but not
        # forever: a stuck batch must not block the whole group's rebalance.
        try:
            await asyncio.wait_for(self._idle.wait(), self._s.revoke_wait_s)
        except TimeoutError:
            log.warning("revoke_wait_timed_out", partitions=len(revoked))
        self._revoked_in_batch.update(revoked)
        for tp in revoked:
            self._assigned.discard(tp)
            self._resume_at.pop(tp, None)
            self._positions.pop(tp, None)
            self._metrics.forget_partition(tp.topic, tp.partition)
        self._attempts = {k: v for k, v in self._attempts.items() if k[0] not in revoked}
        self._metrics.assigned.set(len(self._assigned))
        log.info("partitions_revoked", partitions=[tp.partition for tp in revoked])

    def _on_assigned(self, assigned: list[TopicPartition]) -> None:
        self._assigned = set(assigned) | self._assigned
        self._metrics.assigned.set(len(self._assigned))
        log.info("partitions_assigned", partitions=sorted(tp.partition for tp in assigned))

    async def _update_lag(self) -> None:
        # read_committed: the last stable offset is what this consumer can reach. A
        # partition that has not committed here yet starts from the group's committed
        # offset, so a partition stuck on its first record still shows its lag.
        assert self._consumer is not None
        for tp in list(self._assigned):
            position = self._positions.get(tp)
            if position is None:
                try:
                    position = await self._consumer.committed(tp) or 0
                except KafkaError:
                    continue
                self._positions[tp] = position
            end = self._consumer.last_stable_offset(tp)
            if end is not None:
                self._metrics.lag.labels(tp.topic, str(tp.partition)).set(max(end - position, 0))

    @property
    def assignment(self) -> set[TopicPartition]:
        return set(self._assigned)
