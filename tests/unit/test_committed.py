"""service.stream.committed: an OffsetFetch answer is never an error taken for "none"."""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka import errors as kafka_errors
from aiokafka.protocol.commit import (
    OffsetFetchRequest,
    OffsetFetchResponse_v1,
    OffsetFetchResponse_v3,
)
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from service.stream.committed import OffsetFetchIncomplete, fetch_committed, read_committed

TP = TopicPartition("in", 1)


def v3(topics: list[Any], error: int = 0) -> Any:
    return OffsetFetchResponse_v3(0, topics, error)


def test_an_offset_and_its_metadata_are_read() -> None:
    response = v3([("in", [(0, 9, "", 0), (1, 42, "crs1:a:", 0)]), ("other", [(1, 7, "", 0)])])
    assert read_committed(response, TP, "g") == OffsetAndMetadata(42, "crs1:a:")


def test_no_committed_offset_is_none_only_when_the_coordinator_says_so() -> None:
    assert read_committed(v3([("in", [(1, -1, "", 0)])]), TP, "g") is None
    assert read_committed(OffsetFetchResponse_v1([("in", [(1, -1, "", 0)])]), TP, "g") is None
    assert read_committed(OffsetFetchResponse_v1([("in", [(1, 5, "", 0)])]), TP, "g") == (
        OffsetAndMetadata(5, "")
    )


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (14, kafka_errors.GroupLoadInProgressError),  # COORDINATOR_LOAD_IN_PROGRESS
        (15, kafka_errors.GroupCoordinatorNotAvailableError),
        (16, kafka_errors.NotCoordinatorForGroupError),
        (30, kafka_errors.GroupAuthorizationFailedError),
    ],
)
def test_a_group_level_error_with_no_partition_raises(code: int, error: type[Exception]) -> None:
    # As Kafka answers v2-v7 (OffsetFetchRequest.getErrorResponse): the error on top, no
    # partition; aiokafka's fetch_committed_offsets returns {} for it.
    with pytest.raises(error):
        read_committed(v3([], code), TP, "g")


def test_a_partition_level_error_raises_even_unknown_topic_or_partition() -> None:
    with pytest.raises(kafka_errors.UnknownTopicOrPartitionError):
        read_committed(v3([("in", [(1, -1, "", 3)])]), TP, "g")
    with pytest.raises(kafka_errors.GroupLoadInProgressError):
        read_committed(OffsetFetchResponse_v1([("in", [(1, -1, "", 14)])]), TP, "g")


def test_an_answer_without_the_partition_raises() -> None:
    for topics in ([], [("in", [(0, 3, "", 0)])], [("other", [(1, 3, "", 0)])]):
        with pytest.raises(OffsetFetchIncomplete):
            read_committed(v3(topics), TP, "g")
    assert OffsetFetchIncomplete.retriable


def test_the_group_is_named_in_an_authorization_failure() -> None:
    with pytest.raises(kafka_errors.GroupAuthorizationFailedError, match="my-group"):
        read_committed(v3([], 30), TP, "my-group")


class _Coordinator:
    """aiokafka's group coordinator as fetch_committed uses it."""

    def __init__(self, answers: list[Any]) -> None:
        self.group_id = "g"
        self.answers = answers
        self.requests: list[Any] = []
        self.lookups = 0
        self.deaths = 0

    async def ensure_coordinator_known(self) -> None:
        self.lookups += 1

    async def _send_req(self, request: OffsetFetchRequest) -> Any:
        self.requests.append(request)
        return self.answers.pop(0)

    def coordinator_dead(self) -> None:
        self.deaths += 1


async def test_fetch_asks_the_coordinator_for_the_one_partition() -> None:
    c = _Coordinator([v3([("in", [(1, 4, "", 0)])])])
    assert await fetch_committed(c, TP) == OffsetAndMetadata(4, "")
    assert (c.lookups, c.deaths) == (1, 0)
    (request,) = c.requests
    assert (request._consumer_group, request._partitions) == ("g", [("in", [1])])


@pytest.mark.parametrize(("code", "deaths"), [(14, 0), (15, 1), (16, 1), (30, 0)])
async def test_fetch_looks_the_coordinator_up_again_only_when_it_moved(
    code: int, deaths: int
) -> None:
    c = _Coordinator([v3([], code)])
    with pytest.raises(kafka_errors.KafkaError):
        await fetch_committed(c, TP)
    assert c.deaths == deaths
