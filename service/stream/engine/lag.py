"""The lag and stuck-transaction gauges: end offsets against committed positions."""

from __future__ import annotations

import asyncio
import time

from aiokafka.structs import TopicPartition

from service.stream import aiokafka_internals
from service.stream.engine.core import EngineCore

# A fetch answer older than this: the partition is not being fetched (see _update_unstable).
_FRESH_FETCH_MS = 10_000


class Lag(EngineCore):
    """The lag gauge, and how long a partition's last stable offset has been stuck."""

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
            if self._table.unstable.pop(tp, None) is not None:
                gauge.labels(tp.topic, str(tp.partition)).set(0)
            return
        now = self._clock()
        held = self._table.unstable.get(tp)
        if held is None or held[0] != stable:
            self._table.unstable[tp] = held = (stable, now)
        gauge.labels(tp.topic, str(tp.partition)).set(now - held[1])

    def _update_lag(self) -> None:
        # read_committed: the last stable offset is what this consumer can reach.
        self._read_unfetched_ends()
        for tp in list(self._table.assigned):
            self._update_unstable(tp)
            position = self._table.committed.get(tp)
            end = self._consumer.last_stable_offset(tp)
            read = self._table.ends.get(tp)
            if read is not None and (end is None or read > end):
                end = read
            if end is None:
                continue
            if position is None:
                position = 0
            part = self._table.parts.get(tp)
            if part is not None and not part.draining and not part.ledger.in_flight:
                # Everything handed out is committed: what lies between the committed
                # offset and the fetch position was never handed out, i.e. transaction
                # markers and aborted records of a transactional producer's input (one
                # marker per transaction: the lag would stay 1 for good).
                fetched = aiokafka_internals.fetch_position(self._consumer, tp)
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
        tps = [tp for tp, part in self._table.parts.items() if part.backpressured]
        if not tps:
            return
        self._ends_read_at = now

        async def read() -> None:
            try:
                ends = await asyncio.wait_for(self._consumer.end_offsets(tps), 5.0)
            except Exception:  # the next refresh tries again
                return
            for tp, end in ends.items():
                if tp in self._table.assigned:
                    self._table.ends[tp] = end

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
