"""Deliveries.settle: every output of a commit awaited, refusals told apart from failures."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError, MessageSizeTooLargeError

from service.stream.engine.transaction import Deliveries, Rejected


def _deliveries(n: int) -> tuple[Deliveries, list[asyncio.Future[Any]]]:
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[Any]] = [loop.create_future() for _ in range(n)]
    deliveries = Deliveries()
    deliveries.futures.extend(enumerate(futures, start=10))
    return deliveries, futures


async def test_a_failure_is_raised_only_once_every_delivery_is_done() -> None:
    # As asyncio.gather(return_exceptions=True) did: the transaction is not aborted while
    # an output of it is still on its way.
    deliveries, futures = _deliveries(3)
    settle = asyncio.create_task(deliveries.settle())
    futures[0].set_exception(KafkaConnectionError("first"))
    futures[1].set_exception(KafkaConnectionError("second"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not settle.done()  # the third is still out
    futures[2].set_result(None)
    with pytest.raises(KafkaConnectionError, match="first"):
        await settle


async def test_refused_records_are_rejected_by_offset() -> None:
    deliveries, futures = _deliveries(3)
    futures[0].set_result(None)
    futures[1].set_exception(MessageSizeTooLargeError())
    futures[2].set_result(None)
    with pytest.raises(Rejected) as rejected:
        await deliveries.settle()
    assert rejected.value.offsets == [11]


async def test_all_delivered_settles() -> None:
    deliveries, futures = _deliveries(2)
    for future in futures:
        future.set_result(None)
    await deliveries.settle()
    assert deliveries.rejected == []


async def test_a_cut_short_settle_leaves_no_failure_unretrieved() -> None:
    # Cancelled while waiting (a revoke, a stop): the deliveries not yet awaited may fail
    # later, and must not be logged as exceptions nobody retrieved.
    loop = asyncio.get_running_loop()
    unretrieved: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: unretrieved.append(context))
    try:
        deliveries, futures = _deliveries(3)
        settle = asyncio.create_task(deliveries.settle())
        await asyncio.sleep(0)
        settle.cancel()
        with pytest.raises(asyncio.CancelledError):
            await settle
        for future in futures[1:]:
            future.set_exception(KafkaConnectionError("late"))
        await asyncio.sleep(0)
        del deliveries, futures, settle
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert unretrieved == []
