"""Per-partition state: one owned partition, and the table of everything the engine keeps
per partition, with the one place that forgets a partition (:meth:`PartitionTable.forget`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from aiokafka.structs import ConsumerRecord, TopicPartition

from service.stream import deferred
from service.stream.ledger import CommitPlan, Ledger
from service.stream.metrics import StreamMetrics
from service.stream.processor import OutRecord


@dataclass(slots=True)
class Done:
    """A decided record: what its commit publishes and what it counts."""

    out: OutRecord
    counts: deferred.Increments


@dataclass(frozen=True, slots=True)
class Unsure:
    """A commit whose outcome is unknown, as much as a take-over needs to count it if it
    landed (see ownership._landed): not its outputs, which an entry kept for a partition that moved
    away would hold for the life of the process."""

    offset: int
    metadata: str
    counts: tuple[deferred.Increments, ...]
    sender: tuple[int, int]  # the producer's (id, epoch)

    @classmethod
    def of(cls, plan: CommitPlan[Done], sender: tuple[int, int]) -> Unsure:
        counts = tuple(done.counts for _, done in plan.items)
        return cls(plan.offset, plan.metadata, counts, sender)


class Partition:
    """One owned input partition: its producer, ledger, key lanes and committer."""

    def __init__(self, tp: TopicPartition, producer: Any, ledger: Ledger[Done]) -> None:
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
        # A transaction opened ahead (see Committer._commit_loop): the offset it has sent, and
        # when it is aborted if nothing has been decided by then.
        self.ahead: int | None = None
        self.ahead_until = 0.0
        # Classifications its decisions were told ahead while their writes are in flight
        # (processor.EXPECTED_OUTPUT), by input offset, until the committer produces them
        # into the transaction opened ahead (produced: with their deliveries, discarded
        # unless committed by produced_until; see Committer._produce_expected).
        self.expected: dict[int, OutRecord] = {}
        self.produced: dict[int, tuple[OutRecord, Any]] = {}
        self.produced_until = float("inf")
        # A decision of one of its records has sent a request to the API server since the
        # committer last began a transaction: open ahead now, not after txn_open_ahead_ms.
        self.awaits_api = False
        # When its producer's last transaction ended (committed or aborted): see Transactions._send.
        self.txn_ended = float("-inf")
        # The partition's end offset when it was taken over: the records below it may
        # have been processed by its previous owner (see KeyLanes._decide). None until known.
        self.replay_until: int | None = None

    def take_produced(self) -> dict[int, tuple[OutRecord, Any]]:
        """The outputs produced ahead into its transaction opened ahead, taken: that
        transaction is ending (each delivery already has transaction.retrieve). What
        undecided records were told and not produced yet stays for the next one."""
        produced = self.produced
        self.produced, self.produced_until = {}, float("inf")
        return produced

    def expect(self, offset: int, out: OutRecord) -> None:
        """The EXPECTED_OUTPUT of its records' decisions (set by its lane workers)."""
        self.expected[offset] = out
        self.wake.set()

    def awaiting_api(self) -> None:
        """The API_REQUEST_HOOK of its records' decisions (set by its lane workers)."""
        if not self.awaits_api:
            self.awaits_api = True
            self.wake.set()


# How a partition that could not be taken over is reported stalled (cleared by the take-over
# that succeeds; a stall of its commits is cleared only by a commit).
TAKE_OVER_FAILED = "cannot take partition over"


class PartitionTable:
    """Everything the engine keeps per input partition, beside the owned :class:`Partition`.

    Most of it goes when the partition is revoked, in :meth:`forget`; what outlives a
    revoke says so where it is declared.
    """

    def __init__(self, metrics: StreamMetrics) -> None:
        self._metrics = metrics
        self.parts: dict[TopicPartition, Partition] = {}  # owned, taken over
        self.acquiring: dict[TopicPartition, asyncio.Task[None]] = {}  # being taken over
        self.assigned: set[TopicPartition] = set()  # what the group gives this member
        self.committed: dict[TopicPartition, int] = {}
        self.stalled: dict[TopicPartition, str] = {}
        self.failures: dict[TopicPartition, int] = {}
        # Offsets whose output the broker refused as too large: replaced by a stub dead
        # letter from then on, across re-acquisitions (reprocessing would refuse again).
        self.oversized: dict[TopicPartition, set[int]] = {}
        # Offsets whose outputs the broker refused in a batch of several: sent alone next.
        self.alone: dict[TopicPartition, set[int]] = {}
        # The last commit of a partition that failed without a known outcome (a timeout,
        # or cut short by a revoke: aiokafka shields EndTxn, so it may land after all),
        # with the (producer id, epoch) that sent it. Nobody processes those records again
        # if it landed, so its counts are applied when this replica's next take-over of
        # the partition proves it did (see Ownership._install and landed); kept across
        # revokes (not forgotten), as an eager rebalance often gives the same partition
        # back.
        self.unsure: dict[TopicPartition, Unsure] = {}
        # Where aiokafka reset a partition's fetch to below what its ledger had received
        # (see StreamService._fetch_reset): the re-acquisition starts there, not at the
        # committed offset.
        self.reset_to: dict[TopicPartition, int] = {}
        # Per partition whose last stable offset lies behind its high watermark: that
        # offset and since when it has not moved (see Lag._update_unstable).
        self.unstable: dict[TopicPartition, tuple[int, float]] = {}
        # Last stable offsets read with ListOffsets for partitions not being fetched.
        self.ends: dict[TopicPartition, int] = {}

    def disown(self, tps: list[TopicPartition]) -> None:
        """Not ours any more (a revoke, before its last commits): a failure while
        committing must not take them over again, and no take-over of them goes on."""
        self.assigned -= set(tps)
        for tp in tps:
            task = self.acquiring.pop(tp, None)
            if task is not None:
                task.cancel()

    def forget(self, tp: TopicPartition) -> None:
        """The one place a revoked partition is forgotten (after its release), its metric
        series with it; only :attr:`unsure` stays (see there). The next owner finds a
        fetch reset itself."""
        for table in (
            self.reset_to,
            self.unstable,
            self.committed,
            self.stalled,
            self.failures,
            self.oversized,
            self.alone,
            self.ends,
        ):
            table.pop(tp, None)
        self._metrics.forget_partition(tp.topic, tp.partition)

    def mark_stalled(self, tp: TopicPartition, why: str) -> None:
        self.stalled[tp] = why
        self._metrics.stalled.labels(tp.topic, str(tp.partition)).set(1)

    def clear_stall(self, tp: TopicPartition) -> None:
        if self.stalled.pop(tp, None) is not None:
            self._metrics.stalled.labels(tp.topic, str(tp.partition)).set(0)

    def view(self) -> PartitionView:
        """A read-only view (for readiness, tests and tools)."""
        return PartitionView(self)


class PartitionView:
    """What the engine holds per partition, read-only."""

    __slots__ = ("_table",)

    def __init__(self, table: PartitionTable) -> None:
        self._table = table

    @property
    def owned(self) -> Mapping[TopicPartition, Partition]:
        return MappingProxyType(self._table.parts)

    @property
    def assigned(self) -> frozenset[TopicPartition]:
        return frozenset(self._table.assigned)

    @property
    def stalled(self) -> Mapping[TopicPartition, str]:
        return MappingProxyType(self._table.stalled)

    @property
    def unsure(self) -> Mapping[TopicPartition, Unsure]:
        return MappingProxyType(self._table.unsure)
