"""The engine on the real broker while records are stuck (a Kubernetes API that hangs).

* Stuck records hold the committed offset while the records behind them are committed
  and listed as done in the offset's metadata. When too many are stuck for the metadata
  (the broker's limit), commits fall back; the fallback must not erase what an earlier
  commit recorded as done, or the next owner publishes it a second time. The limit is
  lowered here so a dozen stuck records reach it.
* When every partition is full of stuck records the loop fetches nothing, yet aiokafka
  makes a member that has not called getmany() for max_poll_interval_ms leave the group.
  The interval is lowered here to a few seconds.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from service.stream import ledger
from service.stream.codec import InputRef
from service.stream.engine import StreamService, StreamSettings
from service.stream.metrics import StreamMetrics
from service.stream.processor import OutRecord
from tests import e2e
from tests.conftest import DevStack

pytestmark = pytest.mark.integration


class GatedProcessor:
    """Records keyed ``s...`` wait for their gate (a PATCH that hangs); others pass."""

    dlq_topic = "unused-dlq"

    def __init__(self, out: str, gates: dict[bytes, asyncio.Event] | None) -> None:
        self.out, self.gates = out, gates
        self.output_topic = out

    async def process(
        self, ref: InputRef, key: bytes | None, value: bytes | None, headers: Any, **_: Any
    ) -> OutRecord:
        if self.gates is not None and key is not None and key.startswith(b"s"):
            await self.gates.setdefault(key, asyncio.Event()).wait()
        return OutRecord(topic=self.out, key=key, value=value, headers=[])

    def stub(self, *args: Any, **kwargs: Any) -> OutRecord:
        raise AssertionError("no record here becomes a stub")


async def until_committed(
    bootstrap: str, group: str, tp: TopicPartition, offset: int
) -> OffsetAndMetadata:
    found = None
    for _ in range(100):
        found = await e2e.committed(bootstrap, group, tp)
        if found is not None and found.offset == offset:
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"committed {found}, expected offset {offset}")


async def test_stuck_records_past_the_metadata_limit_publish_nothing_twice(
    devstack: DevStack,
    new_topic: Callable[..., Awaitable[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ledger, "MAX_METADATA_CHARS", 12)
    bootstrap = devstack.kafka_bootstrap
    source, out = await new_topic("meta-in"), await new_topic("meta-out")
    tp, group = TopicPartition(source, 0), f"g-meta-{uuid.uuid4().hex[:8]}"

    def settings() -> StreamSettings:
        return StreamSettings(
            input_topic=source,
            group_id=group,
            client_args={"bootstrap_servers": bootstrap},
            poll_timeout_ms=100,
            stop_wait_s=1.0,
        )

    gates: dict[bytes, asyncio.Event] = {}
    first = StreamService(settings(), GatedProcessor(out, gates), StreamMetrics())  # type: ignore[arg-type]
    await first.start()
    run = asyncio.create_task(first.run())
    publisher = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await publisher.start()
    keys = [b"s0", b"s1", b"q2", *(b"s%d" % i for i in range(3, 13)), b"q13"]
    try:

        async def publish(offsets: range) -> None:
            for o in offsets:
                await publisher.send_and_wait(source, b"v%02d" % o, key=keys[o], partition=0)

        await publish(range(3))
        # 2 done above the stuck 0 and 1: committed at 0, "done up to 2 but 1".
        early = await until_committed(bootstrap, group, tp, 0)
        assert early.metadata == "crs1:2:1"
        await publish(range(3, 14))  # ten more stuck, 13 done: the metadata overflows
        await asyncio.sleep(0.5)
        gates.setdefault(b"s0", asyncio.Event()).set()
        # The watermark moves to 1; 2 must still be recorded as done (it was published).
        moved = await until_committed(bootstrap, group, tp, 1)
    finally:
        await publisher.stop()
        first.request_stop()  # the rest stays stuck: released with what is committed
        await asyncio.wait_for(run, 30)
        await first.close()

    second = StreamService(settings(), GatedProcessor(out, None), StreamMetrics())  # type: ignore[arg-type]
    await second.start()
    run = asyncio.create_task(second.run())
    try:
        outputs = await e2e.read_all(bootstrap, out, len(keys))
    finally:
        second.request_stop()
        await asyncio.wait_for(run, 30)
        await second.close()
    published = Counter(r.value for r in outputs)
    assert {v: n for v, n in published.items() if n > 1} == {}
    assert moved.metadata == "crs1:1:"
    assert sorted(published) == [b"v%02d" % o for o in range(len(keys))]
    assert await e2e.committed(bootstrap, group, tp) == OffsetAndMetadata(len(keys), "")


async def test_a_member_whose_partitions_are_all_full_stays_in_the_group(
    devstack: DevStack, new_topic: Callable[..., Awaitable[str]]
) -> None:
    bootstrap = devstack.kafka_bootstrap
    source, out = await new_topic("full-in"), await new_topic("full-out")
    group = f"g-full-{uuid.uuid4().hex[:8]}"
    settings = StreamSettings(
        input_topic=source,
        group_id=group,
        client_args={"bootstrap_servers": bootstrap},
        consumer_args={"max_poll_interval_ms": 3000},
        poll_timeout_ms=100,
        max_in_flight=3,
        poll_keepalive_s=1.0,
    )
    gates: dict[bytes, asyncio.Event] = {}
    service = StreamService(settings, GatedProcessor(out, gates), StreamMetrics())  # type: ignore[arg-type]
    revoked: list[list[TopicPartition]] = []
    on_revoked = service._on_revoked

    async def counting(tps: list[TopicPartition]) -> None:
        if tps:
            revoked.append(tps)
        await on_revoked(tps)

    service._on_revoked = counting  # type: ignore[method-assign]
    await service.start()
    run = asyncio.create_task(service.run())
    publisher = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await publisher.start()
    sent = [b"v%02d" % i for i in range(6)]
    try:
        for i, value in enumerate(sent):
            await publisher.send_and_wait(source, value, key=b"s%d" % i, partition=0)
        await asyncio.sleep(8)  # full and stuck for over twice max_poll_interval_ms
        in_flight = service._parts[TopicPartition(source, 0)].ledger.in_flight
        for gate in list(gates.values()):
            gate.set()
        await asyncio.sleep(0.3)
        for i in range(len(sent)):  # those taken by the keep-alives or after
            gates.setdefault(b"s%d" % i, asyncio.Event()).set()
        outputs = await e2e.read_all(bootstrap, out, len(sent))
    finally:
        await publisher.stop()
        service.request_stop()
        await asyncio.wait_for(run, 30)
        await service.close()
    assert revoked == []  # still a member: nothing revoked, nothing processed twice
    assert 3 <= in_flight <= 6  # full; the keep-alives took a record each at most
    assert sorted(r.value for r in outputs) == sent
