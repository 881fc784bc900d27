"""The consume-decide-produce engine.

Design, in the order the failures of the first engine taught it (issue 11):

* **Fencing by partition.** Every assigned input partition has its own transactional
  producer, ``transactional.id = <prefix>-<topic>-<partition>`` (Kafka Streams' first
  exactly-once mode, Faust). It is initialised when the partition is taken over, *before*
  the partition's committed offset is read: ``InitProducerId`` aborts (or completes) a
  previous owner's open transaction and bumps the epoch, so a paused replica that wakes up
  can no longer commit (it gets ``ProducerFenced`` and drops its work quietly), and the new
  owner starts from offsets that already include whatever the old owner did commit.
  aiokafka cannot send group-aware offset commits (KIP-447), so this is the fence.
* **No batch barrier.** Each partition commits on its own, in its own transaction, paced
  by a token bucket (one commit per ``commit_interval_ms`` sustained, ``commit_burst``
  at once after a quiet spell) or at once when ``commit_max_records`` outputs wait. A
  partition blocked on the Kubernetes API delays no other.
* **Key-level concurrency** (Confluent's Parallel Consumer): inside a partition, records
  with different keys run concurrently (up to ``key_concurrency``), records with the same
  key in offset order. The key is the record key; a record without one is keyed by the
  event's instance UUID (decoded once more for that), so per-VM order holds either way.
  Because records finish out of order, a commit writes the lowest open offset as the
  committed offset and lists what is done above it in the offset metadata
  (:mod:`service.stream.ledger`): an event completed behind a stuck one is committed at
  once and never processed twice.
* **Backpressure.** A partition with ``max_in_flight`` records received but not committed
  is left out of the fetches until it has room; fetching never stops for the others. When
  every partition is full, one record is still asked for every ``poll_keepalive_s``:
  aiokafka makes a member that stops calling ``getmany()`` leave the group.
* **Failures.** An event the cluster cannot take now (RetryLater) waits in its key's lane
  with capped exponential back-off; other keys go on. A failed commit never retries as if
  nothing happened: the partition is *re-acquired* (new producer, fence, read the
  committed offset, seek, reprocess), which the Kubernetes write's idempotency makes
  harmless. A record the broker rejects as too large is replaced by a stub dead letter;
  an authorisation failure marks the partition stalled (metric, readiness) and re-tries
  at the back-off cap. ``ProducerFenced`` means another member owns the partition now:
  its work is dropped, nothing is re-initialised until the group says it is still ours.
* **Counted once.** Counters advance when the transaction that publishes the outcome
  commits (:mod:`service.stream.deferred`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka.errors import (
    ConsumerStoppedError,
    CorruptRecordException,
    GroupAuthorizationFailedError,
    MessageSizeTooLargeError,
    ProducerFenced,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
)
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata, TopicPartition

from service import backoff
from service.stream import deferred, unreadable
from service.stream.codec import (
    INTERNAL_ERROR,
    OUTPUT_REJECTED,
    InputRef,
    PoisonCode,
    decode_input,
)
from service.stream.committed import fetch_committed
from service.stream.ledger import CommitPlan, Ledger
from service.stream.metrics import StreamMetrics
from service.stream.partitioner import partition_for_key
from service.stream.processor import (
    OutRecord,
    Processor,
    RetryLater,
    stub_dead_letter,
)

__all__ = ["KafkaClientEnded", "StreamService", "StreamSettings", "transactional_id_for"]

# A lane worker with nothing to do for this long ends (a burst leaves no idle tasks).
_WORKER_IDLE_S = 5.0
_WORKER_YIELD_EVERY = 64
# How long after a transaction ended the broker may still be writing its markers: a
# transaction begun within this sends its offsets first (see _send). Back to back
# (bench/bench_txn.py --first both, 10 ms back-off), transactions took 23-32 ms each with
# offsets first and 33-34 ms with outputs first (which waits a fixed 20 ms).
_MARKERS_WINDOW_S = 0.02

log = structlog.get_logger(__name__)

_TOO_LARGE = (MessageSizeTooLargeError, RecordTooLargeError, RecordListTooLargeError)
_INVALID = (CorruptRecordException,)
_AUTHZ = (
    TopicAuthorizationFailedError,
    GroupAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
)


# How a partition that could not be taken over is reported stalled (cleared by the take-over
# that succeeds; a stall of its commits is cleared only by a commit).
_TAKE_OVER_FAILED = "cannot take partition over"


def transactional_id_for(prefix: str, tp: TopicPartition) -> str:
    """The transactional.id bound to input partition ``tp`` (the ACL prefix is ``prefix``)."""
    return f"{prefix}-{tp.topic}-{tp.partition}"


@dataclass(frozen=True)
class StreamSettings:
    input_topic: str
    group_id: str
    exactly_once: bool = True
    # transactional.id = <prefix>-<topic>-<partition>; default: the group id.
    transactional_id_prefix: str | None = None
    max_batch: int = 500  # records per fetch
    max_in_flight: int = 2000  # per partition, received but not committed
    key_concurrency: int = 256  # per partition, keys processed at once
    # The event size limit (the processor dead-letters larger ones unread): an unkeyed
    # record above it is not parsed for its lane either.
    max_event_bytes: int = 1 << 20
    commit_interval_ms: int = 100  # a partition's sustained commit rate: one per interval
    commit_burst: int = 3  # commits that may follow each other sooner (a quiet partition)
    commit_max_records: int = 500
    # The transactional producers' retry back-off, also how long a transaction that
    # follows another waits for the broker to finish that one (see _acquire).
    txn_retry_backoff_ms: int = 2
    retry_backoff_s: float = 0.5
    retry_backoff_max_s: float = 30.0
    # A revoke runs inside the group's rebalance: aiokafka does not heartbeat meanwhile,
    # so it must stay well below the session timeout or this member is evicted too.
    revoke_wait_s: float = 2.0
    # ... and its last commits (all partitions' together) at most this long.
    revoke_commit_s: float = 3.0
    # How long an assignment waits for its take-overs before it hands them to the
    # background (aiokafka does not heartbeat during the callback either).
    assign_wait_s: float = 3.0
    stop_wait_s: float = 10.0  # on SIGTERM the member leaves anyway: finish more
    fence_recheck_s: float = 15.0
    commit_timeout_s: float = 30.0
    poll_timeout_ms: int = 500
    # While every partition is full, how often the loop still asks aiokafka for one
    # record: a member that has not called getmany() for max_poll_interval_ms (300 s by
    # default) leaves the group (see run).
    poll_keepalive_s: float = 60.0
    # How often the end offsets of partitions left out of fetching (backpressure) are
    # read for the lag gauge (see _update_lag).
    lag_refresh_s: float = 10.0
    # Least time between two fetches that returned records (see run).
    fetch_linger_ms: int = 20
    # A quiet partition whose records are still undecided this long after they arrived
    # (they wait on the Kubernetes API) opens its next transaction ahead; 0: never.
    txn_open_ahead_ms: int = 2
    # ... and aborts it when nothing was decided this long after (well below the
    # producer's transaction.timeout.ms, 60 s, after which the broker would fence it).
    txn_open_ahead_max_s: float = 5.0
    # Where a partition the group never committed starts: "earliest" (offset 0: every
    # retained record) or "latest" (its end when taken over). aiokafka also resets a
    # position out of range (retention deleted it, the log was truncated) so.
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    client_args: dict[str, Any] = field(default_factory=dict)
    consumer_args: dict[str, Any] = field(default_factory=dict)

    @property
    def prefix(self) -> str:
        return self.transactional_id_prefix or self.group_id


@dataclass(slots=True)
class _Done:
    """A decided record: what its commit publishes and what it counts."""

    out: OutRecord
    counts: deferred.Increments


@dataclass(frozen=True, slots=True)
class _Unsure:
    """A commit whose outcome is unknown, as much as a take-over needs to count it if it
    landed (see _landed): not its outputs, which an entry kept for a partition that moved
    away would hold for the life of the process."""

    offset: int
    metadata: str
    counts: tuple[deferred.Increments, ...]
    sender: tuple[int, int]  # the producer's (id, epoch)

    @classmethod
    def of(cls, plan: CommitPlan[_Done], sender: tuple[int, int]) -> _Unsure:
        counts = tuple(done.counts for _, done in plan.items)
        return cls(plan.offset, plan.metadata, counts, sender)


class KafkaClientEnded(Exception):
    """One of aiokafka's consumer tasks has ended for good (see _background_ended): this
    consumer never fetches again, only a new one does. run() raises it after committing
    the work in hand; the runtime then starts afresh with new clients."""


class _Rejected(Exception):
    """The broker refused some records of a commit; ``offsets`` are their inputs."""

    def __init__(self, offsets: list[int], error: BaseException, *, alone: bool) -> None:
        super().__init__(f"{len(offsets)} record(s) rejected: {error!r}")
        self.offsets = offsets
        self.error = error
        self.alone = alone  # each output was a record batch of its own


class _Deliveries:
    """The produced outputs of one commit, awaited before it commits.

    Every delivery is awaited inside the transaction: aiokafka would otherwise commit a
    transaction one of whose batches the broker rejected (the output lost while its
    offset is committed).
    """

    __slots__ = ("alone", "error", "futures", "rejected")

    def __init__(self, *, alone: bool = False) -> None:
        self.futures: list[tuple[int, Any]] = []
        self.rejected: list[int] = []
        self.error: BaseException | None = None
        self.alone = alone

    def refused(self, offset: int, error: BaseException) -> None:
        self.rejected.append(offset)
        self.error = error

    async def settle(self) -> None:
        """Wait for every delivery; raise _Rejected for refused records, else the first
        other failure."""
        results = await asyncio.gather(*(f for _, f in self.futures), return_exceptions=True)
        for (offset, _), res in zip(self.futures, results, strict=True):
            if isinstance(res, BaseException):
                if isinstance(res, (*_TOO_LARGE, *_INVALID)):
                    self.refused(offset, res)
                else:
                    raise res
        if self.rejected:
            assert self.error is not None
            raise _Rejected(self.rejected, self.error, alone=self.alone)

    def abandon(self) -> None:
        """The commit failed before its deliveries were awaited: their outcome no longer
        matters (the transaction aborts), but must be retrieved, not logged as lost."""
        for _, future in self.futures:
            future.add_done_callback(_retrieve)


def _retrieve(future: Any) -> None:
    if not future.cancelled():
        future.exception()


class _Partition:
    """One owned input partition: its producer, ledger, key lanes and committer."""

    def __init__(self, tp: TopicPartition, producer: Any, ledger: Ledger[_Done]) -> None:
        self.tp = tp
        self.producer = producer
        self.ledger = ledger
        self.lanes: dict[bytes, deque[ConsumerRecord]] = {}
        self.ready: deque[bytes] = deque()  # lanes with records that no worker runs yet
        self.tasks: set[asyncio.Task[None]] = set()  # the partition's lane workers
        self.free = 0  # workers not running a lane (idle, or started and not yet busy)
        self.has_ready = asyncio.Event()
        self.wake = asyncio.Event()
        self.committer: asyncio.Task[None] | None = None
        self.draining = False  # no new records start (revoke, stop)
        self.closed = False  # dropped: nothing of it may be committed any more
        self.released = False  # its tasks and producer are gone
        self.backpressured = False
        # One transaction at a time per producer: the committer and a revoke both commit.
        self.commit_lock = asyncio.Lock()
        # A transaction opened ahead (see _commit_loop): the offset it has sent, and
        # when it is aborted if nothing has been decided by then.
        self.ahead: int | None = None
        self.ahead_until = 0.0
        # When its producer's last transaction ended (committed or aborted): see _send.
        self.txn_ended = float("-inf")
        # The partition's end offset when it was taken over: the records below it may
        # have been processed by its previous owner (see _decide). None until known.
        self.replay_until: int | None = None


class _TokenBucket:
    """A partition's commit pace (see _commit_loop): one token per ``interval`` seconds,
    at most ``burst`` saved."""

    __slots__ = ("burst", "filled", "interval", "tokens")

    def __init__(self, interval: float, burst: float, now: float) -> None:
        self.interval, self.burst = interval, burst
        self.tokens, self.filled = burst, now

    def level(self, now: float) -> float:
        """The tokens saved by ``now``."""
        self.tokens = min(self.burst, self.tokens + (now - self.filled) / self.interval)
        self.filled = now
        return self.tokens

    def until_next(self) -> float:
        """Seconds until a whole token is saved (from the last ``level``)."""
        return (1 - self.tokens) * self.interval

    def take(self) -> None:
        self.tokens = max(self.tokens - 1, 0.0)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, service: StreamService) -> None:
        self._service = service

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self._service._on_revoked(list(revoked))

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        await self._service._on_assigned(list(assigned))


class StreamService:
    """Runs the engine until :meth:`request_stop`; then commits, leaves the group, returns."""

    def __init__(
        self,
        settings: StreamSettings,
        processor: Processor,
        metrics: StreamMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        consumer_factory: Callable[..., Any] = AIOKafkaConsumer,
        producer_factory: Callable[..., Any] = AIOKafkaProducer,
    ) -> None:
        self._s = settings
        self._processor = processor
        self._metrics = metrics
        self._clock = clock
        self._consumer_factory = consumer_factory
        self._producer_factory = producer_factory
        self._consumer: Any = None
        self._shared_producer: Any = None  # at-least-once mode: one idempotent producer
        self._parts: dict[TopicPartition, _Partition] = {}
        self._acquiring: dict[TopicPartition, asyncio.Task[None]] = {}
        self._assigned: set[TopicPartition] = set()
        self._committed: dict[TopicPartition, int] = {}
        self._stalled: dict[TopicPartition, str] = {}
        self._failures: dict[TopicPartition, int] = {}
        # Offsets whose output the broker refused as too large: replaced by a stub dead
        # letter from then on, across re-acquisitions (reprocessing would refuse again).
        self._oversized: dict[TopicPartition, set[int]] = {}
        # Offsets whose outputs the broker refused in a batch of several: sent alone next.
        self._alone: dict[TopicPartition, set[int]] = {}
        # The last commit of a partition that failed without a known outcome (a timeout,
        # or cut short by a revoke: aiokafka shields EndTxn, so it may land after all),
        # with the (producer id, epoch) that sent it. Nobody processes those records again
        # if it landed, so its counts are applied when this replica's next take-over of
        # the partition proves it did (see _acquire and _landed); kept across revokes, as
        # an eager rebalance often gives the same partition back.
        self._unsure: dict[TopicPartition, _Unsure] = {}
        # Where aiokafka reset a partition's fetch to below what its ledger had received
        # (see _fetch_reset): the re-acquisition starts there, not at the committed offset.
        self._reset_to: dict[TopicPartition, int] = {}
        # Per partition whose last stable offset lies behind its high watermark: that
        # offset and since when it has not moved (see _update_unstable).
        self._unstable: dict[TopicPartition, tuple[int, float]] = {}
        self._stopping = asyncio.Event()
        self._capacity = asyncio.Event()  # a backpressured partition has room again
        self._background: set[asyncio.Task[Any]] = set()
        # Last stable offsets read with ListOffsets for partitions not being fetched.
        self._ends: dict[TopicPartition, int] = {}
        self._ends_read_at = float("-inf")
        self._reading_ends: asyncio.Task[None] | None = None
        # Producers of revoked partitions still closing (see _drop): awaited by close().
        self._closing: set[asyncio.Task[None]] = set()
        self.started = False
        self.last_loop = clock()
        self.processed = 0
        self.fetch_error: str | None = None  # set while fetching fails (for readiness)
        self._fetch_started: float | None = None  # while the loop awaits getmany()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        s = self._s
        # A record aiokafka cannot parse must not raise out of getmany() (see the module).
        unreadable.install()
        self._consumer = self._consumer_factory(
            **s.client_args,
            group_id=s.group_id,
            enable_auto_commit=False,
            auto_offset_reset=s.auto_offset_reset,
            isolation_level="read_committed",
            max_poll_records=s.max_batch,
            **s.consumer_args,
        )
        if not s.exactly_once:
            self._shared_producer = self._producer_factory(
                **s.client_args, enable_idempotence=True, acks="all", partitioner=partition_for_key
            )
            await self._shared_producer.start()
        try:
            await self._consumer.start()
        except BaseException:
            if self._shared_producer is not None:
                await self._shared_producer.stop()
            raise
        self._consumer.subscribe([s.input_topic], listener=_Listener(self))
        self.started = True
        log.info(
            "consumer_started",
            topic=s.input_topic,
            group=s.group_id,
            eos=s.exactly_once,
            transactional_id_prefix=s.prefix if s.exactly_once else None,
        )

    def request_stop(self) -> None:
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def close(self) -> None:
        """Commit what is done, close the producers, leave the group; safe after a failed start.

        Leaving the group comes even when the commit before it is cut short (the shutdown
        budget cancels this while a broker in trouble holds the commit): the partitions
        then move at once instead of after a session timeout. Bounded, as it runs after
        a cancellation.
        """
        try:
            await self._release(list(self._parts), wait_s=0.0)
        finally:
            for task in list(self._background):
                task.cancel()
            left = [self._drop(part) for part in list(self._parts.values())]
            with contextlib.suppress(Exception):  # their producers (the commit cut short)
                await asyncio.wait_for(asyncio.gather(*left), 5.0)
            if self._consumer is not None:
                try:  # LeaveGroup: partitions move at once
                    await asyncio.wait_for(self._consumer.stop(), 5.0)
                except Exception:
                    # aiokafka's stop() re-raises the error of a task that ended with one
                    # (the fetch task: see _background_ended) before it closes its
                    # connections and metadata task; after a restart of the clients they
                    # would stay open, one set per restart.
                    client = getattr(self._consumer, "_client", None)
                    if client is not None:
                        # Its close() re-raises an ended metadata task's error the same
                        # way, before closing anything: forget that task first.
                        sync = getattr(client, "_sync_task", None)
                        if sync is not None and sync.done():
                            client._sync_task = None
                        with contextlib.suppress(Exception):
                            await asyncio.wait_for(client.close(), 5.0)
            if self._closing:
                # Producers of revoked partitions still closing (see _drop), including any
                # a rebalance under way revoked during LeaveGroup.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.gather(*self._closing), 5.0)
            if self._shared_producer is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._shared_producer.stop(), 5.0)
            # The metrics outlive this engine when the Kafka clients restart in-process
            # (service.app.runtime): nothing held any more, whether or not a revoke ran.
            self._metrics.forget_partitions()
        self.started = False
        log.info("consumer_stopped", processed=self.processed)

    # ------------------------------------------------------------------ the fetch loop

    async def run(self) -> None:
        assert self._consumer is not None, "start() first"
        consumer = self._consumer
        failures = 0
        # Fetch pacing. Every fetch that returns records costs a request on both sides and
        # feeds the committers a few records each; under load that per-request work, not
        # the events, was most of the broker's and a third of the service's CPU (200
        # events/s: the broker 0.53 -> 0.30 cores with batching and the commit interval).
        # So after a fetch that brought records the next one waits until fetch_linger has
        # passed: at low rates (records further apart than that) nothing waits, under load
        # records are taken in batches of a linger's worth.
        linger = self._s.fetch_linger_ms / 1000
        next_fetch = 0.0
        polled = self._clock()
        ended: BaseException | None = None
        while not self._stopping.is_set():
            self.last_loop = now = self._clock()
            if next_fetch > now:
                await asyncio.sleep(next_fetch - now)
            # Backpressure by asking only for the partitions with room, not by pausing
            # the others: aiokafka throws a paused partition's fetched records away and
            # fetches them again on resume (measured: +40 % CPU per event in a backlog).
            # A partition left out keeps one fetched response buffered, no more.
            open_tps = [tp for tp, part in self._parts.items() if not part.backpressured]
            max_records = self._s.max_batch
            if not open_tps and self._parts:
                if now - polled < self._s.poll_keepalive_s:
                    self._capacity.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(
                            self._capacity.wait(), self._s.poll_timeout_ms / 1000
                        )
                    self._update_lag()
                    continue
                # Every partition has been full for poll_keepalive_s (records stuck on
                # the Kubernetes API). aiokafka counts the time since the last getmany()
                # and, past max_poll_interval_ms, makes the member leave the group: every
                # partition revoked and its records in flight processed again, by the
                # whole group at once in an API outage. So ask for one record now and
                # then: a partition exceeds max_in_flight by at most one per keep-alive.
                open_tps, max_records = list(self._parts)[:1], 1
            try:
                # With no partition at all, getmany() is still called (asking for every
                # assigned one: none, or those being taken over, which are paused). It is
                # where aiokafka hands its group errors to the user, and its group
                # coordinator waits until the user has taken them: measured after a
                # broker restart, one SyncGroup answered GroupLoadInProgress left a member
                # that had no partition yet without any, for good.
                self._fetch_started = self._clock()
                try:
                    batch: dict[TopicPartition, list[ConsumerRecord]] = await consumer.getmany(
                        *open_tps, timeout_ms=self._s.poll_timeout_ms, max_records=max_records
                    )
                finally:
                    self._fetch_started = None
                polled = self._clock()
            except ConsumerStoppedError:
                raise  # closed under it: nothing more to fetch
            except Exception as exc:
                # The fetch itself failed (e.g. the group or input ACL was revoked, or a
                # batch aiokafka cannot parse at all): the loop keeps turning (liveness)
                # and says why, instead of ending the process. getmany() may have moved
                # other partitions past records it drained and then dropped with the
                # error: each partition goes back to where its records stopped.
                failures += 1
                self._rewind(consumer)
                if (ended := self._client_ended(consumer, fetch_raised=True)) is not None:
                    break
                delay = (
                    self._s.retry_backoff_max_s
                    if isinstance(exc, _AUTHZ)
                    else (self._backoff(failures))
                )
                self.fetch_error = _brief(exc)
                log.warning("fetch_failed", error=self.fetch_error, retry_in_s=round(delay, 3))
                with contextlib.suppress(TimeoutError):  # a stop ends the wait
                    await asyncio.wait_for(self._stopping.wait(), delay)
                continue
            if failures:
                failures = 0
                self.fetch_error = None
            if batch:
                next_fetch = self._clock() + linger
            elif (ended := self._client_ended(consumer, fetch_raised=False)) is not None:
                break
            for tp, records in batch.items():
                part = self._parts.get(tp)
                if part is None or part.draining or part.closed:
                    # Not (yet) ours to process: acquiring seeks back to the committed
                    # offset before it takes records, so nothing fetched here is lost.
                    continue
                self._feed(part, records)
            self._update_lag()
        # Stop: finish the records in hand (bounded) and commit them.
        log.info("stopping_releasing_partitions", partitions=len(self._parts))
        await self._release(list(self._parts), wait_s=self._s.stop_wait_s)
        if ended is not None:
            raise KafkaClientEnded(self.fetch_error) from ended

    def _client_ended(self, consumer: Any, *, fetch_raised: bool) -> BaseException | None:
        """The error that ended one of the consumer's background tasks for good (see
        _background_ended), said once; else None."""
        found = _background_ended(consumer, fetch_raised=fetch_raised)
        if found is None:
            return None
        task, error = found
        # Stopping: no take-over or fence re-check starts while the work in hand is
        # committed (the group will never revoke what this member still thinks it owns).
        self._stopping.set()
        self.fetch_error = _brief(error)
        log.error(
            "kafka_client_ended",
            task=task,
            error=self.fetch_error,
            hint="committing the work in hand, then restarting with new clients",
        )
        return error

    def _feed(self, part: _Partition, records: list[ConsumerRecord]) -> None:
        if part.replay_until is None:
            # The end offset could not be read at the take-over: the first fetch's high
            # watermark is the nearest later bound (nothing beyond it was ever readable).
            part.replay_until = self._consumer.highwater(part.tp) or 0
        expected = part.ledger.next_expected
        if records and expected is not None and records[0].offset < expected:
            self._fetch_reset(part, records[0].offset, expected)
            return
        for record in records:
            if not part.ledger.receive(record.offset):
                continue
            key = self._key_of(record)
            lane = part.lanes.get(key)
            if lane is not None:
                lane.append(record)
                continue
            part.lanes[key] = deque((record,))
            part.ready.append(key)
        self._staff(part)
        if part.ahead is None and not part.ledger.done_uncommitted and part.producer is not None:
            part.wake.set()  # a quiet partition: its committer may open a transaction ahead
        if part.ledger.in_flight >= self._s.max_in_flight and not part.backpressured:
            part.backpressured = True  # left out of the next fetches (see run)
        self._metrics.in_flight.labels(part.tp.topic, str(part.tp.partition)).set(
            part.ledger.in_flight
        )

    def _fetch_reset(self, part: _Partition, offset: int, expected: int) -> None:
        """aiokafka handed out a record below the offset after the last one received.

        It never delivers a record twice (a seek drops what was buffered, and a fetch
        answer for an old position is discarded), and the engine itself never seeks
        below that offset: aiokafka reset the fetch (auto_offset_reset, either value)
        because the position lay beyond the partition's end. The log was truncated (an
        unclean leader election) or the topic recreated while the group's offsets
        outlived it: the records from ``offset`` on are this log's, to be processed,
        not skipped as done below the old watermark (which also skipped everything
        written after them up to that watermark, silently). Taken over again from
        ``offset``; records read from the old log and not yet committed are abandoned.
        At least once here: records that survived the truncation are processed again.
        """
        tp = part.tp
        self._metrics.offset_resets.labels(tp.topic, str(tp.partition)).inc()
        self._metrics.offset_reset_time.labels(tp.topic, str(tp.partition)).set(time.time())
        log.error(
            "fetch_offset_reset",
            topic=tp.topic,
            partition=tp.partition,
            offset=offset,
            expected=expected,
        )
        self._reset_to[tp] = offset
        self._reacquire(part, delay=0.0, reason="offset-reset")

    def _rewind(self, consumer: Any) -> None:
        """Seek every partition being processed back to the offset after the last record
        it received, where aiokafka's fetch position has moved past it."""
        for tp, part in self._parts.items():
            if part.draining or part.closed:
                continue
            expected = part.ledger.next_expected
            if expected is None:  # no commit and nothing received: the take-over sought 0
                expected = 0
            position = _fetch_position(consumer, tp)
            if position is not None and position > expected:
                log.warning(
                    "fetch_rewound",
                    topic=tp.topic,
                    partition=tp.partition,
                    position=position,
                    offset=expected,
                )
                consumer.seek(tp, expected)

    def _key_of(self, record: ConsumerRecord) -> bytes:
        if isinstance(record, unreadable.UnreadableRecord):
            return b""  # nothing to read a key from: decided at once, any lane
        if record.key:
            # In lower case like the UUID below: a VM's events keyed by a producer that
            # writes the UUID in upper case and unkeyed ones from another share a lane.
            return bytes(record.key).lower()
        # No key: the instance UUID, so one VM's events stay in order. Anything that does
        # not decode shares one lane (it becomes a dead letter quickly).
        try:
            event = decode_input(record.value, record.headers, max_bytes=self._s.max_event_bytes)
        except Exception:  # oversized (not parsed) or bad: a dead letter soon, any lane
            return b""
        return event.data.request.instance_uuid.lower().encode()

    # ------------------------------------------------------------------ key lanes

    def _staff(self, part: _Partition) -> None:
        """Make sure a worker will take the ready lanes (a new one only if none is free).

        Lanes are run by a small pool of worker tasks per partition rather than a task per
        record: most records are decided without ever waiting (no-host-found, placements
        without a write), so one worker runs lane after lane and task creation would be a
        large share of their CPU. A worker that waits (a PATCH, a back-off) leaves the
        others free; a new worker is started when lanes are ready and none is free, up
        to ``key_concurrency``. Each record still runs in a task of its own lifetime
        (asyncio.timeout in the Kubernetes client binds to the current task).
        """
        if not part.ready or part.draining or part.closed:
            return
        if part.free > 0:
            part.has_ready.set()
            return
        if len(part.tasks) >= self._s.key_concurrency:
            return
        part.free += 1  # counts as free until it has started and taken a lane
        task = asyncio.get_running_loop().create_task(self._worker(part))
        part.tasks.add(task)
        task.add_done_callback(functools.partial(self._part_task_done, part, "worker"))

    async def _worker(self, part: _Partition) -> None:
        ran = 0
        try:
            while not part.draining and not part.closed:
                if not part.ready:
                    part.has_ready.clear()
                    try:
                        await asyncio.wait_for(part.has_ready.wait(), _WORKER_IDLE_S)
                    except TimeoutError:
                        if not part.ready:
                            return
                    continue
                key = part.ready.popleft()
                if key not in part.lanes:
                    continue
                ran += 1
                if ran % _WORKER_YIELD_EVERY == 0:
                    # Lanes decided without waiting run back to back; let the fetch
                    # loop, the committers and the heartbeat in now and then.
                    part.ready.appendleft(key)
                    await asyncio.sleep(0)
                    continue
                part.free -= 1
                try:
                    self._staff(part)  # should this lane wait, another worker takes the rest
                    await self._run_lane(part, key)
                finally:
                    part.free += 1
        finally:
            part.free -= 1
            current = asyncio.current_task()
            if current is not None:
                part.tasks.discard(current)

    async def _run_lane(self, part: _Partition, key: bytes) -> None:
        lane = part.lanes[key]
        try:
            while lane and not part.draining and not part.closed:
                record = lane[0]
                done = await self._decide(part, record)
                if part.closed:
                    return
                lane.popleft()
                part.ledger.complete(record.offset, done)
                part.wake.set()
        finally:
            if not lane and part.lanes.get(key) is lane:
                del part.lanes[key]

    async def _decide(self, part: _Partition, record: ConsumerRecord) -> _Done:
        tp = part.tp
        ref = InputRef(topic=tp.topic, partition=tp.partition, offset=record.offset)
        if isinstance(record, unreadable.UnreadableRecord):
            with deferred.capture() as counts:
                stub = self._processor.stub(ref, None, None, PoisonCode.UNREADABLE, record.reason)
            return _Done(stub, counts)
        attempt = 1
        while True:
            with deferred.capture() as counts:
                try:
                    out = await self._processor.process(
                        ref,
                        record.key,
                        record.value,
                        record.headers,
                        attempt=attempt,
                        # Below the end offset at the take-over: perhaps processed before.
                        replay=record.offset < (part.replay_until or 0),
                    )
                except RetryLater:
                    counts.clear()
                    out = None
                except (Exception, asyncio.CancelledError) as exc:
                    # The processor is total; this is an engine bug. A CancelledError that
                    # is not a cancel of this task leaked out of a callee: a bug too, and
                    # the record's stub, not the worker's end (which re-takes the
                    # partition, meeting the same record again and again).
                    if isinstance(exc, asyncio.CancelledError) and _being_cancelled():
                        raise
                    log.exception(
                        "processing_failed",
                        topic=tp.topic,
                        partition=tp.partition,
                        offset=record.offset,
                    )
                    reason = f"{type(exc).__name__}: {exc}"
                    counts.clear()  # whatever it counted before failing: only the stub
                    out = self._processor.stub(
                        ref, record.key, record.value, INTERNAL_ERROR, reason
                    )
            if out is not None:
                if record.offset in self._oversized.get(tp, ()):
                    with deferred.capture() as stub_counts:  # counted at commit, too
                        out = self._stub(out, ref, record)
                    counts.extend(stub_counts)
                return _Done(out, counts)
            # The cluster cannot take it now: this key waits, the others go on.
            await asyncio.sleep(self._backoff(attempt))
            attempt += 1

    def _stub(self, out: OutRecord, ref: InputRef, record: ConsumerRecord) -> OutRecord:
        """What to publish instead of an output the broker refused (issue 10).

        A dead letter becomes its stub; a classification the output topic refuses (a
        topic configured with a tiny max.message.bytes) becomes a stub dead letter with
        code ``output_rejected``, so the input still ends somewhere visible.
        """
        error = "record refused by the broker as too large"
        if out.source is None:
            reason = f"the output topic {out.topic} refused the classification"
            return self._processor.stub(
                ref, record.key, record.value, OUTPUT_REJECTED, reason, error=error
            )
        return stub_dead_letter(out, error=error)

    # ------------------------------------------------------------------ commits

    async def _commit_loop(self, part: _Partition) -> None:
        # Commits are paced by a token bucket: one token per commit_interval_ms, at most
        # commit_burst saved. A transaction costs the broker and this process about the
        # same whether it carries 1 record or 500 (measured: ~1.5-2.5 ms of client CPU
        # each), so under load a partition commits once per interval with whatever was
        # decided meanwhile; a quiet partition has saved tokens and commits each output
        # at once. commit_max_records waiting outputs commit without a token.
        #
        # Opening ahead. A transaction is a chain of requests (add the output partition,
        # produce, add the group, commit the offset, end): 7.5-11 ms at p50 on the dev
        # stack, which a placement's output used to wait for *after* its ~5-10 ms PATCH.
        # When a quiet partition's records are still undecided txn_open_ahead_ms after
        # they arrived (a no-host-found event is decided in well under a millisecond, so
        # those are waiting on the Kubernetes API), the committer begins the transaction
        # and sends the offset the partition will have once they are done, while they
        # wait, and adds the output partitions their keys go to (_add_partitions_ahead).
        # When they are decided only the outputs and the end remain (decision to commit,
        # bench/bench_txn.py --ahead: p50 11.0 -> 8.4 ms, p90 20.9 -> 12.8 on a busy
        # machine; on a quiet one 4.24 / 3.01 / 2.49 ms at p50 the usual way / opened
        # ahead / with the partitions added ahead). Nothing is produced ahead, so an open
        # transaction holds back no reader of the output topic; if the offset changed
        # meanwhile (more records arrived), it is sent again (the broker keeps the last
        # one of a transaction). Nothing decided within txn_open_ahead_max_s: the
        # transaction is aborted, which loses nothing.
        bucket = _TokenBucket(
            self._s.commit_interval_ms / 1000, float(max(self._s.commit_burst, 1)), self._clock()
        )
        ahead_after = self._s.txn_open_ahead_ms / 1000
        while not part.closed:
            if part.ahead is None:
                await part.wake.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        part.wake.wait(), max(part.ahead_until - self._clock(), 0.0)
                    )
            part.wake.clear()
            if part.closed:
                break
            now = self._clock()
            tokens = bucket.level(now)
            if not part.ledger.done_uncommitted:
                if part.ahead is not None:
                    if now >= part.ahead_until:
                        await self._abort_ahead(part)
                elif ahead_after > 0 and tokens >= 1 and part.ledger.pending:
                    # Records arrived and none is decided: give them ahead_after (a
                    # decision sets wake, and is then committed the usual way).
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(part.wake.wait(), ahead_after)
                    if part.ledger.pending and not part.ledger.done_uncommitted:
                        bucket.take()  # the transaction's token, spent when it begins
                        await self._open_ahead(part)
                continue
            if part.ahead is None:
                while not part.closed:
                    if tokens >= 1 or part.ledger.done_uncommitted >= self._s.commit_max_records:
                        break
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(part.wake.wait(), bucket.until_next())
                    part.wake.clear()
                    tokens = bucket.level(self._clock())
                bucket.take()
            if not part.closed:
                await self._commit(part)

    async def _open_ahead(self, part: _Partition) -> None:
        """Begin ``part``'s next transaction, send the offset it will commit and add the
        output partitions its waiting records will be produced to."""
        async with part.commit_lock:
            offset = part.ledger.settled_position()
            if part.closed or part.ahead is not None or offset is None:
                return
            if part.ledger.done_uncommitted or part.producer is None:
                return
            producer = part.producer
            offsets = {part.tp: OffsetAndMetadata(offset, "")}
            keys = _waiting_keys(part)

            async def begin() -> None:
                await producer.begin_transaction()
                part.ahead, part.ahead_until = offset, self._clock() + self._s.txn_open_ahead_max_s
                # Not right after the previous transaction: the broker answers the first
                # request CONCURRENT_TRANSACTIONS meanwhile, and aiokafka retries a
                # partition's after a fixed 20 ms, the group's sooner (see _send). Added
                # after the offsets instead, a partition's failure (an output ACL) would
                # surface only at the next send, as a misleading IllegalOperation.
                if self._clock() - part.txn_ended >= _MARKERS_WINDOW_S:
                    _add_partitions_ahead(producer, self._processor.output_topic, keys)
                await producer.send_offsets_to_transaction(offsets, self._s.group_id)

            await self._outside_commit(part, begin())

    async def _abort_ahead(self, part: _Partition) -> None:
        async with part.commit_lock:
            if not part.closed and part.ahead is not None and not part.ledger.done_uncommitted:
                await self._abort_ahead_locked(part)

    async def _abort_ahead_locked(self, part: _Partition) -> None:
        part.ahead = None
        self._metrics.opened_ahead.labels("aborted").inc()
        await self._outside_commit(part, part.producer.abort_transaction())
        part.txn_ended = self._clock()

    async def _outside_commit(self, part: _Partition, request: Awaitable[None]) -> None:
        """A transaction request made outside a commit, bounded and failing like one."""
        try:
            await asyncio.wait_for(request, self._s.commit_timeout_s)
        except Exception as exc:
            self._commit_failed(part, exc)

    async def _commit(self, part: _Partition) -> bool:
        """Commit what the partition has decided; False if the partition was dropped."""
        async with part.commit_lock:
            if part.closed:
                return False
            return await self._commit_locked(part)

    async def _commit_locked(self, part: _Partition) -> bool:
        plan = part.ledger.plan()
        if plan is None:
            if part.ahead is not None:  # released before anything was decided
                await self._abort_ahead_locked(part)
            return not part.closed
        tp = part.tp
        started = time.perf_counter()
        try:
            await asyncio.wait_for(self._send(part, plan), self._s.commit_timeout_s)
        except _Rejected as rejected:
            stubbed = self._oversized.setdefault(tp, set())
            refused = isinstance(rejected.error, (*_TOO_LARGE, *_INVALID))
            if refused and len(rejected.offsets) > 1 and not rejected.alone:
                # The broker judges a whole record batch against the topic's
                # max.message.bytes, and aiokafka batches a transaction's outputs to one
                # partition without splitting a refused batch: outputs that each fit may
                # be refused together. Taken over again, they are sent one by one, and
                # only one refused alone is replaced by a stub.
                self._alone.setdefault(tp, set()).update(rejected.offsets)
                self._retake_rejected(
                    part, rejected, "records_rejected_sending_alone", "batch_too_large"
                )
            elif refused and stubbed.isdisjoint(rejected.offsets):
                stubbed.update(rejected.offsets)
                self._metrics.commit_failures.labels("record_too_large").inc()
                self._retake_rejected(
                    part, rejected, "records_rejected_stubbing", "record_too_large"
                )
            else:
                self._commit_failed(part, rejected.error)
            return False
        except Exception as exc:  # fenced, or broker, network or client trouble
            sender = _producer_identity(part.producer)
            if sender is not None and not isinstance(exc, ProducerFenced):
                self._unsure[tp] = _Unsure.of(plan, sender)
            self._commit_failed(part, exc)
            return False
        except asyncio.CancelledError as exc:
            # Cut short (the shutdown budget, a drop): aiokafka shields the EndTxn, so
            # the transaction may commit all the same. With its outcome unknown nothing of
            # this part may be committed again; whoever takes the partition over next
            # starts from what the broker has, and counts it if that is this replica with
            # nobody in between (a revoke that gives the partition back).
            sender = _producer_identity(part.producer)
            if sender is not None:
                self._unsure[tp] = _Unsure.of(plan, sender)
            if not _being_cancelled():
                # Not a cancel of this task but a CancelledError leaking out of the
                # client (a bug): a failed commit, taken over again like any other (only
                # closing the part left it stuck, nothing logged or retried).
                self._commit_failed(part, exc)
                return False
            part.closed = True
            raise
        part.ledger.committed(plan)
        if part.ledger.done_uncommitted:  # decided while this commit ran: the next one
            part.wake.set()
        deferred.apply(done.counts for _, done in plan.items)
        self.processed += len(plan.items)
        self._committed[tp] = plan.offset
        self._failures.pop(tp, None)
        self._clear_stall(tp)
        self._metrics.commit.observe(time.perf_counter() - started)
        self._metrics.in_flight.labels(tp.topic, str(tp.partition)).set(part.ledger.in_flight)
        # Resume below half the bound; with a bound of 1 (one record at a time), once empty.
        if part.backpressured and part.ledger.in_flight < max(1, self._s.max_in_flight // 2):
            part.backpressured = False
            self._capacity.set()
        return True

    async def _send(self, part: _Partition, plan: CommitPlan[_Done]) -> None:
        tp = part.tp
        offsets = {tp: OffsetAndMetadata(plan.offset, plan.metadata)}
        if part.producer is not None:
            producer = part.producer
            ahead, part.ahead = part.ahead, None
            # The offset this transaction has sent so far (the broker keeps the last).
            offered = None if ahead is None else (ahead, "")
            if ahead is None:
                await producer.begin_transaction()
            try:
                if ahead is None and self._clock() - part.txn_ended < _MARKERS_WINDOW_S:
                    # Right after the previous transaction ended, the broker answers the
                    # next one's first request CONCURRENT_TRANSACTIONS until it has
                    # written that one's markers (a few ms). aiokafka retries a first
                    # request that adds an output partition after a fixed 20 ms, one that
                    # adds the group (offsets first) after txn_retry_backoff_ms. So a
                    # transaction that follows closely sends its offsets first: one round
                    # trip more, a shorter wait (e.g. a no-host-found event decided while
                    # its partition committed a placement).
                    await producer.send_offsets_to_transaction(offsets, self._s.group_id)
                    offered = (plan.offset, plan.metadata)
                # Otherwise outputs first, offsets second: aiokafka's sender then adds the
                # output partitions to the transaction and, while the records are
                # produced, the group; one round trip fewer than offsets first (4
                # sequential requests instead of 5: a quiet partition's output is
                # committed that much sooner).
                pending = await self._enqueue(producer, tp, plan)
                try:
                    if offered != (plan.offset, plan.metadata):
                        await producer.send_offsets_to_transaction(offsets, self._s.group_id)
                except BaseException:
                    pending.abandon()
                    raise
                await pending.settle()
            except BaseException as exc:
                # A failed commit aborts its transaction, except one cut short while its
                # partition is released (a revoke, a stop): that partition is given up and
                # its producer closed, and whoever takes it over next aborts the
                # transaction with its InitProducerId (if nobody does, the broker after
                # the transaction timeout; until then read_committed readers of the
                # outputs wait at it). Aborting there would wait for the broker (up to
                # 5 s) inside a bounded release: in a revoke, where no heartbeat is sent.
                if not (isinstance(exc, asyncio.CancelledError) and part.draining):
                    await _abort_quietly(producer)
                part.txn_ended = self._clock()
                raise
            await producer.commit_transaction()
            part.txn_ended = self._clock()
            if ahead is not None:
                self._metrics.opened_ahead.labels("committed").inc()
        else:
            await (await self._enqueue(self._shared_producer, tp, plan)).settle()
            await self._consumer.commit(offsets)

    async def _enqueue(
        self, producer: Any, tp: TopicPartition, plan: CommitPlan[_Done]
    ) -> _Deliveries:
        """Hand every output of ``plan`` (of input partition ``tp``) to the producer;
        their deliveries to settle.

        When the plan holds an output the broker refused in a batch of several, each
        output is delivered (or refused) before the next is sent, so each is a record
        batch of its own (see _commit_locked: the broker judges batches).
        """
        sent_alone = self._alone.get(tp, set())
        alone = any(o in sent_alone for o, _ in plan.items)
        deliveries = _Deliveries(alone=alone)
        try:
            for offset, done in plan.items:
                r = done.out
                try:
                    future = await producer.send(r.topic, r.value, key=r.key, headers=r.headers)
                except (*_TOO_LARGE, *_INVALID) as exc:  # refused before it left the client
                    deliveries.refused(offset, exc)
                else:
                    deliveries.futures.append((offset, future))
                    if alone:
                        await asyncio.wait([future])
        except BaseException:  # cut short or failed: the caller never settles these
            deliveries.abandon()
            raise
        return deliveries

    def _retake_rejected(
        self, part: _Partition, rejected: _Rejected, event: str, reason: str
    ) -> None:
        """Say which records the broker refused and how they go out next (``event``), then
        take the partition over again at once to send them so."""
        tp = part.tp
        log.warning(
            event,
            topic=tp.topic,
            partition=tp.partition,
            offsets=rejected.offsets[:20],
            error=repr(rejected.error)[:200],
        )
        self._reacquire(part, delay=0.0, reason=reason)

    def _commit_failed(self, part: _Partition, exc: BaseException) -> None:
        """A request of ``part``'s transaction failed: fenced, or take it over afresh."""
        if isinstance(exc, ProducerFenced):
            self._metrics.commit_failures.labels("fenced").inc()
            self._fenced(part)
            return
        tp = part.tp
        authz = isinstance(exc, _AUTHZ)
        reason = "authorization" if authz else "transient"
        self._metrics.commit_failures.labels(reason).inc()
        n = self._failures[tp] = self._failures.get(tp, 0) + 1
        delay = self._s.retry_backoff_max_s if authz else self._backoff(n)
        if authz or n >= 3:
            self._mark_stalled(tp, f"commit failing: {type(exc).__name__}")
        self._metrics.retries.labels("kafka_commit").inc()
        log.warning(
            "commit_failed",
            topic=tp.topic,
            partition=tp.partition,
            error=repr(exc)[:300],
            permanent=authz,
            retry_in_s=round(delay, 3),
        )
        self._reacquire(part, delay=delay, reason=reason)

    # ------------------------------------------------------------------ ownership

    async def _on_assigned(self, assigned: list[TopicPartition]) -> None:
        self._assigned |= set(assigned)
        self._metrics.assigned.set(len(self._assigned))
        log.info("partitions_assigned", partitions=sorted(tp.partition for tp in assigned))
        new = [tp for tp in assigned if tp not in self._parts and tp not in self._acquiring]
        # Paused here, so aiokafka hands out no record of them before the fence is up and
        # the position is the freshly read committed offset (_acquire resumes). The
        # take-overs start inside the callback, but aiokafka does not heartbeat while it
        # runs: one slower than assign_wait_s (a transaction coordinator still loading
        # after a broker restart) goes on in the background rather than have this member
        # evicted for missing its session timeout. A revoke cancels it.
        if new:
            self._consumer.pause(*new)
            tasks = [self._in_background(tp, self._acquire(tp), "acquire") for tp in new]
            _, pending = await asyncio.wait(tasks, timeout=self._s.assign_wait_s)
            if pending:
                log.info("partition_acquire_continues", partitions=len(pending))

    async def _on_revoked(self, revoked: list[TopicPartition]) -> None:
        # With partitions_revoked at its end: how long the rebalance waited for this member.
        log.info("partitions_revoking", partitions=sorted(tp.partition for tp in revoked))
        # Not ours any more first: a failure while committing below must not re-acquire.
        self._assigned -= set(revoked)
        for tp in revoked:  # the next owner finds the reset itself
            self._reset_to.pop(tp, None)
            self._unstable.pop(tp, None)  # its series goes with the others (forget_partition)
        for tp in revoked:
            task = self._acquiring.pop(tp, None)
            if task is not None:
                task.cancel()
        await self._release(
            revoked,
            wait_s=self._s.revoke_wait_s,
            commit_s=self._s.revoke_commit_s,
            close_later=True,
        )
        for tp in revoked:
            self._committed.pop(tp, None)
            self._stalled.pop(tp, None)
            self._failures.pop(tp, None)
            self._oversized.pop(tp, None)
            self._alone.pop(tp, None)
            self._ends.pop(tp, None)
            self._metrics.forget_partition(tp.topic, tp.partition)
        self._metrics.assigned.set(len(self._assigned))
        log.info("partitions_revoked", partitions=sorted(tp.partition for tp in revoked))

    async def _acquire(self, tp: TopicPartition) -> None:
        """Take ``tp`` over: fence its previous owner, then start from its committed offset."""
        consumer = self._consumer
        consumer.pause(tp)
        if self._stopping.is_set():
            return  # leaving the group: whoever gets it next takes it over
        # InitProducerId and the offset fetch retry without limit inside aiokafka (e.g.
        # CONCURRENT_TRANSACTIONS while the previous owner's transaction cannot be
        # completed, a coordinator that stays loading): no attempt fails, so none would
        # be counted above. A take-over still waiting after commit_timeout_s says so.
        slow = asyncio.get_running_loop().call_later(
            self._s.commit_timeout_s, self._acquire_slow, tp
        )
        try:
            await self._take_over(tp)
        finally:
            slow.cancel()

    async def _acquire_later(self, tp: TopicPartition, delay: float) -> None:
        """Take ``tp`` over after ``delay`` (registered in _acquiring by its caller, so no
        other take-over of it starts meanwhile)."""
        await asyncio.sleep(delay)
        # Re-initialising fences whoever holds the id now: only while the group still
        # gives this partition to us (a fenced zombie is revoked before this fires).
        if tp in self._assigned and not self._stopping.is_set():
            await self._acquire(tp)

    def _acquire_slow(self, tp: TopicPartition) -> None:
        if tp in self._parts or tp not in self._assigned:
            return
        waited = round(self._s.commit_timeout_s)
        log.warning("partition_acquire_slow", topic=tp.topic, partition=tp.partition, s=waited)
        self._mark_stalled(tp, f"{_TAKE_OVER_FAILED}: still waiting after {waited} s")

    async def _take_over(self, tp: TopicPartition) -> None:
        consumer = self._consumer
        attempt = 0
        while True:
            producer = None
            try:
                if self._s.exactly_once:
                    # retry_backoff_ms: a transaction begun right after the previous
                    # commit is answered CONCURRENT_TRANSACTIONS until the broker has
                    # written that one's markers (a few ms), and aiokafka then waits its
                    # retry back-off (default 100 ms) before asking again: measured
                    # (bench/bench_txn.py), a back-to-back transaction took 99 ms of wall
                    # time with 100, 18.4-18.7 ms with 10, 8.6-9.1 ms with 2. A broker
                    # outage and its recovery cost the service the same CPU and log lines
                    # with 2 as with 10 (aiokafka paces reconnects by other means).
                    producer = self._producer_factory(
                        **self._s.client_args,
                        transactional_id=transactional_id_for(self._s.prefix, tp),
                        retry_backoff_ms=self._s.txn_retry_backoff_ms,
                        partitioner=partition_for_key,
                    )
                    await producer.start()  # InitProducerId: the fence
                # Not aiokafka's fetch_committed_offsets: it takes a group-level error
                # for "never committed", and the partition would start over (committed).
                committed = await fetch_committed(consumer._coordinator, tp)
                break
            except asyncio.CancelledError:
                if producer is not None:
                    await _close_quietly(producer)
                raise
            except Exception as exc:
                if producer is not None:
                    await _close_quietly(producer)
                attempt += 1
                authz = isinstance(exc, _AUTHZ)
                delay = self._s.retry_backoff_max_s if authz else self._backoff(attempt)
                if authz or attempt >= 3:
                    self._mark_stalled(tp, f"{_TAKE_OVER_FAILED}: {type(exc).__name__}")
                log.warning(
                    "partition_acquire_failed",
                    topic=tp.topic,
                    partition=tp.partition,
                    error=repr(exc)[:300],
                    retry_in_s=round(delay, 3),
                )
                if self._stopping.is_set() or tp not in self._assigned:
                    return
                await asyncio.sleep(delay)
                if tp not in self._assigned:
                    return
        try:
            await self._install(tp, producer, committed)
        except BaseException:
            # An error nobody foresaw (see _in_background), or a cancel: the producer
            # is closed unless a partition took it (one leaked per retry otherwise).
            part = self._parts.get(tp)
            if producer is not None and (part is None or part.producer is not producer):
                await asyncio.shield(_close_quietly(producer))
            raise

    async def _install(
        self, tp: TopicPartition, producer: Any, found: OffsetAndMetadata | None
    ) -> None:
        """Start ``tp`` from its committed offset ``found`` (None: the group never
        committed it) with ``producer`` (see _take_over)."""
        consumer = self._consumer
        start: int | None = None
        metadata = ""
        if found is not None:  # fetch_committed answers None for "never committed"
            start, metadata = found.offset, found.metadata
        unsure = self._unsure.pop(tp, None)
        if unsure is not None and _landed(unsure, (start, metadata), producer):
            # That commit landed: its records start behind the new position and nobody
            # counts them unless this does.
            deferred.apply(unsure.counts)
            self.processed += len(unsure.counts)
            # A commit that succeeded after all: the failures it was counted among (and
            # a "commit failing" stall) are over, as after any successful commit.
            self._failures.pop(tp, None)
            self._clear_stall(tp)
            log.info(
                "commit_found_landed",
                topic=tp.topic,
                partition=tp.partition,
                committed=start,
                records=len(unsure.counts),
            )
        reset = self._reset_to.pop(tp, None)
        if reset is not None:
            # The fetch was reset below the committed offset (see _fetch_reset): start
            # there; the first commit moves the committed offset back to this log.
            start, metadata = reset, ""
        if tp not in consumer.assignment():
            if producer is not None:
                await _close_quietly(producer)
            return
        old = self._parts.get(tp)
        if old is not None:
            # Taken over twice at once (should not happen: revokes cancel re-acquisitions).
            # This InitProducerId fenced the other's producer: keep this one.
            log.warning("partition_acquired_twice", topic=tp.topic, partition=tp.partition)
            await self._drop(old)
        if start is None and self._s.auto_offset_reset == "latest":
            await consumer.seek_to_end(tp)  # skips what was published before: as configured
        else:
            consumer.seek(tp, start if start is not None else 0)
        # At 0 from the take-over on: increase() misses a series that appears at 1, and
        # CrsOffsetReset would then miss a partition's first reset (usually its only one).
        self._metrics.offset_resets.labels(tp.topic, str(tp.partition))
        part = _Partition(tp, producer, Ledger(start, metadata))
        part.committer = asyncio.create_task(self._commit_loop(part))
        part.committer.add_done_callback(functools.partial(self._part_task_done, part, "committer"))
        self._parts[tp] = part
        if start is not None:
            self._committed[tp] = start
        if self._stalled.get(tp, "").startswith(_TAKE_OVER_FAILED):  # failed take-overs
            self._clear_stall(tp)
        part.replay_until = await self._initial_lag(tp, start or 0)
        consumer.resume(tp)
        log.info(
            "partition_acquired",
            topic=tp.topic,
            partition=tp.partition,
            committed=start,
            resumed_done_above=bool(metadata),
        )

    async def _release(
        self,
        tps: list[TopicPartition],
        *,
        wait_s: float,
        commit_s: float | None = None,
        close_later: bool = False,
    ) -> None:
        """Finish (bounded by ``wait_s``) and commit (bounded by ``commit_s``, default
        commit_timeout_s) the work of ``tps``, then close their producers (``close_later``:
        in the background; see _drop)."""
        if commit_s is None:
            commit_s = self._s.commit_timeout_s
        parts = [self._parts[tp] for tp in tps if tp in self._parts]
        for part in parts:
            part.draining = True
            part.ready.clear()
            part.has_ready.set()  # idle workers wake up and end
        if wait_s > 0:
            running = [t for part in parts for t in part.tasks]
            if running:
                _, late = await asyncio.wait(running, timeout=wait_s)
                if late:
                    log.warning("release_abandoning_in_flight", records=len(late))
        # The partitions' last commits run side by side (a producer each), bounded as a
        # whole: a revoke runs inside the rebalance, where aiokafka sends no heartbeat, and
        # one commit may take commit_timeout_s (a transaction coordinator loading). A
        # commit cut short closes its partition (see _commit_locked): the next owner
        # starts from whatever the broker has.
        commits = [asyncio.create_task(self._last_commit(p)) for p in parts if not p.closed]
        try:
            if commits:
                _, late = await asyncio.wait(commits, timeout=commit_s)
                if late:
                    log.warning("release_commit_cut_short", partitions=len(late))
        finally:
            # Cut short by the bound, or this release cancelled (the shutdown budget):
            # the commits end too, each closing its partition (see _commit_locked).
            for task in commits:
                task.cancel()
            if any(not task.done() for task in commits):
                await asyncio.wait(commits)
        await asyncio.gather(*(self._drop(part, close_later=close_later) for part in parts))
        log.info(
            "partitions_released",
            partitions=sorted(p.tp.partition for p in parts),
        )

    async def _last_commit(self, part: _Partition) -> None:
        try:
            async with part.commit_lock:
                if part.closed:
                    return
                try:
                    await self._commit_locked(part)
                finally:
                    # The last transaction: a record decided meanwhile wakes the
                    # committer, which would begin another once the lock is free, and
                    # the release's cancel would leave that one open on the broker
                    # (read_committed readers of the outputs held back until its timeout;
                    # after a scale to 0 nobody re-initialises the id).
                    part.closed = True
        except Exception as exc:  # released anyway: the next owner reprocesses
            log.warning("release_commit_failed", error=repr(exc)[:300])

    async def _drop(self, part: _Partition, *, close_later: bool = False) -> None:
        """Forget ``part`` without committing anything more of it.

        ``close_later``: its producer is closed in the background. A revoke runs inside the
        rebalance, where aiokafka sends no heartbeat, and closing a producer whose commit
        was cut short waits for the broker (up to 5 s): measured with the broker frozen, a
        revoke bounded to 3 + 2 s took 8.2. A later owner's InitProducerId fences it anyway.
        """
        part.closed = True
        if part.released:
            return
        part.released = True
        part.wake.set()
        if self._parts.get(part.tp) is part:
            del self._parts[part.tp]
        tasks = [*part.tasks]
        if part.committer is not None and part.committer is not asyncio.current_task():
            tasks.append(part.committer)
        for task in tasks:
            task.cancel()
        # The tasks end with CancelledError, which is swallowed; unless this task itself
        # was cancelled meanwhile (a revoke cancelling a re-acquisition): it must then
        # end too, not go on to take the partition over, but only once the producer is
        # closed (shielded, so it is not left half-stopped with its connections open).
        current = asyncio.current_task()
        cancels = current.cancelling() if current is not None else 0
        for task in tasks:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task
        if part.producer is not None:
            closing = asyncio.ensure_future(_close_quietly(part.producer))
            self._closing.add(closing)  # close() awaits it if this is cut short
            closing.add_done_callback(self._closing.discard)
            if not close_later:
                await asyncio.shield(closing)
        if current is not None and current.cancelling() > cancels:
            raise asyncio.CancelledError

    def _fenced(self, part: _Partition) -> None:
        """Another member owns the partition: drop its work; re-check ownership later."""
        tp = part.tp
        self._metrics.fenced.inc()
        log.warning("partition_fenced", topic=tp.topic, partition=tp.partition)
        self._reacquire(part, delay=self._s.fence_recheck_s, reason="fenced")

    def _reacquire(self, part: _Partition, *, delay: float, reason: str) -> None:
        tp = part.tp
        part.closed = True
        if self._parts.get(tp) is part:
            del self._parts[tp]
        if tp not in self._assigned:
            # Revoked (a revoke's last commit failed or found the producer fenced): its
            # release drops the part, and there is nothing to take over. A delayed
            # re-acquisition here would sit in _acquiring, so the rebalance that gives
            # the partition back would skip it and wait out this delay.
            self._spawn(self._drop(part, close_later=True), f"drop-{tp.partition}")
            return
        if tp in self._consumer.assignment():
            self._consumer.pause(tp)

        async def again() -> None:
            await self._drop(part)
            await self._acquire_later(tp, delay)

        self._in_background(tp, again(), f"reacquire-{reason}")

    def _part_task_done(self, part: _Partition, which: str, task: asyncio.Task[None]) -> None:
        """A partition's committer or lane worker ended. Only _drop ends them from outside
        (after closing the partition), and they end by themselves when it drains or
        idles; one that ends by an error nobody foresaw (a bug, a MemoryError, a
        cancellation leaking out of a callee) left its partition stuck while every probe
        stayed green: no commit any more, or a lane nobody runs, the watermark held and
        the partition soon backpressured. Take it over again, as after a failed commit:
        what was decided and not committed is decided again."""
        if part.closed or (not task.cancelled() and task.exception() is None):
            return
        error = asyncio.CancelledError() if task.cancelled() else task.exception()
        tp = part.tp
        log.error(
            "partition_task_crashed",
            topic=tp.topic,
            partition=tp.partition,
            task=which,
            error=repr(error)[:300],
        )
        if self._stopping.is_set():
            return  # released soon anyway: the next owner starts from the committed offset
        n = self._failures[tp] = self._failures.get(tp, 0) + 1
        if n >= 3:
            self._mark_stalled(tp, f"{which} crashed: {type(error).__name__}")
        self._reacquire(part, delay=self._backoff(n), reason="crashed")

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run ``work`` as a task close() cancels."""
        task = asyncio.create_task(work, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _in_background(
        self, tp: TopicPartition, acquiring: Coroutine[Any, Any, None], name: str
    ) -> asyncio.Task[None]:
        """Run a take-over of ``tp`` as a task a revoke of ``tp`` cancels."""
        task = self._spawn(acquiring, f"{name}-{tp.partition}")
        self._acquiring[tp] = task

        def done(t: asyncio.Task[None]) -> None:
            if self._acquiring.get(tp) is t:
                del self._acquiring[tp]
            if t.cancelled() or (exc := t.exception()) is None:
                return
            log.error(
                "partition_acquire_crashed",
                topic=tp.topic,
                partition=tp.partition,
                error=repr(exc)[:300],
            )
            # An error the take-over does not retry (a bug, a MemoryError) left the
            # partition assigned, paused and owned by nobody while every probe stayed
            # green: say so, and take it over again after a back-off.
            taken = tp in self._parts or tp in self._acquiring  # by another take-over
            if tp in self._assigned and not taken and not self._stopping.is_set():
                n = self._failures[tp] = self._failures.get(tp, 0) + 1
                self._mark_stalled(tp, f"{_TAKE_OVER_FAILED}: {type(exc).__name__}")
                self._in_background(tp, self._acquire_later(tp, self._backoff(n)), "retake")

        task.add_done_callback(done)
        return task

    def _mark_stalled(self, tp: TopicPartition, why: str) -> None:
        self._stalled[tp] = why
        self._metrics.stalled.labels(tp.topic, str(tp.partition)).set(1)

    def _clear_stall(self, tp: TopicPartition) -> None:
        if self._stalled.pop(tp, None) is not None:
            self._metrics.stalled.labels(tp.topic, str(tp.partition)).set(0)

    # ------------------------------------------------------------------ helpers

    def _backoff(self, attempt: int) -> float:
        """Capped exponential: backoff, 2x, 4x, ... up to the configured maximum."""
        return backoff.exponential(attempt, self._s.retry_backoff_s, self._s.retry_backoff_max_s)

    def _update_unstable(self, tp: TopicPartition) -> None:
        """How long ``tp``'s last stable offset has stayed behind its high watermark.

        A producer's open transaction holds every record after its first one back from
        read_committed readers, this service included, and the lag, measured to the last
        stable offset (what this consumer can reach), reads 0 meanwhile: nothing else
        shows that events are waiting. A transaction open for long is a producer killed
        mid-transaction (a `crs-consumer dlq redrive` killed while sending: up to its 15
        minute transaction timeout) or one that hangs.
        """
        high = self._consumer.highwater(tp)
        stable = self._consumer.last_stable_offset(tp)
        # aiokafka learns both from fetch answers only: a partition not fetched (left
        # out by backpressure, its fetch failing) keeps those of its last fetch, which
        # may have seen a transaction that has ended since. Not known is not stuck; a
        # partition held by a transaction has nothing to read and is fetched all along.
        polled = self._consumer.last_poll_timestamp(tp)
        known = polled is not None and time.time() * 1000 - polled < _FRESH_FETCH_MS
        gauge = self._metrics.stable_offset_stuck
        if high is None or stable is None or stable >= high or not known:
            if self._unstable.pop(tp, None) is not None:
                gauge.labels(tp.topic, str(tp.partition)).set(0)
            return
        now = self._clock()
        held = self._unstable.get(tp)
        if held is None or held[0] != stable:
            self._unstable[tp] = held = (stable, now)
        gauge.labels(tp.topic, str(tp.partition)).set(now - held[1])

    def _update_lag(self) -> None:
        # read_committed: the last stable offset is what this consumer can reach.
        self._read_unfetched_ends()
        for tp in list(self._assigned):
            self._update_unstable(tp)
            position = self._committed.get(tp)
            end = self._consumer.last_stable_offset(tp)
            read = self._ends.get(tp)
            if read is not None and (end is None or read > end):
                end = read
            if end is None:
                continue
            if position is None:
                position = 0
            part = self._parts.get(tp)
            if part is not None and not part.draining and not part.ledger.in_flight:
                # Everything handed out is committed: what lies between the committed
                # offset and the fetch position was never handed out, i.e. transaction
                # markers and aborted records of a transactional producer's input (one
                # marker per transaction: the lag would stay 1 for good).
                fetched = _fetch_position(self._consumer, tp)
                if fetched is not None:
                    position = max(position, fetched)
            self._metrics.lag.labels(tp.topic, str(tp.partition)).set(max(end - position, 0))

    def _read_unfetched_ends(self) -> None:
        """Now and then, read the end offsets of the partitions backpressure leaves out.

        aiokafka learns a partition's last stable offset from fetch responses only, and a
        partition left out of getmany() is not fetched: its lag would freeze while the
        backlog grows (records stuck on the Kubernetes API), and the lag alert could
        not fire during the outage that builds it. One ListOffsets request (read_committed:
        the LSO) per lag_refresh_s, in the background.
        """
        now = self._clock()
        reading = self._reading_ends
        if reading is not None and not reading.done():
            return
        if now - self._ends_read_at < self._s.lag_refresh_s:
            return
        tps = [tp for tp, part in self._parts.items() if part.backpressured]
        if not tps:
            return
        self._ends_read_at = now

        async def read() -> None:
            try:
                ends = await asyncio.wait_for(self._consumer.end_offsets(tps), 5.0)
            except Exception:  # the next refresh tries again
                return
            for tp, end in ends.items():
                if tp in self._assigned:
                    self._ends[tp] = end

        self._reading_ends = self._spawn(read(), "read-end-offsets")

    async def _initial_lag(self, tp: TopicPartition, committed: int) -> int | None:
        """A lag series from assignment on, before the first fetch brings the end offset;
        returns that end offset (None when it could not be read)."""
        try:
            ends = await asyncio.wait_for(self._consumer.end_offsets([tp]), 5.0)
        except Exception:  # the fetch loop sets it soon anyway
            return None
        end = ends.get(tp)
        if end is not None:
            self._metrics.lag.labels(tp.topic, str(tp.partition)).set(max(end - committed, 0))
        return None if end is None else int(end)

    @property
    def assignment(self) -> set[TopicPartition]:
        return set(self._assigned)

    def fetching_for(self) -> float:
        """How long the loop has been waiting in getmany() (0: not in it). Beyond the
        poll timeout it is aiokafka waiting for a rebalance's new assignment."""
        started = self._fetch_started
        return 0.0 if started is None else max(0.0, self._clock() - started)

    def stalled(self) -> dict[TopicPartition, str]:
        """Assigned partitions that cannot make progress, with the reason (for readiness)."""
        return dict(self._stalled)


def _producer_identity(producer: Any) -> tuple[int, int] | None:
    """(producer id, epoch) of a transactional producer that has started; else None."""
    txn = getattr(producer, "_txn_manager", None)
    if txn is None or txn.producer_id is None or txn.producer_id < 0:
        return None
    return int(txn.producer_id), int(txn.producer_epoch)


# At most this many waiting records' output partitions are added ahead (a quiet partition
# has a few; the topic's partitions bound the set anyway).
_AHEAD_KEYS_MAX = 64


def _waiting_keys(part: _Partition) -> list[bytes]:
    """The output keys of the records at the heads of ``part``'s lanes, as far as the
    engine knows them without decoding: the record key (Nova keys by instance UUID, and
    the processor dead-letters a key naming another instance), else the lane key (the
    instance UUID, in lower case)."""
    keys: list[bytes] = []
    for lane_key, lane in itertools.islice(part.lanes.items(), _AHEAD_KEYS_MAX):
        key = (lane[0].key if lane else None) or lane_key
        if key:
            keys.append(bytes(key))
    return keys


def _add_partitions_ahead(producer: Any, topic: str, keys: list[bytes]) -> None:
    """Add the partitions of ``topic`` that ``keys`` go to to ``producer``'s open
    transaction now, ahead of their records.

    aiokafka adds a partition to the transaction when the first record for it is sent:
    one more round trip (AddPartitionsToTxn) between a placement's decision and its
    commit. It has no public call to add one earlier; its send() takes these two steps
    (the producer's partitioner, then the transaction manager, whose sender adds the
    partition before the group), and a unit test checks that the installed aiokafka
    still has them; without them nothing is added ahead. A guess that turns out wrong
    (a dead letter, a UUID written in another case than its key) costs an empty commit
    marker in that partition; a partition added ahead holds no reader back (only data
    does). Decision to commit, 10 ms decisions one per 50 ms (bench/bench_txn.py
    --ahead): p50 3.01 -> 2.49 ms, p90 3.70 -> 2.97 ms.
    """
    txn = getattr(producer, "_txn_manager", None)
    metadata = getattr(producer, "_metadata", None)
    choose = getattr(producer, "_partition", None)
    if not keys or txn is None or metadata is None or choose is None:
        return
    if not metadata.partitions_for_topic(topic):
        return  # no metadata for the topic yet: the first send adds it, as usual
    for partition in {choose(topic, None, key, None, key, None) for key in keys}:
        txn.maybe_add_partition_to_txn(TopicPartition(topic, partition))


def _brief(error: BaseException) -> str:
    """An error as readiness and the logs name it (bounded)."""
    return f"{type(error).__name__}: {str(error)[:200]}"


def _being_cancelled() -> bool:
    """Whether the current task has been asked to cancel (else a CancelledError it sees
    was raised by a callee of its own accord)."""
    current = asyncio.current_task()
    return current is None or current.cancelling() > 0


def _background_ended(consumer: Any, *, fetch_raised: bool) -> tuple[str, BaseException] | None:
    """(which, error) once one of aiokafka's consumer tasks has ended with an error for
    good (``fetch_raised``: the last getmany() raised).

    aiokafka runs the group protocol (join, sync, every rejoin) in one background task,
    heartbeats and the committed offsets' refresh in two more, the fetching in a fourth
    and the client's metadata refresh in a fifth. Only a rejoin starts the second and
    third again, nothing the others; an error they do not expect ends them. Measured
    for the first: assignment bytes it cannot decode, which any client that joins the
    group by its id and leads a rebalance can hand out; every getmany() then raises that
    error, and the member drops out of the group when its session expires and never
    joins again. The fetch task's end raises nothing: getmany() returns no record, for
    good, while all looks well. Either way retrying cannot help, a new consumer does.
    """
    coordinator = getattr(consumer, "_coordinator", None)
    tasks = [
        ("group coordination", coordinator, "_coordination_task"),
        ("fetching", getattr(consumer, "_fetcher", None), "error_future"),
        # The client's metadata refresh: never started again either, and every request
        # that needs fresh metadata (a partition leader moved) would wait for it.
        ("metadata refresh", getattr(consumer, "_client", None), "_sync_task"),
    ]
    if fetch_raised:
        # These two are started again by a rejoin, which nothing asks for once they have
        # ended outside one: the coordination routine hands their error to every
        # getmany() instead, and that is the sign (a heartbeat that ends during a
        # rebalance is dropped silently by the rejoin). Measured: the heartbeat's first
        # GROUP_AUTHORIZATION_FAILED (the group ACL revoked for a moment) ended it, and
        # the member never rejoined once the ACL was back.
        tasks += [
            ("heartbeat", coordinator, "_heartbeat_task"),
            ("committed offsets refresh", coordinator, "_commit_refresh_task"),
        ]
    for which, owner, name in tasks:
        task = getattr(owner, name, None)
        if task is not None and task.done() and not task.cancelled():
            error: BaseException | None = task.exception()
            if error is not None:
                return which, error
    return None


# A fetch answer older than this: the partition is not being fetched (see _update_unstable).
_FRESH_FETCH_MS = 10_000


def _fetch_position(consumer: Any, tp: TopicPartition) -> int | None:
    """aiokafka's fetch position of ``tp`` if it is valid, else None, without waiting.

    Not ``position()``: while a partition awaits an offset reset that coroutine waits for
    it (request_timeout_ms, again and again), which would hold the consume loop, and it
    takes the group's pending error, which the fetch loop must see.
    """
    try:
        state = consumer._subscription.subscription.assignment.state_value(tp)
    except AttributeError:  # no subscription or assignment (yet)
        return None
    if state is None or not state.has_valid_position:
        return None
    return int(state.position)


def _landed(unsure: _Unsure, found: tuple[int | None, str], producer: Any) -> bool:
    """Whether the unsure commit is the one the take-over found.

    The committed offset and metadata must be the plan's: within one ledger a plan always
    moves one or the other, so no earlier commit of this replica matches. And nobody may
    have initialised the partition's transactional id between the sender and the new
    producer (its epoch exactly one more), for another owner could have redone those
    records and committed the same position, having counted them itself. Either doubt
    leaves them uncounted: an under-count, never a double one.
    """
    if found != (unsure.offset, unsure.metadata):
        return False
    pid, epoch = unsure.sender
    return _producer_identity(producer) == (pid, epoch + 1)


async def _abort_quietly(producer: Any) -> None:
    """Abort the open transaction of a commit that failed (the error is what counts).

    A producer in a fatal state (fenced) cannot abort and says so at once; a broken one
    is bounded like a commit."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(producer.abort_transaction(), 5.0)


async def _close_quietly(producer: Any) -> None:
    try:
        # Bounded: stopping flushes, and a broken producer may never finish flushing.
        await asyncio.wait_for(producer.stop(), 5.0)
    except Exception as exc:  # a fenced or broken producer may fail to close
        log.debug("producer_close_failed", error=repr(exc)[:200])
        # aiokafka's stop() raises before closing its connections when the sender ends
        # fenced (a new owner initialised the id meanwhile): close them here.
        client = getattr(producer, "client", None)
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 5.0)
