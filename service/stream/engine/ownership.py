"""Taking partitions over: assignment, revocation, the fence (InitProducerId) and the
start from the committed offset.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable
from typing import Any

from aiokafka import ConsumerRebalanceListener
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from service.stream import aiokafka_internals, deferred, errors
from service.stream.committed import fetch_committed
from service.stream.engine import clients
from service.stream.engine.core import close_quietly, log
from service.stream.engine.release import Release
from service.stream.engine.state import TAKE_OVER_FAILED, Partition, Unsure
from service.stream.ledger import Ledger


class Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    """aiokafka's rebalance callbacks, handed to the engine."""

    def __init__(self, service: Ownership) -> None:
        self._service = service

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self._service._on_revoked(list(revoked))

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        await self._service._on_assigned(list(assigned))


class Ownership(Release):
    """The group's assignment and revocation, and the take-over of each partition."""

    async def _on_assigned(self, assigned: list[TopicPartition]) -> None:
        self._table.assigned |= set(assigned)
        self._metrics.assigned.set(len(self._table.assigned))
        log.info("partitions_assigned", partitions=sorted(tp.partition for tp in assigned))
        new = [
            tp for tp in assigned if tp not in self._table.parts and tp not in self._table.acquiring
        ]
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
        self._table.disown(revoked)
        await self._release(
            revoked,
            wait_s=self._s.revoke_wait_s,
            commit_s=self._s.revoke_commit_s,
            close_later=True,
        )
        for tp in revoked:
            self._table.forget(tp)
        self._metrics.assigned.set(len(self._table.assigned))
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
        if tp in self._table.assigned and not self._stopping.is_set():
            await self._acquire(tp)

    def _acquire_slow(self, tp: TopicPartition) -> None:
        if tp in self._table.parts or tp not in self._table.assigned:
            return
        waited = round(self._s.commit_timeout_s)
        log.warning("partition_acquire_slow", topic=tp.topic, partition=tp.partition, s=waited)
        self._table.mark_stalled(tp, f"{TAKE_OVER_FAILED}: still waiting after {waited} s")

    async def _take_over(self, tp: TopicPartition) -> None:
        consumer = self._consumer
        attempt = 0
        while True:
            producer = None
            try:
                if self._s.exactly_once:
                    args = clients.transactional_producer_args(self._s, tp)
                    producer = self._producer_factory(**args)
                    await producer.start()  # InitProducerId: the fence
                # Not aiokafka's fetch_committed_offsets: it takes a group-level error
                # for "never committed", and the partition would start over (committed).
                committed = await fetch_committed(
                    aiokafka_internals.group_coordinator(consumer), tp
                )
                break
            except asyncio.CancelledError:
                if producer is not None:
                    await close_quietly(producer)
                raise
            except Exception as exc:
                if producer is not None:
                    await close_quietly(producer)
                attempt += 1
                authz = errors.engine_waits_at_cap(exc)
                delay = self._s.retry_backoff_max_s if authz else self._backoff(attempt)
                if authz or attempt >= 3:
                    self._table.mark_stalled(tp, f"{TAKE_OVER_FAILED}: {type(exc).__name__}")
                log.warning(
                    "partition_acquire_failed",
                    topic=tp.topic,
                    partition=tp.partition,
                    error=repr(exc)[:300],
                    retry_in_s=round(delay, 3),
                )
                if self._stopping.is_set() or tp not in self._table.assigned:
                    return
                await asyncio.sleep(delay)
                if tp not in self._table.assigned:
                    return
        try:
            await self._install(tp, producer, committed)
        except BaseException:
            # An error nobody foresaw (see _in_background), or a cancel: the producer
            # is closed unless a partition took it (one leaked per retry otherwise).
            part = self._table.parts.get(tp)
            if producer is not None and (part is None or part.producer is not producer):
                await asyncio.shield(close_quietly(producer))
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
        unsure = self._table.unsure.pop(tp, None)
        if unsure is not None and _landed(unsure, (start, metadata), producer):
            # That commit landed: its records start behind the new position and nobody
            # counts them unless this does.
            deferred.apply(unsure.counts)
            self.processed += len(unsure.counts)
            # A commit that succeeded after all: the failures it was counted among (and
            # a "commit failing" stall) are over, as after any successful commit.
            self._table.failures.pop(tp, None)
            self._table.clear_stall(tp)
            log.info(
                "commit_found_landed",
                topic=tp.topic,
                partition=tp.partition,
                committed=start,
                records=len(unsure.counts),
            )
        reset = self._table.reset_to.pop(tp, None)
        if reset is not None:
            # The fetch was reset below the committed offset (see _fetch_reset): start
            # there; the first commit moves the committed offset back to this log.
            start, metadata = reset, ""
        if tp not in consumer.assignment():
            if producer is not None:
                await close_quietly(producer)
            return
        old = self._table.parts.get(tp)
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
        part = Partition(tp, producer, Ledger(start, metadata))
        part.committer = asyncio.create_task(self._commit_loop(part))
        part.committer.add_done_callback(functools.partial(self._part_task_done, part, "committer"))
        self._table.parts[tp] = part
        if start is not None:
            self._table.committed[tp] = start
        if self._table.stalled.get(tp, "").startswith(TAKE_OVER_FAILED):  # failed take-overs
            self._table.clear_stall(tp)
        part.replay_until = await self._initial_lag(tp, start or 0)
        consumer.resume(tp)
        log.info(
            "partition_acquired",
            topic=tp.topic,
            partition=tp.partition,
            committed=start,
            resumed_done_above=bool(metadata),
        )


def _landed(unsure: Unsure, found: tuple[int | None, str], producer: Any) -> bool:
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
    return aiokafka_internals.producer_identity(producer) == (pid, epoch + 1)
