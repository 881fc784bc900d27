"""Outputs the broker refuses as a batch although each would fit (the real broker).

The broker judges a whole record batch against the topic's max.message.bytes, and the
producer puts every output of a transaction bound for one partition into one batch
(aiokafka does not split a refused batch). With a topic limit between one output and
two, a batch of several outputs is refused: each must then be sent alone, and only an
output refused alone becomes a stub dead letter.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from service.stream.codec import InputRef
from service.stream.engine import StreamService, StreamSettings
from service.stream.metrics import StreamMetrics
from service.stream.processor import OutRecord, Processor
from tests import e2e
from tests.conftest import DevStack

pytestmark = pytest.mark.integration

OUTPUT_BYTES = 600


class AllAtOnce:
    """Decides every record when ``n`` are in hand, so one commit carries them all."""

    def __init__(self, out: str, dlq: str, n: int) -> None:
        self.out, self.dlq_topic, self.n = out, dlq, n
        self.output_topic = out
        self.arrived = 0
        self.all_in = asyncio.Event()
        self.metrics = StreamMetrics()

    async def process(
        self, ref: InputRef, key: bytes | None, value: bytes | None, headers: Any, **_: Any
    ) -> OutRecord:
        self.arrived += 1
        if self.arrived >= self.n:
            self.all_in.set()
        await self.all_in.wait()
        assert value is not None
        return OutRecord(topic=self.out, key=key, value=value.ljust(OUTPUT_BYTES), headers=[])

    def stub(self, *args: Any, **kwargs: Any) -> OutRecord:
        real = Processor.__new__(Processor)
        real._dlq_topic, real._metrics = self.dlq_topic, self.metrics
        return Processor.stub(real, *args, **kwargs)


async def test_a_batch_refused_as_too_large_is_sent_record_by_record(
    devstack: DevStack, new_topic: Callable[..., Awaitable[str]]
) -> None:
    bootstrap = devstack.kafka_bootstrap
    source, dlq = await new_topic("batch-in"), await new_topic("batch-dlq")
    out = f"batch-out-{uuid.uuid4().hex[:10]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    n = 10
    try:
        # One 600-byte record in a batch fits 1,000 bytes; two do not.
        await admin.create_topics(
            [NewTopic(out, 1, 1, topic_configs={"max.message.bytes": "1000"})]
        )
        publisher = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
        await publisher.start()
        try:
            for i in range(n):
                await publisher.send_and_wait(source, b"v%02d" % i, key=b"k%d" % i)
        finally:
            await publisher.stop()
        settings = StreamSettings(
            input_topic=source,
            group_id=f"g-batch-{uuid.uuid4().hex[:8]}",
            client_args={"bootstrap_servers": bootstrap},
            poll_timeout_ms=100,
            retry_backoff_s=0.1,
            retry_backoff_max_s=0.5,
        )
        processor = AllAtOnce(out, dlq, n)
        service = StreamService(settings, processor, StreamMetrics())  # type: ignore[arg-type]
        await service.start()
        run = asyncio.create_task(service.run())
        try:
            # Generous: right after a test that restarts the broker, its group
            # coordinator may still be loading (GroupLoadInProgress) for a minute.
            outputs = await e2e.read_all(bootstrap, out, n, timeout_s=180)
        finally:
            service.request_stop()
            await asyncio.wait_for(run, 30)
            await service.close()
        assert sorted(r.value.strip() for r in outputs) == [b"v%02d" % i for i in range(n)]
        assert await e2e.read_all(bootstrap, dlq, 1, timeout_s=2) == []  # nothing stubbed
    finally:
        await admin.delete_topics([out])
        await admin.close()
