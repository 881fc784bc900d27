"""What every part of the engine shares: its settings, clients, partition table and metrics,
the back-off, background tasks, and the hooks one part calls in another.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

from service import backoff
from service.stream import aiokafka_internals
from service.stream.engine.pacing import ReplicaPace
from service.stream.engine.settings import StreamSettings
from service.stream.engine.state import Partition, PartitionTable
from service.stream.metrics import StreamMetrics
from service.stream.processor import Processor

log = structlog.get_logger(__name__)


class KafkaClientEnded(Exception):
    """One of aiokafka's consumer tasks has ended for good (see
    aiokafka_internals.ended_background_task): this consumer never fetches again, only a
    new one does. run() raises it after committing
    the work in hand; the runtime then starts afresh with new clients."""


class EngineCore:
    """The state every part of the engine works on; :class:`StreamService` combines the
    parts (one module each) over it."""

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
        # The Kafka clients' constructors (fakes in the unit tests); their arguments
        # all come from the clients module.
        self._consumer_factory = consumer_factory
        self._producer_factory = producer_factory
        self._consumer: Any = None
        self._shared_producer: Any = None  # at-least-once mode: one idempotent producer
        self._table = PartitionTable(metrics)
        self._pace = ReplicaPace(settings.commit_rate_max)
        self._stopping = asyncio.Event()
        self._capacity = asyncio.Event()  # a backpressured partition has room again
        self._background: set[asyncio.Task[Any]] = set()
        self._ends_read_at = float("-inf")
        self._reading_ends: asyncio.Task[None] | None = None
        # Producers of revoked partitions still closing (see Release._drop): awaited by close().
        self._closing: set[asyncio.Task[None]] = set()
        self.started = False
        self.last_loop = clock()
        self.processed = 0
        self.fetch_error: str | None = None  # set while fetching fails (for readiness)
        self._fetch_started: float | None = None  # while the loop awaits getmany()

    def _backoff(self, attempt: int) -> float:
        """Capped exponential: backoff, 2x, 4x, ... up to the configured maximum."""
        return backoff.exponential(attempt, self._s.retry_backoff_s, self._s.retry_backoff_max_s)

    def _discard_produced(self, part: Partition) -> None:
        """``part``'s transaction opened ahead ends aborted (by this replica, its
        producer's close or the next owner): what was produced ahead into it is not
        published."""
        if discarded := len(part.take_produced()):
            self._metrics.produced_ahead.labels("discarded").inc(discarded)

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run ``work`` as a task close() cancels."""
        task = asyncio.create_task(work, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    if TYPE_CHECKING:
        # What one part calls in another it does not derive from (each defined in
        # the module named; Committer derives from Transactions, Ownership from Release).

        def _part_task_done(  # release
            self, part: Partition, which: str, task: asyncio.Task[None]
        ) -> None: ...

        def _reacquire(self, part: Partition, *, delay: float, reason: str) -> None: ...

        def _fenced(self, part: Partition) -> None: ...

        async def _commit_loop(self, part: Partition) -> None: ...  # committer

        async def _abort_ahead_locked(self, part: Partition) -> None: ...

        async def _commit_locked(self, part: Partition) -> bool:  # transaction
            raise NotImplementedError

        async def _acquire_later(self, tp: TopicPartition, delay: float) -> None: ...  # ownership

        async def _initial_lag(self, tp: TopicPartition, committed: int) -> int | None:  # lag
            raise NotImplementedError


def brief(error: BaseException) -> str:
    """An error as readiness and the logs name it (bounded)."""
    return f"{type(error).__name__}: {str(error)[:200]}"


async def wait_set(event: asyncio.Event, timeout_s: float) -> None:
    """Wait until ``event`` is set or ``timeout_s`` have passed.

    Under asyncio.timeout, not wait_for: wait_for wraps the wait in a task of its own,
    and the committers wait so once or twice per record at a steady rate."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        pass


def being_cancelled() -> bool:
    """Whether the current task has been asked to cancel (else a CancelledError it sees
    was raised by a callee of its own accord)."""
    current = asyncio.current_task()
    return current is None or current.cancelling() > 0


async def close_quietly(producer: Any) -> None:
    """Stop a producer, bounded; whatever that raises is logged at debug only."""
    try:
        # Bounded: stopping flushes, and a broken producer may never finish flushing.
        await asyncio.wait_for(producer.stop(), 5.0)
    except Exception as exc:  # a fenced or broken producer may fail to close
        log.debug("producer_close_failed", error=repr(exc)[:200])
        # aiokafka's stop() raises before closing its connections when the sender ends
        # fenced (a new owner initialised the id meanwhile): close them here.
        await aiokafka_internals.close_producer_connections(producer)
