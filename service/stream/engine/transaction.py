"""One commit of one partition: its outputs and input offset in one transaction."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from aiokafka.structs import OffsetAndMetadata, TopicPartition

from service.stream import aiokafka_internals, deferred, errors
from service.stream.engine.core import EngineCore, being_cancelled, log
from service.stream.engine.state import Done, Partition, Unsure
from service.stream.ledger import CommitPlan
from service.stream.processor import OutRecord

# How long after a transaction ended the broker may still be writing its markers: a
# transaction begun within this sends its offsets first (see _send). Back to back
# (bench/bench_txn.py --first both, 10 ms back-off), transactions took 23-32 ms each with
# offsets first and 33-34 ms with outputs first (which waits a fixed 20 ms).
MARKERS_WINDOW_S = 0.02


class Rejected(Exception):
    """The broker refused some records of a commit; ``offsets`` are their inputs."""

    def __init__(self, offsets: list[int], error: BaseException, *, alone: bool) -> None:
        super().__init__(f"{len(offsets)} record(s) rejected: {error!r}")
        self.offsets = offsets
        self.error = error
        self.alone = alone  # each output was a record batch of its own


class Deliveries:
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
        """Wait for every delivery; raise Rejected for refused records, else the first
        other failure."""
        # One by one, not asyncio.gather: a record batch's futures are resolved together,
        # so after the first of a batch the rest are done and awaiting them costs
        # nothing, where gather adds and runs a callback per record (4 % of the CPU of a
        # no-host-found event in a backlog). Like gather(return_exceptions=True) it waits
        # for every delivery before raising.
        failure: BaseException | None = None
        for i, (offset, future) in enumerate(self.futures):
            try:
                await future
            except errors.REFUSED_RECORD as exc:
                self.refused(offset, exc)
            except asyncio.CancelledError as exc:
                if being_cancelled():  # this commit is cut short, not the delivery
                    self.abandon(after=i)
                    raise
                failure = failure or exc
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        if self.rejected:
            assert self.error is not None
            raise Rejected(self.rejected, self.error, alone=self.alone)

    def abandon(self, *, after: int = -1) -> None:
        """The commit failed before its deliveries (those after index ``after``) were
        awaited: their outcome no longer matters (the transaction aborts), but must be
        retrieved, not logged as lost."""
        for _, future in self.futures[after + 1 :]:
            future.add_done_callback(retrieve)


def retrieve(future: Any) -> None:
    """A done callback: the delivery's failure, if any, is seen (not logged as lost)."""
    if not future.cancelled():
        future.exception()


class Transactions(EngineCore):
    """A partition's commit: the engine's analogue of a checkpoint.

    What the ledger has decided (a :class:`~service.stream.ledger.CommitPlan`: the
    outputs and the offset with its done-above metadata) is committed at once or not at
    all. A commit:

     1. begins the partition producer's transaction (unless one was opened ahead);
     2. hands every output to the producer (:meth:`_enqueue`; their deliveries);
     3. sends the input offset to the transaction (first instead, right after another
        transaction: see :data:`MARKERS_WINDOW_S`);
     4. waits for every delivery (a refused record aborts: stubbed or sent alone next);
     5. commits the transaction, then marks the plan committed in the ledger and applies
        its counts (counted once, when published).

    A failure aborts the transaction and takes the partition over afresh (fenced: waits
    for the group instead); an outcome that is not known is kept as
    :class:`~service.stream.engine.state.Unsure` for the next take-over to settle.
    In at-least-once mode the shared producer sends the outputs and the consumer commits
    the offset after them.
    """

    async def _commit(self, part: Partition) -> bool:
        """Commit what the partition has decided; False if the partition was dropped."""
        async with part.commit_lock:
            if part.closed:
                return False
            return await self._commit_locked(part)

    async def _commit_locked(self, part: Partition) -> bool:
        plan = part.ledger.plan()
        if plan is None:
            if part.ahead is not None:  # released before anything was decided
                await self._abort_ahead_locked(part)
            return not part.closed
        tp = part.tp
        started = time.perf_counter()
        try:
            # asyncio.timeout, not wait_for: no task of its own per commit.
            async with asyncio.timeout(self._s.commit_timeout_s):
                await self._send(part, plan)
        except Rejected as rejected:
            stubbed = self._table.oversized.setdefault(tp, set())
            refused = isinstance(rejected.error, errors.REFUSED_RECORD)
            if refused and len(rejected.offsets) > 1 and not rejected.alone:
                # The broker judges a whole record batch against the topic's
                # max.message.bytes, and aiokafka batches a transaction's outputs to one
                # partition without splitting a refused batch: outputs that each fit may
                # be refused together. Taken over again, they are sent one by one, and
                # only one refused alone is replaced by a stub.
                self._table.alone.setdefault(tp, set()).update(rejected.offsets)
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
            sender = aiokafka_internals.producer_identity(part.producer)
            if sender is not None and errors.classify(exc) is not errors.Kind.FENCED:
                self._table.unsure[tp] = Unsure.of(plan, sender)
            self._commit_failed(part, exc)
            return False
        except asyncio.CancelledError as exc:
            # Cut short (the shutdown budget, a drop): aiokafka shields the EndTxn, so
            # the transaction may commit all the same. With its outcome unknown nothing of
            # this part may be committed again; whoever takes the partition over next
            # starts from what the broker has, and counts it if that is this replica with
            # nobody in between (a revoke that gives the partition back).
            sender = aiokafka_internals.producer_identity(part.producer)
            if sender is not None:
                self._table.unsure[tp] = Unsure.of(plan, sender)
            if not being_cancelled():
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
        self._table.committed[tp] = plan.offset
        self._table.failures.pop(tp, None)
        self._table.clear_stall(tp)
        self._metrics.commit.observe(time.perf_counter() - started)
        self._metrics.in_flight.labels(tp.topic, str(tp.partition)).set(part.ledger.in_flight)
        # Resume below half the bound; with a bound of 1 (one record at a time), once empty.
        if part.backpressured and part.ledger.in_flight < max(1, self._s.max_in_flight // 2):
            part.backpressured = False
            self._capacity.set()
        return True

    async def _send(self, part: Partition, plan: CommitPlan[Done]) -> None:
        tp = part.tp
        offsets = {tp: OffsetAndMetadata(plan.offset, plan.metadata)}
        if part.producer is not None:
            producer = part.producer
            ahead, part.ahead = part.ahead, None
            produced = part.take_produced()
            if produced and not _carries(plan, produced):
                # It holds an output produced ahead that this plan does not publish (its
                # record undecided, or decided otherwise): abort it, begin afresh.
                self._metrics.opened_ahead.labels("aborted").inc()
                self._metrics.produced_ahead.labels("discarded").inc(len(produced))
                await producer.abort_transaction()
                part.txn_ended = self._clock()
                ahead, produced = None, {}
            # The offset this transaction has sent so far (the broker keeps the last).
            offered = None if ahead is None else (ahead, "")
            if ahead is None:
                await producer.begin_transaction()
                part.awaits_api = False  # what waits now is for the next transaction
            try:
                if ahead is None and self._clock() - part.txn_ended < MARKERS_WINDOW_S:
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
                pending = await self._enqueue(producer, tp, plan, produced)
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
                if produced:  # aborted here, or by whoever takes the partition over
                    self._metrics.produced_ahead.labels("discarded").inc(len(produced))
                raise
            await producer.commit_transaction()
            part.txn_ended = self._clock()
            if ahead is not None:
                self._metrics.opened_ahead.labels("committed").inc()
                if produced:
                    self._metrics.produced_ahead.labels("published").inc(len(produced))
        else:
            await (await self._enqueue(self._shared_producer, tp, plan)).settle()
            await self._consumer.commit(offsets)

    async def _enqueue(
        self,
        producer: Any,
        tp: TopicPartition,
        plan: CommitPlan[Done],
        produced: dict[int, tuple[OutRecord, Any]] | None = None,
    ) -> Deliveries:
        """Hand every output of ``plan`` (of input partition ``tp``) to the producer,
        except those already ``produced`` ahead into this transaction; their deliveries
        to settle.

        When the plan holds an output the broker refused in a batch of several, each
        output is delivered (or refused) before the next is sent, so each is a record
        batch of its own (see _commit_locked: the broker judges batches).
        """
        sent_alone = self._table.alone.get(tp, set())
        alone = any(o in sent_alone for o, _ in plan.items)
        deliveries = Deliveries(alone=alone)
        try:
            for offset, done in plan.items:
                if produced and offset in produced:
                    deliveries.futures.append((offset, produced[offset][1]))
                    continue
                r = done.out
                try:
                    future = await producer.send(r.topic, r.value, key=r.key, headers=r.headers)
                except errors.REFUSED_RECORD as exc:  # refused before it left the client
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
        self, part: Partition, rejected: Rejected, event: str, reason: str
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

    def _commit_failed(self, part: Partition, exc: BaseException) -> None:
        """A request of ``part``'s transaction failed: fenced, or take it over afresh."""
        if errors.classify(exc) is errors.Kind.FENCED:
            self._metrics.commit_failures.labels("fenced").inc()
            self._fenced(part)
            return
        tp = part.tp
        authz = errors.engine_waits_at_cap(exc)
        reason = "authorization" if authz else "transient"
        self._metrics.commit_failures.labels(reason).inc()
        n = self._table.failures[tp] = self._table.failures.get(tp, 0) + 1
        delay = self._s.retry_backoff_max_s if authz else self._backoff(n)
        if authz or n >= 3:
            self._table.mark_stalled(tp, f"commit failing: {type(exc).__name__}")
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


def _carries(plan: CommitPlan[Done], produced: dict[int, tuple[OutRecord, Any]]) -> bool:
    """Whether each output produced ahead is its record's output in ``plan``."""
    outs = {offset: done.out for offset, done in plan.items}
    return all(outs.get(offset) is out for offset, (out, _) in produced.items())


async def _abort_quietly(producer: Any) -> None:
    """Abort the open transaction of a commit that failed (the error is what counts).

    A producer in a fatal state (fenced) cannot abort and says so at once; a broken one
    is bounded like a commit."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(producer.abort_transaction(), 5.0)
