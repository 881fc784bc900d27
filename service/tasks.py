"""Concurrent reads that fail as one: the first failure cancels the rest.

``asyncio.gather`` leaves the other awaitables running after one fails: API calls for
an event that has already failed (a LIST of every Reservation, say), multiplied by its
retries while the API server is throttling. Here they are cancelled, and the failure is
raised as itself, so callers still tell an outage from a conflict by the error's type.

Not a TaskGroup: on Python 3.11 a child's failure cancels the parent task and, when the
body never awaits, leaves that cancel request on it for good (``cancelling()`` stays 1:
the stream engine's worker then takes every later stray CancelledError for a cancel of
its own); and a cancel of the caller arriving while the failed group still ends its
children loses to the child's error. ``asyncio.wait`` touches neither.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

__all__ = ["all_or_none", "wait_all_or_none"]

T = TypeVar("T")


async def wait_all_or_none(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Wait for every task; on the first failure cancel the others and raise it. Cancelled
    meanwhile, the tasks are cancelled too (and waited for) before the cancel goes on."""
    if not tasks:  # asyncio.wait refuses an empty set (a host without a cached slot)
        return
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:
        await _cancelled(tasks)
        raise
    for task in tasks:
        if task.done() and not task.cancelled() and (error := task.exception()) is not None:
            await _cancelled(tasks)  # a cancel of the caller here goes on from the await
            raise error


async def all_or_none(reads: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """The results of ``reads``, run concurrently, in order; or the first failure."""
    tasks = [asyncio.ensure_future(r) for r in reads]
    await wait_all_or_none(tasks)
    return [t.result() for t in tasks]


async def _cancelled(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Cancel what still runs, wait for it, and retrieve every failure but the one raised.

    The others are deliberately consumed: several reads of one event fail together (a
    paused or frozen API server times them all out), and one not retrieved is logged by
    asyncio at error level as "Task exception was never retrieved" when it is collected.
    Finally too, so a cancel of the caller during the wait does not skip it."""
    pending = [t for t in tasks if not t.done()]
    for task in pending:
        task.cancel()
    try:
        if pending:
            await asyncio.wait(pending)
    finally:
        for task in tasks:
            if task.done() and not task.cancelled():
                task.exception()
