"""Key lanes and deciding: records of one key in offset order, of different keys
concurrently (Confluent's Parallel Consumer), run by a small pool of workers per partition.
"""

from __future__ import annotations

import asyncio
import functools

from aiokafka.structs import ConsumerRecord

from service.crs.ports import API_REQUEST_HOOK
from service.stream import deferred, unreadable
from service.stream.codec import INTERNAL_ERROR, OUTPUT_REJECTED, InputRef, PoisonCode, decode_input
from service.stream.engine.core import EngineCore, being_cancelled, log, wait_set
from service.stream.engine.state import Done, Partition
from service.stream.processor import EXPECTED_OUTPUT, OutRecord, RetryLater, stub_dead_letter

# A lane worker with nothing to do for this long ends (a burst leaves no idle tasks).
_WORKER_IDLE_S = 5.0
_WORKER_YIELD_EVERY = 64


class KeyLanes(EngineCore):
    """Records into key lanes, lanes to workers, records to the processor."""

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

    def _staff(self, part: Partition) -> None:
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

    async def _worker(self, part: Partition) -> None:
        ran = 0
        # The partition hears when a decision sends a request to the API server (see
        # Committer._commit_loop); the worker's task is its decisions' context.
        API_REQUEST_HOOK.set(part.awaiting_api)
        if part.producer is not None and self._s.txn_open_ahead_ms and self._s.txn_produce_ahead_ms:
            EXPECTED_OUTPUT.set(part.expect)  # and of the outputs they expect
        try:
            while not part.draining and not part.closed:
                if not part.ready:
                    part.has_ready.clear()
                    # A worker goes idle after almost every record at a steady rate:
                    # wait_set, not wait_for (a task per wait, 3 % of the service's CPU
                    # at 200 events/s).
                    await wait_set(part.has_ready, _WORKER_IDLE_S)
                    if not part.has_ready.is_set() and not part.ready:
                        return  # idle for _WORKER_IDLE_S
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

    async def _run_lane(self, part: Partition, key: bytes) -> None:
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

    async def _decide(self, part: Partition, record: ConsumerRecord) -> Done:
        tp = part.tp
        ref = InputRef(topic=tp.topic, partition=tp.partition, offset=record.offset)
        if isinstance(record, unreadable.UnreadableRecord):
            with deferred.capture() as counts:
                stub = self._processor.stub(ref, None, None, PoisonCode.UNREADABLE, record.reason)
            return Done(stub, counts)
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
                    if isinstance(exc, asyncio.CancelledError) and being_cancelled():
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
                if record.offset in self._table.oversized.get(tp, ()):
                    with deferred.capture() as stub_counts:  # counted at commit, too
                        out = self._stub(out, ref, record)
                    counts.extend(stub_counts)
                return Done(out, counts)
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
