"""Can the engine fence by group generation instead of by transactional id? (issue 37)

Run: ``.venv/bin/python bench/probe_kip447.py`` (dev stack; a few seconds)

Background (docs/maintainers/architecture.md, "Why a transaction per input partition"):
one transaction per replica for all its partitions would cut the service's transaction
requests, but a replica paused past its session could then commit offsets of
partitions another member owns by now. KIP-447 closes that: TxnOffsetCommit v3 carries
the member id and generation, and the group coordinator refuses a stale one. aiokafka
(0.14) sends only v0. This probe sends v3, built from aiokafka's own protocol types,
inside a transaction of a real producer, as a member of a real group:

* with the member's current generation: accepted (error 0), and the offset commits;
* with an earlier generation: refused, ILLEGAL_GENERATION (22);
* with another member id: refused, UNKNOWN_MEMBER_ID (25); both transactions are
  aborted and their offsets never show.

It exits 1 when the broker answers otherwise (or the committed offset is not the
accepted one): the assumption a generation-fenced engine would rest on does not hold.
Note that aiokafka's ``send_offsets_to_transaction`` also sends its v0 commit (the
probe uses it for AddOffsetsToTxn); an engine fenced this way must not let that one
through, or a stale member's offsets would still land.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from typing import Any

from _common import delete_topics, env_endpoints
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import (
    CompactArray,
    CompactString,
    Int16,
    Int32,
    Int64,
    Schema,
    TaggedFields,
)
from aiokafka.structs import TopicPartition

ILLEGAL_GENERATION, UNKNOWN_MEMBER_ID = 22, 25


def per_topic(*partition_fields: tuple[str, Any]) -> CompactArray:
    """A flexible version's topics: each a name and its partitions (these fields)."""
    return CompactArray(
        ("name", CompactString("utf-8")),
        ("partitions", CompactArray(*partition_fields, ("tags", TaggedFields))),
        ("tags", TaggedFields),
    )


class TxnOffsetCommitResponseV3(Response):
    API_KEY = 28
    API_VERSION = 3
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("topics", per_topic(("partition_index", Int32), ("error_code", Int16))),
        ("tags", TaggedFields),
    )


class TxnOffsetCommitRequestV3(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = 28
    API_VERSION = 3
    RESPONSE_TYPE = TxnOffsetCommitResponseV3
    SCHEMA = Schema(
        ("transactional_id", CompactString("utf-8")),
        ("group_id", CompactString("utf-8")),
        ("producer_id", Int64),
        ("producer_epoch", Int16),
        ("generation_id", Int32),
        ("member_id", CompactString("utf-8")),
        ("group_instance_id", CompactString("utf-8")),
        (
            "topics",
            per_topic(
                ("partition_index", Int32),
                ("committed_offset", Int64),
                ("committed_leader_epoch", Int32),
                ("committed_metadata", CompactString("utf-8")),
            ),
        ),
        ("tags", TaggedFields),
    )


class TxnOffsetCommitV3(Request[TxnOffsetCommitRequestV3]):
    API_KEY = 28

    def __init__(self, *fields: Any) -> None:
        self._fields = fields

    def build(self, request_struct_class: type[TxnOffsetCommitRequestV3]) -> Any:
        return request_struct_class(*self._fields)


async def main() -> int:
    bootstrap, _ = env_endpoints()
    run = uuid.uuid4().hex[:8]
    topic, group, txid = f"kip447-{run}", f"kip447-{run}", f"kip447-{run}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        await admin.close()
    tp = TopicPartition(topic, 0)
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False
    )
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=txid)
    await consumer.start()
    await producer.start()
    failures: list[str] = []
    try:
        for _ in range(40):
            await consumer.getmany(timeout_ms=250)
            if consumer.assignment():
                break
        coordinator = consumer._coordinator
        generation, member = coordinator.generation, coordinator.member_id
        print(f"member of {group}, generation {generation}")

        async def commit_v3(generation_id: int, member_id: str, offset: int) -> int:
            await producer.begin_transaction()
            await producer.send_offsets_to_transaction({tp: offset - 1}, group)
            txn = producer._txn_manager
            request = TxnOffsetCommitV3(
                txid,
                group,
                txn.producer_id,
                txn.producer_epoch,
                generation_id,
                member_id,
                None,
                [(topic, [(0, offset, -1, "", {})], {})],
                {},
            )
            response = await producer.client.send(coordinator.coordinator_id, request)
            (code,) = [p[1] for t in response.topics for p in t[1]]
            if code == 0:
                await producer.commit_transaction()
            else:
                await producer.abort_transaction()
            return int(code)

        cases = (
            ("the current generation", generation, member, 10, 0),
            ("an earlier generation", generation - 1, member, 20, ILLEGAL_GENERATION),
            ("another member", generation, "not-a-member", 30, UNKNOWN_MEMBER_ID),
        )
        for label, generation_id, member_id, offset, expected in cases:
            code = await commit_v3(generation_id, member_id, offset)
            verdict = "as expected" if code == expected else f"EXPECTED {expected}"
            print(f"  TxnOffsetCommit v3 with {label}: error {code} ({verdict})")
            if code != expected:
                failures.append(label)
        committed = await consumer.committed(tp)
        print(f"  committed offset: {committed} (the accepted commit's: 10)")
        if committed != 10:
            failures.append(f"committed offset {committed}")
    finally:
        await producer.stop()
        await consumer.stop()
        await delete_topics(bootstrap, [topic])
    if failures:
        print(f"FAILED: {', '.join(failures)}")
        return 1
    print("the broker fences TxnOffsetCommit v3 by member and generation")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
