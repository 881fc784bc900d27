"""service.tasks: concurrent reads that fail as one, and cancellation (Python 3.11)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from service.crs.ports import UnavailableError
from service.tasks import all_or_none


async def fail() -> None:
    await asyncio.sleep(0)
    raise UnavailableError("timed out", status=None)


async def test_a_failed_read_cancels_the_others_and_is_raised_as_itself() -> None:
    cancelled = asyncio.Event()

    async def hang() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    with pytest.raises(UnavailableError):
        await all_or_none([fail(), hang()])
    assert cancelled.is_set()


async def test_a_failed_read_leaves_no_cancel_request_on_the_caller() -> None:
    # A TaskGroup cancels its parent task when a child fails; on 3.11 a body that never
    # awaits leaves that request behind: the stream engine's worker then took every later
    # stray CancelledError for a cancel of its own (review).
    async def hang() -> None:
        await asyncio.Event().wait()

    async def worker() -> int:
        with pytest.raises(UnavailableError):
            await all_or_none([fail(), hang()])
        task = asyncio.current_task()
        assert task is not None
        return task.cancelling()

    assert await asyncio.create_task(worker()) == 0


async def test_a_cancel_while_the_others_are_being_cancelled_is_not_lost() -> None:
    # A revoke or a stop cancels the worker while a failed read's siblings are still
    # ending: the cancel must win, not become the read's error (a retry loop of minutes,
    # and a release waiting for the worker meanwhile).
    failed = asyncio.Event()

    async def failing() -> None:
        await asyncio.sleep(0)
        failed.set()
        raise UnavailableError("timed out", status=None)

    async def slow_to_cancel() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)  # a connection's clean-up
            raise

    task = asyncio.create_task(all_or_none([failing(), slow_to_cancel()]))
    await failed.wait()
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_results_come_in_order() -> None:
    async def value(n: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return n

    assert await all_or_none([value(1, 0.02), value(2, 0.0), value(3, 0.01)]) == [1, 2, 3]


async def test_nothing_to_read_is_no_read_and_no_error() -> None:
    # asyncio.wait refuses an empty set: a host without a cached slot (its only slot just
    # deleted, the write answered 404) made the watch cache's fresh read raise ValueError,
    # and the placement became an internal_error dead letter instead of no_slot.
    assert await all_or_none([]) == []


async def test_every_failed_read_is_retrieved_not_only_the_raised_one() -> None:
    # Under a paused replica several reads of one event time out together: the first is
    # raised, and asyncio logged the others at error level as "Task exception was never
    # retrieved" when they were collected (seen for WatchClusterState.get_reservation).
    unretrieved: list[str] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, ctx: unretrieved.append(str(ctx.get("message"))))
    try:
        with pytest.raises(UnavailableError):
            await all_or_none([fail(), fail(), fail()])
        # A failure while being cancelled (a read that ends with its own error once told
        # to stop) is consumed too.
        started = asyncio.Event()

        async def fails_when_cancelled() -> None:
            try:
                started.set()
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                raise UnavailableError("connection reset", status=None) from None

        async def fails_later() -> None:
            await started.wait()
            raise UnavailableError("timed out", status=None)

        with pytest.raises(UnavailableError, match="timed out"):
            await all_or_none([fails_when_cancelled(), fails_later()])
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert unretrieved == []
