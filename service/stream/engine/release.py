"""Giving partitions up: the bounded last commit, dropping a partition's tasks and producer,
taking it over again after a failure or a fence.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

from aiokafka.structs import TopicPartition

from service.stream.engine.core import EngineCore, close_quietly, log
from service.stream.engine.state import TAKE_OVER_FAILED, Partition


class Release(EngineCore):
    """Giving a partition up, and taking it over again after a failure."""

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
        parts = [self._table.parts[tp] for tp in tps if tp in self._table.parts]
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
        # commit cut short closes its partition (see Transactions._commit_locked): the next owner
        # starts from whatever the broker has.
        commits = [asyncio.create_task(self._last_commit(p)) for p in parts if not p.closed]
        try:
            if commits:
                _, late = await asyncio.wait(commits, timeout=commit_s)
                if late:
                    log.warning("release_commit_cut_short", partitions=len(late))
        finally:
            # Cut short by the bound, or this release cancelled (the shutdown budget):
            # the commits end too, each closing its partition (see Transactions._commit_locked).
            for task in commits:
                task.cancel()
            if any(not task.done() for task in commits):
                await asyncio.wait(commits)
        await asyncio.gather(*(self._drop(part, close_later=close_later) for part in parts))
        log.info(
            "partitions_released",
            partitions=sorted(p.tp.partition for p in parts),
        )

    async def _last_commit(self, part: Partition) -> None:
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

    async def _drop(self, part: Partition, *, close_later: bool = False) -> None:
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
        self._discard_produced(part)
        part.wake.set()
        if self._table.parts.get(part.tp) is part:
            del self._table.parts[part.tp]
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
            closing = asyncio.ensure_future(close_quietly(part.producer))
            self._closing.add(closing)  # close() awaits it if this is cut short
            closing.add_done_callback(self._closing.discard)
            if not close_later:
                await asyncio.shield(closing)
        if current is not None and current.cancelling() > cancels:
            raise asyncio.CancelledError

    def _fenced(self, part: Partition) -> None:
        """Another member owns the partition: drop its work; re-check ownership later."""
        tp = part.tp
        self._metrics.fenced.inc()
        log.warning("partition_fenced", topic=tp.topic, partition=tp.partition)
        self._reacquire(part, delay=self._s.fence_recheck_s, reason="fenced")

    def _reacquire(self, part: Partition, *, delay: float, reason: str) -> None:
        tp = part.tp
        part.closed = True
        if self._table.parts.get(tp) is part:
            del self._table.parts[tp]
        if tp not in self._table.assigned:
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

    def _part_task_done(self, part: Partition, which: str, task: asyncio.Task[None]) -> None:
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
        n = self._table.failures[tp] = self._table.failures.get(tp, 0) + 1
        if n >= 3:
            self._table.mark_stalled(tp, f"{which} crashed: {type(error).__name__}")
        self._reacquire(part, delay=self._backoff(n), reason="crashed")

    def _in_background(
        self, tp: TopicPartition, acquiring: Coroutine[Any, Any, None], name: str
    ) -> asyncio.Task[None]:
        """Run a take-over of ``tp`` as a task a revoke of ``tp`` cancels."""
        task = self._spawn(acquiring, f"{name}-{tp.partition}")
        self._table.acquiring[tp] = task

        def done(t: asyncio.Task[None]) -> None:
            if self._table.acquiring.get(tp) is t:
                del self._table.acquiring[tp]
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
            taken = tp in self._table.parts or tp in self._table.acquiring  # by another take-over
            if tp in self._table.assigned and not taken and not self._stopping.is_set():
                n = self._table.failures[tp] = self._table.failures.get(tp, 0) + 1
                self._table.mark_stalled(tp, f"{TAKE_OVER_FAILED}: {type(exc).__name__}")
                self._in_background(tp, self._acquire_later(tp, self._backoff(n)), "retake")

        task.add_done_callback(done)
        return task
