"""When a partition commits: the token bucket that paces its transactions, and the
transaction opened ahead while its records wait on the Kubernetes API.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable

from aiokafka.structs import OffsetAndMetadata

from service.stream import aiokafka_internals, errors
from service.stream.engine import transaction
from service.stream.engine.core import wait_set
from service.stream.engine.state import Partition
from service.stream.engine.transaction import Transactions


class TokenBucket:
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


class Committer(Transactions):
    """Each owned partition's committer task: when to commit (see :meth:`_commit_loop`)."""

    async def _commit_loop(self, part: Partition) -> None:
        # Commits are paced by a token bucket: one token per commit_interval_ms, at most
        # commit_burst saved. A transaction costs the broker and this process about the
        # same whether it carries 1 record or 500 (measured: ~1.5-2.5 ms of client CPU
        # each), so under load (records still in progress when others are decided) a
        # partition commits once per interval with whatever was decided meanwhile; a
        # partition with nothing else in progress commits at once, token or not, as does
        # one with commit_max_records waiting outputs.
        #
        # Opening ahead. A transaction is a chain of requests (add the output partition,
        # produce, add the group, commit the offset, end): 7.5-11 ms at p50 on the dev
        # stack, which a placement's output used to wait for *after* its ~5-10 ms PATCH.
        # When a quiet partition's records are still undecided txn_open_ahead_ms after
        # they arrived (a no-host-found event is decided in well under a millisecond, so
        # those are waiting on the Kubernetes API), or at once when a decision has sent a
        # request to the API server (Partition.awaiting_api), the committer begins the
        # transaction and sends the offset the partition will have once they are done,
        # while they wait, and adds the output partitions their keys go to
        # (aiokafka_internals.add_partitions_to_txn).
        # When they are decided only the outputs and the end remain (decision to commit,
        # bench/bench_txn.py --ahead: p50 11.0 -> 8.4 ms, p90 20.9 -> 12.8 on a busy
        # machine; on a quiet one 4.24 / 3.01 / 2.49 ms at p50 the usual way / opened
        # ahead / with the partitions added ahead). If the offset changed meanwhile (more
        # records arrived), it is sent again (the broker keeps the last one of a
        # transaction). Nothing decided within txn_open_ahead_max_s: the transaction is
        # aborted, which loses nothing.
        #
        # Producing ahead. A placement's decision tells the classification it will have
        # if its write succeeds before it sends the PATCH (processor.EXPECTED_OUTPUT);
        # that is produced into the transaction opened ahead, so after the answer only
        # the end remains (see _produce_expected). Only that holds back readers of the
        # output topic (read_committed readers wait at an open transaction's first
        # record), hence its own, short bound: txn_produce_ahead_ms.
        bucket = TokenBucket(
            self._s.commit_interval_ms / 1000, float(max(self._s.commit_burst, 1)), self._clock()
        )
        ahead_after = self._s.txn_open_ahead_ms / 1000
        booked = False  # a slot of the replica's pace reserved and not yet used
        while not part.closed:
            if part.ahead is None:
                await part.wake.wait()
            else:
                until = min(part.ahead_until, part.produced_until)
                await wait_set(part.wake, max(until - self._clock(), 0.0))
            part.wake.clear()
            if part.closed:
                break
            now = self._clock()
            tokens = bucket.level(now)
            if not part.ledger.done_uncommitted:
                if part.ahead is not None:
                    if now >= part.ahead_until or now >= part.produced_until:
                        await self._abort_ahead(part)
                    elif part.expected:
                        await self._produce_ahead(part)
                elif ahead_after > 0 and tokens >= 1 and part.ledger.pending:
                    # Records arrived and none is decided: give them ahead_after (a
                    # decision sets wake, and is then committed the usual way), unless
                    # one has already sent a request to the API server (its decision
                    # waits on it: Partition.awaiting_api). Then at once: with a timer
                    # alone, a placement's transaction began 2 ms into its ~6 ms PATCH
                    # and its 4.4-5.6 ms of requests were not done when the decision was
                    # (bench/stage_trace at 20/s: 1.6-1.8 ms from decision to commit at
                    # p50, 0.1-0.2 ms with this).
                    if not part.awaits_api:
                        await wait_set(part.wake, ahead_after)
                    if part.ledger.pending and not part.ledger.done_uncommitted:
                        bucket.take()  # the transaction's token, spent when it begins
                        if not booked:
                            await self._wait_for_slot()
                            booked = True
                        if part.ledger.done_uncommitted or part.closed:
                            continue  # decided meanwhile: committed the usual way
                        await self._open_ahead(part)
                        booked = part.ahead is None  # the slot is still unused
                continue
            if part.ahead is None:
                while not part.closed:
                    if tokens >= 1 or part.ledger.done_uncommitted >= self._s.commit_max_records:
                        break
                    # Nothing else in progress: waiting for a token would batch nothing
                    # (records arriving later pay for their own commit either way) and only
                    # delay these outputs. At 20 events/s on 4 partitions, Poisson bursts
                    # emptied the bucket often enough that 40-95 ms waits for a token made
                    # the service's p99 twice the write-first bound's (bench_latency.py).
                    if not part.ledger.pending:
                        break
                    await wait_set(part.wake, bucket.until_next())
                    part.wake.clear()
                    tokens = bucket.level(self._clock())
                bucket.take()
                if not booked:
                    await self._wait_for_slot()
            booked = False
            if not part.closed:
                await self._commit(part)

    async def _wait_for_slot(self) -> None:
        """Book the next transaction's slot in the replica's pace (CRS_COMMIT_RATE_MAX)
        and wait for it: what is decided meanwhile is committed with it."""
        delay = self._pace.reserve(self._clock())
        if delay > 0:
            await asyncio.sleep(delay)

    async def _open_ahead(self, part: Partition) -> None:
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
                part.awaits_api = False
                part.ahead, part.ahead_until = offset, self._clock() + self._s.txn_open_ahead_max_s
                # Not right after the previous transaction: the broker answers the first
                # request CONCURRENT_TRANSACTIONS meanwhile, and aiokafka retries a
                # partition's after a fixed 20 ms, the group's sooner (see
                # Transactions._send). Added after the offsets instead, a partition's
                # failure (an output ACL) would surface only at the next send, as a
                # misleading IllegalOperation.
                after_markers = self._clock() - part.txn_ended >= transaction.MARKERS_WINDOW_S
                if after_markers:
                    aiokafka_internals.add_partitions_to_txn(
                        producer, self._processor.output_topic, keys
                    )
                    await self._produce_expected(part)
                await producer.send_offsets_to_transaction(offsets, self._s.group_id)
                if not after_markers:  # an output first would wait the fixed 20 ms too
                    await self._produce_expected(part)

            await self._outside_commit(part, begin())

    async def _produce_ahead(self, part: Partition) -> None:
        async with part.commit_lock:
            if not part.closed and part.ahead is not None and not part.ledger.done_uncommitted:
                await self._outside_commit(part, self._produce_expected(part))

    async def _produce_expected(self, part: Partition) -> None:
        """Produce the classifications ``part``'s decisions expect into its transaction
        opened ahead, while their writes are in flight.

        The commit then finds each decided record's output already sent (the same object)
        and only ends the transaction: the Produce round trip (about 1.3 ms at p50 on the
        dev stack) no longer follows the PATCH, as in the write-first bound. A decision
        that ends otherwise, or a record decided that was not told ahead, makes the commit
        abort this transaction and begin afresh (Transactions._send): nothing told ahead
        is published unless its record's decision returned it. Not decided within
        txn_produce_ahead_ms, the transaction is aborted: read_committed readers of the
        output partitions wait behind an open transaction's first record, so outputs
        produced ahead for a hung write would hold them back up to txn_open_ahead_max_s.
        """
        ledger = part.ledger
        # Told again (a retried decision): the first is in the transaction, so the
        # decision can no longer return what it holds; the commit aborts it.
        expected = {
            offset: out
            for offset, out in part.expected.items()
            if ledger.is_pending(offset) and offset not in part.produced
        }
        part.expected = {}
        if ledger.pending > len(expected) + len(part.produced):
            # Other records are undecided too: one of them would likely be decided first
            # and the transaction aborted (an abort and a Produce more, for nothing).
            # bench/stage_trace, 30 s at 200 events/s with half placements: producing
            # ahead regardless discarded 653 of 919; only on a partition with nothing
            # else undecided, 131 of 423. At 20 events/s: 330 of 330 published either way.
            return
        tp, producer = part.tp, part.producer
        sent_alone = self._table.alone.get(tp, set())
        stubbed = self._table.oversized.get(tp, set())
        for offset, out in expected.items():
            if offset in sent_alone or offset in stubbed:  # sent or replaced otherwise
                continue
            try:
                future = await producer.send(out.topic, out.value, key=out.key, headers=out.headers)
            except errors.REFUSED_RECORD:  # refused before it left: the commit sends it
                continue
            future.add_done_callback(transaction.retrieve)  # in case no commit awaits it
            if not part.produced:
                part.produced_until = self._clock() + self._s.txn_produce_ahead_ms / 1000
            part.produced[offset] = (out, future)

    async def _abort_ahead(self, part: Partition) -> None:
        async with part.commit_lock:
            if not part.closed and part.ahead is not None and not part.ledger.done_uncommitted:
                await self._abort_ahead_locked(part)

    async def _abort_ahead_locked(self, part: Partition) -> None:
        part.ahead = None
        self._discard_produced(part)
        self._metrics.opened_ahead.labels("aborted").inc()
        await self._outside_commit(part, part.producer.abort_transaction())
        part.txn_ended = self._clock()

    async def _outside_commit(self, part: Partition, request: Awaitable[None]) -> None:
        """A transaction request made outside a commit, bounded and failing like one."""
        try:
            async with asyncio.timeout(self._s.commit_timeout_s):
                await request
        except Exception as exc:
            self._commit_failed(part, exc)


# At most this many waiting records' output partitions are added ahead (a quiet partition
# has a few; the topic's partitions bound the set anyway).
_AHEAD_KEYS_MAX = 64


def _waiting_keys(part: Partition) -> list[bytes]:
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
