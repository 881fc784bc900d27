"""Concurrent reads that fail as one: the first failure cancels the rest.

``asyncio.gather`` leaves the other awaitables running after one fails: API calls for
an event that has already failed (a LIST of every Reservation, say), multiplied by its
retries while the API server is throttling. A TaskGroup cancels them; its exception
group is unwrapped so callers still tell an outage from a conflict by the error's type.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any, TypeVar

__all__ = ["all_or_none", "failing_as_one"]

T = TypeVar("T")


@contextlib.asynccontextmanager
async def failing_as_one() -> AsyncIterator[asyncio.TaskGroup]:
    """A TaskGroup whose first failure is raised as itself, not as an exception group."""
    try:
        async with asyncio.TaskGroup() as group:
            yield group
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None


async def all_or_none(reads: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """The results of ``reads``, run concurrently, in order; or the first failure."""
    async with failing_as_one() as group:
        tasks = [group.create_task(r) for r in reads]
    return [t.result() for t in tasks]
