"""KAFKA_CLIENT_ID and CRS_AUTO_OFFSET_RESET on the real broker, through the running service.

The client id is what the broker reports for the group's member (what
``kafka-consumer-groups --describe`` shows, and what quotas and broker logs key on); the
offset reset decides whether a new group replays the input topic's retention or starts
at its end.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import TopicPartition

from service.app.runtime import Runtime
from tests import e2e
from tests.conftest import DevStack


async def taken_over(runtime: Runtime, topic: str, timeout_s: float = 30) -> None:
    """Until the service owns partition 0 of ``topic`` (its start position is set)."""
    deadline = time.monotonic() + timeout_s
    tp = TopicPartition(topic, 0)
    while runtime.stream is None or tp not in runtime.stream._parts:
        assert time.monotonic() < deadline, f"{tp} not taken over in {timeout_s} s"
        await asyncio.sleep(0.05)


async def member_client_ids(bootstrap: str, group: str) -> list[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (response,) = await admin.describe_consumer_groups([group])
    finally:
        await admin.close()
    (described,) = response.to_object()["groups"]
    assert described["error_code"] == 0, described
    return sorted(m["client_id"] for m in described["members"])


async def test_the_client_id_names_the_groups_member(
    devstack: DevStack, clean_k8s: Any, new_topic: Any
) -> None:
    await e2e.seed_region(clean_k8s)
    topics = await e2e.new_topics(new_topic, 1)
    client_id = f"crs-it-{uuid.uuid4().hex[:8]}"
    cfg = e2e.config(devstack, topics, KAFKA_CLIENT_ID=client_id)
    async with e2e.running(cfg) as runtime:
        await taken_over(runtime, topics["input"])
        assert await member_client_ids(devstack.kafka_bootstrap, cfg.group_id) == [client_id]
    # Unset, the group and the pod's name (the chart's CRS_POD_NAME) name it.
    cfg = e2e.config(devstack, topics, CRS_POD_NAME="crs-consumer-7f9c4-qx2lp")
    async with e2e.running(cfg) as runtime:
        await taken_over(runtime, topics["input"])
        ids = await member_client_ids(devstack.kafka_bootstrap, cfg.group_id)
        assert ids == [f"{cfg.group_id}-crs-consumer-7f9c4-qx2lp"]


async def classified(bootstrap: str, topic: str, expected: int) -> list[str]:
    """The instance UUIDs of the classifications on ``topic``, waiting for ``expected``."""
    return [e2e.data_of(r)["instance_uuid"] for r in await e2e.read_all(bootstrap, topic, expected)]


async def test_latest_skips_what_came_before_a_new_group_and_earliest_replays_it(
    devstack: DevStack, clean_k8s: Any, new_topic: Any
) -> None:
    await e2e.seed_region(clean_k8s)
    topics = await e2e.new_topics(new_topic, 1)
    bootstrap = devstack.kafka_bootstrap
    before = [e2e.outcome("hv-3", ["hv-3", "hv-4"]) for _ in range(3)]
    await e2e.publish(bootstrap, topics["input"], [e2e.good_record(*o) for o in before])

    cfg = e2e.config(devstack, topics, CRS_AUTO_OFFSET_RESET="latest")
    after = e2e.outcome("hv-3", ["hv-3", "hv-4"])
    async with e2e.running(cfg) as runtime:
        await taken_over(runtime, topics["input"])
        await e2e.publish(bootstrap, topics["input"], [e2e.good_record(*after)])
        assert await classified(bootstrap, topics["output"], 1) == [after[0]]

    # Another new group, with the default: every retained record, the earlier ones first.
    replay = {**topics, "output": await new_topic("out", 1)}
    cfg = e2e.config(devstack, replay, CRS_GROUP_ID=f"g-replay-{uuid.uuid4().hex[:8]}")
    assert cfg.auto_offset_reset == "earliest"
    async with e2e.running(cfg):
        got = await classified(bootstrap, replay["output"], 4)
    assert got == [vm for vm, _, _ in before] + [after[0]]
