"""The engine's facade: start, run (the fetch loop), close."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from aiokafka.errors import ConsumerStoppedError
from aiokafka.structs import ConsumerRecord, TopicPartition

from service.stream import aiokafka_internals, errors, unreadable
from service.stream.engine import clients
from service.stream.engine.committer import Committer
from service.stream.engine.core import (
    KafkaClientEnded,
    brief,
    log,
)
from service.stream.engine.lag import Lag
from service.stream.engine.lanes import KeyLanes
from service.stream.engine.ownership import Listener, Ownership
from service.stream.engine.state import Partition, PartitionView


class StreamService(KeyLanes, Committer, Ownership, Lag):
    """Runs the engine until :meth:`request_stop`; then commits, leaves the group, returns."""

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        s = self._s
        # A record aiokafka cannot parse must not raise out of getmany() (see the module).
        unreadable.install()
        self._consumer = self._consumer_factory(**clients.consumer_args(s))
        if not s.exactly_once:
            self._shared_producer = self._producer_factory(**clients.shared_producer_args(s))
            await self._shared_producer.start()
        try:
            await self._consumer.start()
        except BaseException:
            if self._shared_producer is not None:
                await self._shared_producer.stop()
            raise
        self._consumer.subscribe([s.input_topic], listener=Listener(self))
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
            await self._release(list(self._table.parts), wait_s=0.0)
        finally:
            for task in list(self._background):
                task.cancel()
            left = [self._drop(part) for part in list(self._table.parts.values())]
            with contextlib.suppress(Exception):  # their producers (the commit cut short)
                await asyncio.wait_for(asyncio.gather(*left), 5.0)
            if self._consumer is not None:
                try:  # LeaveGroup: partitions move at once
                    await asyncio.wait_for(self._consumer.stop(), 5.0)
                except Exception:
                    # aiokafka's stop() re-raises the error of a task that ended with one
                    # (the fetch task: see aiokafka_internals.ended_background_task)
                    # before it closes its connections: one set per restart otherwise.
                    await aiokafka_internals.close_client_after_failed_stop(self._consumer)
            if self._closing:
                # Producers of revoked partitions still closing (see Release._drop), including any
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
        # records are taken in batches of a linger's worth. The linger is a latency every
        # record pays at moderate rates, though: at 100 events/s 20 ms (with a 100 ms
        # commit interval) made the service's p50 45 ms against 8 ms for an exactly-once
        # loop that writes first (bench_latency.py); 5 ms (with 30 ms) gave 11 ms.
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
            open_tps = [tp for tp, part in self._table.parts.items() if not part.backpressured]
            max_records = self._s.max_batch
            if not open_tps and self._table.parts:
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
                open_tps, max_records = list(self._table.parts)[:1], 1
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
                    if errors.engine_waits_at_cap(exc)
                    else (self._backoff(failures))
                )
                self.fetch_error = brief(exc)
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
                part = self._table.parts.get(tp)
                if part is None or part.draining or part.closed:
                    # Not (yet) ours to process: acquiring seeks back to the committed
                    # offset before it takes records, so nothing fetched here is lost.
                    continue
                self._feed(part, records)
            self._update_lag()
        # Stop: finish the records in hand (bounded) and commit them.
        log.info("stopping_releasing_partitions", partitions=len(self._table.parts))
        await self._release(list(self._table.parts), wait_s=self._s.stop_wait_s)
        if ended is not None:
            raise KafkaClientEnded(self.fetch_error) from ended

    def _client_ended(self, consumer: Any, *, fetch_raised: bool) -> BaseException | None:
        """The error that ended one of the consumer's background tasks for good (see
        aiokafka_internals.ended_background_task), said once; else None."""
        found = aiokafka_internals.ended_background_task(consumer, fetch_raised=fetch_raised)
        if found is None:
            return None
        task, error = found
        # Stopping: no take-over or fence re-check starts while the work in hand is
        # committed (the group will never revoke what this member still thinks it owns).
        self._stopping.set()
        self.fetch_error = brief(error)
        log.error(
            "kafka_client_ended",
            task=task,
            error=self.fetch_error,
            hint="committing the work in hand, then restarting with new clients",
        )
        return error

    def _feed(self, part: Partition, records: list[ConsumerRecord]) -> None:
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

    def _fetch_reset(self, part: Partition, offset: int, expected: int) -> None:
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
        self._table.reset_to[tp] = offset
        self._reacquire(part, delay=0.0, reason="offset-reset")

    def _rewind(self, consumer: Any) -> None:
        """Seek every partition being processed back to the offset after the last record
        it received, where aiokafka's fetch position has moved past it."""
        for tp, part in self._table.parts.items():
            if part.draining or part.closed:
                continue
            expected = part.ledger.next_expected
            if expected is None:  # no commit and nothing received: the take-over sought 0
                expected = 0
            position = aiokafka_internals.fetch_position(consumer, tp)
            if position is not None and position > expected:
                log.warning(
                    "fetch_rewound",
                    topic=tp.topic,
                    partition=tp.partition,
                    position=position,
                    offset=expected,
                )
                consumer.seek(tp, expected)

    @property
    def assignment(self) -> set[TopicPartition]:
        return set(self._table.assigned)

    def fetching_for(self) -> float:
        """How long the loop has been waiting in getmany() (0: not in it). Beyond the
        poll timeout it is aiokafka waiting for a rebalance's new assignment."""
        started = self._fetch_started
        return 0.0 if started is None else max(0.0, self._clock() - started)

    def stalled(self) -> dict[TopicPartition, str]:
        """Assigned partitions that cannot make progress, with the reason (for readiness)."""
        return dict(self._table.stalled)

    @property
    def partitions(self) -> PartitionView:
        """What the engine holds per partition, read-only (for tests and tools)."""
        return self._table.view()

    @property
    def _parts(self) -> Mapping[TopicPartition, Partition]:
        # The owned partitions, read-only, under the name the integration tests
        # (test_engine_stalls.py, test_txn_open_ahead.py) read them by.
        return self._table.view().owned
