"""A partition's committed offset, read so that no error is ever taken for "none".

A take-over starts its partition from the group's committed offset; "no committed offset"
means the group never committed this partition, and it starts from the first record.
aiokafka's ``fetch_committed_offsets`` cannot tell the two apart in one case: OffsetFetch
v2-v7 (aiokafka speaks v1-v3) answers a *group-level* error with the error code at the top
of the response and no partition at all (Kafka's ``OffsetFetchRequest.getErrorResponse``),
and aiokafka reads only the partitions. A coordinator loading or moving (a broker
restarted, or fenced by its controller and unfenced again), or a group not authorised for
Describe, then reads as "never committed": the partition started over from its first
record and everything committed came out a second time (stop 29's CI run: 1,010 of 3,000
inputs twice after a broker freeze; the secured-broker test reproduces it with a DENY).
aiokafka also takes a partition answered UNKNOWN_TOPIC_OR_PARTITION for one without an
offset. Here every error, at either level, and an answer without the partition, raise;
the take-over fails and is retried (or reports its stall) like any other.
"""

from __future__ import annotations

from typing import Any

from aiokafka import errors as kafka_errors
from aiokafka.protocol.commit import OffsetFetchRequest
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from service.stream import aiokafka_internals, errors
from service.stream.aiokafka_internals import GroupCoordinator

__all__ = ["OffsetFetchIncomplete", "fetch_committed", "read_committed"]

# OffsetFetch's "no committed offset" (Kafka's OffsetFetchResponse.INVALID_OFFSET).
_NO_OFFSET = -1


class OffsetFetchIncomplete(kafka_errors.KafkaError):  # type: ignore[misc]
    """The coordinator answered without the partition asked for (and without an error)."""

    retriable = True


def _error(code: int, group_id: str) -> kafka_errors.KafkaError:
    cls = kafka_errors.for_code(code)
    if cls is kafka_errors.GroupAuthorizationFailedError:
        return cls(group_id)  # named, as aiokafka names it elsewhere
    return cls()


def read_committed(response: Any, tp: TopicPartition, group_id: str) -> OffsetAndMetadata | None:
    """``tp``'s committed offset in an OffsetFetch ``response``; None only when the
    coordinator answered, without error, that the group has none."""
    # v1 has no top-level error; v2+ put a group-level error there (and no partitions).
    top = getattr(response, "error_code", 0)
    if top:
        raise _error(top, group_id)
    for topic, partitions in response.topics:
        if topic != tp.topic:
            continue
        for partition, offset, metadata, code in partitions:
            if partition != tp.partition:
                continue
            if code:
                raise _error(code, group_id)
            return None if offset == _NO_OFFSET else OffsetAndMetadata(offset, metadata or "")
    raise OffsetFetchIncomplete(f"no answer for {tp.topic}[{tp.partition}]")


async def fetch_committed(
    coordinator: GroupCoordinator, tp: TopicPartition
) -> OffsetAndMetadata | None:
    """Ask the group's coordinator (see ``aiokafka_internals.group_coordinator``) for
    ``tp``'s committed offset, once: any error raises (see the module docstring)."""
    group_id: str = coordinator.group_id
    await coordinator.ensure_coordinator_known()
    request = OffsetFetchRequest(group_id, [(tp.topic, [tp.partition])])
    try:
        response = await aiokafka_internals.send_to_coordinator(coordinator, request)
        return read_committed(response, tp, group_id)
    except errors.COORDINATOR_MOVED:
        coordinator.coordinator_dead()
        raise
