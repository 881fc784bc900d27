"""Transactions opened ahead (CRS_TXN_OPEN_AHEAD_MS) on the real broker.

The engine begins a quiet partition's transaction and sends its offset while the records
wait on the Kubernetes API, and sends the offset again if it moved meanwhile; it relies
on the broker keeping the *last* offset a transaction sent, and on an aborted
transaction committing none. Both are checked here against Kafka itself, then the engine
with records that wait (as a PATCH does), opened ahead after CRS_TXN_OPEN_AHEAD_MS or on
their request to the API server, end to end: every output exactly once, the
offsets committed, the transactions it opened ahead were the ones that committed, and
the output partitions had been added to them before the records were decided.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from service.crs.ports import API_REQUEST_HOOK
from service.stream.codec import InputRef
from service.stream.engine import StreamService, StreamSettings
from service.stream.metrics import StreamMetrics
from service.stream.partitioner import partition_for_key
from service.stream.processor import OutRecord
from tests import e2e
from tests.conftest import DevStack

pytestmark = pytest.mark.integration


async def test_the_broker_keeps_the_last_offset_of_a_transaction_and_none_of_an_abort(
    devstack: DevStack, new_topic: Callable[..., Awaitable[str]]
) -> None:
    bootstrap = devstack.kafka_bootstrap
    source, out = await new_topic("ahead-in"), await new_topic("ahead-out")
    tp, group = TopicPartition(source, 0), f"g-ahead-{uuid.uuid4().hex[:8]}"
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, transactional_id=f"tx-{group}", retry_backoff_ms=10
    )
    await producer.start()
    try:
        # Opened ahead with offset 5; the commit found the watermark at 3 after all.
        await producer.begin_transaction()
        await producer.send_offsets_to_transaction({tp: OffsetAndMetadata(5, "")}, group)
        await (await producer.send(out, b"one"))
        await producer.send_offsets_to_transaction({tp: OffsetAndMetadata(3, "crs1:2:")}, group)
        await producer.commit_transaction()
        assert await e2e.committed(bootstrap, group, tp) == OffsetAndMetadata(3, "crs1:2:")
        # Opened ahead, nothing decided: aborted, nothing of it committed.
        await producer.begin_transaction()
        await producer.send_offsets_to_transaction({tp: OffsetAndMetadata(9, "")}, group)
        await producer.abort_transaction()
        assert await e2e.committed(bootstrap, group, tp) == OffsetAndMetadata(3, "crs1:2:")
    finally:
        await producer.stop()
    assert [r.value for r in await e2e.read_all(bootstrap, out, 1)] == [b"one"]


class WaitingProcessor:
    """Decides every record after ``wait_s`` (a PATCH's round trip, say), noting whether
    its output partition was in its input partition's open transaction by then."""

    dlq_topic = "unused-dlq"

    def __init__(self, out: str, wait_s: float, *, requests_api: bool = False) -> None:
        self.out, self.wait_s = out, wait_s
        self.requests_api = requests_api
        self.output_topic = out
        self.service: StreamService | None = None
        self.added_before_decided: list[bool] = []

    async def process(
        self, ref: InputRef, key: bytes | None, value: bytes | None, headers: Any, **_: Any
    ) -> OutRecord:
        if self.requests_api:
            hook = API_REQUEST_HOOK.get()
            assert hook is not None
            hook()  # what the Kubernetes client does before each request
        await asyncio.sleep(self.wait_s)
        assert self.service is not None
        assert key is not None
        part = self.service._parts[TopicPartition(ref.topic, ref.partition)]
        txn = part.producer._txn_manager
        out = TopicPartition(self.out, partition_for_key(key, [0, 1], [0, 1]))
        # Added = asked for before this decision. aiokafka holds a partition asked for
        # as pending until the broker confirms it (AddPartitionsToTxn), then moves it to
        # txn_partitions: a pending one gets up to a second for a slow answer (a fixed
        # wait failed under load). Without the opening ahead nothing asks for it before
        # this record is decided.
        for _ in range(200):
            if out not in txn._pending_txn_partitions:
                break
            await asyncio.sleep(0.005)
        self.added_before_decided.append(out in txn.txn_partitions)
        return OutRecord(topic=self.out, key=key, value=value, headers=[])

    def stub(self, *args: Any, **kwargs: Any) -> OutRecord:
        raise AssertionError("no record here becomes a stub")


@pytest.mark.parametrize(
    ("requests_api", "open_ahead_ms"),
    [(False, 2), (True, 60_000)],
    ids=["after-txn-open-ahead-ms", "on-the-api-request"],
)
async def test_records_that_wait_are_committed_in_transactions_opened_ahead(
    devstack: DevStack,
    new_topic: Callable[..., Awaitable[str]],
    requests_api: bool,
    open_ahead_ms: int,
) -> None:
    # Opened ahead once the records have waited txn_open_ahead_ms, or at once when their
    # decisions say they sent a request to the API server (then the 60 s guess never
    # runs out within the test).
    bootstrap = devstack.kafka_bootstrap
    source, out = await new_topic("ahead-in", 2), await new_topic("ahead-out", 2)
    group = f"g-ahead-{uuid.uuid4().hex[:8]}"
    metrics = StreamMetrics()
    settings = StreamSettings(
        input_topic=source,
        group_id=group,
        client_args={"bootstrap_servers": bootstrap},
        poll_timeout_ms=100,
        txn_open_ahead_ms=open_ahead_ms,
    )
    processor = WaitingProcessor(out, 0.03, requests_api=requests_api)
    service = StreamService(settings, processor, metrics)  # type: ignore[arg-type]
    processor.service = service
    await service.start()
    run = asyncio.create_task(service.run())
    publisher = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await publisher.start()
    # Published only once both partitions are taken over: on a broker that has just
    # started, joining the group and initialising the producers took longer than the
    # 2 s of publishing, and the records then arrived as one batch, not one at a time
    # (2 of 40 opened ahead when this file ran first).
    await _owned(service, {TopicPartition(source, p) for p in (0, 1)}, run)
    sent = [b"v%03d" % i for i in range(40)]
    try:
        for i, value in enumerate(sent):  # a quiet stream: one record at a time
            await publisher.send_and_wait(source, value, key=b"k%d" % i, partition=i % 2)
            await asyncio.sleep(0.05)
        outputs = await e2e.read_all(bootstrap, out, len(sent), partitions=2)
        assert sorted(r.value for r in outputs) == sent
    finally:
        await publisher.stop()
        service.request_stop()
        await asyncio.wait_for(run, 30)
        await service.close()
    for p in (0, 1):
        found = await e2e.committed(bootstrap, group, TopicPartition(source, p))
        assert found is not None
        assert found.offset == 20  # each partition's 20 records (offsets 0-19) committed
    ahead = metrics.opened_ahead
    assert ahead.labels("committed")._value.get() >= len(sent) * 0.8  # the usual path
    assert ahead.labels("aborted")._value.get() == 0
    # And the output partitions were added to those transactions before the decision
    # (the first record of each partition: the producer knew no metadata of `out` yet).
    assert sum(processor.added_before_decided) >= len(sent) * 0.8


async def _owned(service: StreamService, tps: set[TopicPartition], run: asyncio.Task[None]) -> None:
    async with asyncio.timeout(60):
        while not tps <= service.partitions.owned.keys():
            assert not run.done(), "the engine ended before it owned its partitions"
            await asyncio.sleep(0.05)
