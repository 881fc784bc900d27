"""What service.stream.aiokafka_internals assumes about aiokafka's private parts, pinned
against the installed aiokafka: an upgrade that moves one fails the test named after it.

The engine's behaviour on top of these runs against a fake client in tests/unit/engine/ and
against the real broker in tests/integration; the unreadable-record iterator on aiokafka's
real record parser in test_unreadable.py.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.client import AIOKafkaClient
from aiokafka.consumer import fetcher
from aiokafka.consumer.group_coordinator import GroupCoordinator
from aiokafka.consumer.subscription_state import SubscriptionState
from aiokafka.producer.sender import Sender
from aiokafka.producer.transaction_manager import TransactionManager
from aiokafka.structs import BrokerMetadata, TopicPartition

from service.stream import aiokafka_internals as internals
from service.stream import unreadable
from service.stream.partitioner import partition_for_key

NOWHERE = "127.0.0.1:1"  # nothing is ever connected to
TP = TopicPartition("in", 0)


@pytest_asyncio.fixture
async def consumer() -> AsyncIterator[AIOKafkaConsumer]:
    c = AIOKafkaConsumer("in", bootstrap_servers=NOWHERE, group_id="g")
    try:
        yield c
    finally:
        await c._client.close()


@pytest_asyncio.fixture
async def producer() -> AsyncIterator[AIOKafkaProducer]:
    p = AIOKafkaProducer(
        bootstrap_servers=NOWHERE, transactional_id="x", partitioner=partition_for_key
    )
    try:
        yield p
    finally:
        await p.client.close()


@pytest_asyncio.fixture
async def coordinator(consumer: AIOKafkaConsumer) -> AsyncIterator[GroupCoordinator]:
    c = GroupCoordinator(consumer._client, SubscriptionState(), group_id="g")
    try:
        yield c
    finally:
        await c.close()


async def test_the_consumer_keeps_its_coordinator_fetcher_client_and_subscription(
    consumer: AIOKafkaConsumer,
) -> None:
    # group_coordinator, ended_background_task, close_client_after_failed_stop and
    # fetch_position read these attributes of the consumer.
    for name in ("_coordinator", "_fetcher", "_client", "_subscription"):
        assert hasattr(consumer, name), name
    assert isinstance(consumer._client, AIOKafkaClient)
    assert isinstance(consumer._subscription, SubscriptionState)
    # Not started: no background task has ended.
    assert internals.ended_background_task(consumer, fetch_raised=True) is None


async def test_the_group_coordinator_sends_requests_and_forgets_a_dead_coordinator(
    coordinator: GroupCoordinator,
) -> None:
    # service.stream.committed: OffsetFetch sent through _send_req, the coordinator
    # looked up again after NOT_COORDINATOR.
    assert coordinator.group_id == "g"
    assert list(inspect.signature(coordinator._send_req).parameters) == ["request"]
    assert inspect.iscoroutinefunction(coordinator._send_req)
    assert inspect.iscoroutinefunction(coordinator.ensure_coordinator_known)
    assert list(inspect.signature(coordinator.coordinator_dead).parameters) == []


async def test_the_group_coordinator_runs_its_routines_as_named_tasks(
    coordinator: GroupCoordinator,
) -> None:
    # ended_background_task watches these tasks (aiokafka restarts the last two on a rejoin).
    for name in ("_coordination_task", "_heartbeat_task", "_commit_refresh_task"):
        task = getattr(coordinator, name)
        assert task is None or isinstance(task, asyncio.Task), name


def test_the_fetcher_exposes_its_task_as_error_future() -> None:
    # ended_background_task: the fetch task's end, which getmany() never reports.
    assert isinstance(inspect.getattr_static(fetcher.Fetcher, "error_future"), property)
    source = inspect.getsource(fetcher.Fetcher)
    assert "return self._fetch_task" in source


async def test_the_client_keeps_its_metadata_task_as_sync_task(
    consumer: AIOKafkaConsumer,
) -> None:
    # ended_background_task watches it; close_client_after_failed_stop forgets an ended
    # one, as the client's close() would re-raise its error before closing anything.
    client = consumer._client
    assert client._sync_task is None  # set once started
    ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    ended.set_exception(RuntimeError("metadata task ended"))
    client._sync_task = ended  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="metadata task ended"):
        await client.close()  # what the adapter works around
    client._sync_task = ended  # type: ignore[assignment]
    await internals.close_client_after_failed_stop(consumer)
    assert client._sync_task is None


async def test_a_fetch_position_is_read_from_the_subscription_without_waiting() -> None:
    subscription = SubscriptionState()
    subscription.assign_from_user({TP})
    consumer: Any = SimpleNamespace(_subscription=subscription)
    assert internals.fetch_position(consumer, TP) is None  # awaiting a reset: no position
    subscription.seek(TP, 42)
    assert internals.fetch_position(consumer, TP) == 42
    assert internals.fetch_position(consumer, TopicPartition("in", 9)) is None
    assert internals.fetch_position(SimpleNamespace(), TP) is None  # not subscribed yet


async def test_a_producers_id_and_epoch_are_its_transaction_managers(
    producer: AIOKafkaProducer,
) -> None:
    txn = producer._txn_manager
    assert isinstance(txn, TransactionManager)
    assert internals.producer_identity(producer) is None  # not initialised yet
    txn.set_pid_and_epoch(7, 3)
    assert internals.producer_identity(producer) == (7, 3)
    assert internals.producer_identity(SimpleNamespace()) is None  # not transactional


async def test_partitions_are_added_ahead_through_the_partitioner_and_transaction_manager(
    producer: AIOKafkaProducer,
) -> None:
    # No public API: if an upgrade renames these, nothing is added ahead any more and
    # placements are committed one round trip later. This fails first.
    txn = producer._txn_manager
    assert callable(txn.maybe_add_partition_to_txn)
    assert producer._metadata.partitions_for_topic("out") is None  # nothing known yet
    internals.add_partitions_to_txn(producer, "out", [b"k"])
    assert not txn.partitions_to_add()  # no metadata: nothing added ahead
    producer._metadata._partitions["out"] = {p: SimpleNamespace(leader=0) for p in range(3)}
    chosen = producer._partition("out", None, b"k", None, b"k", None)
    assert chosen == partition_for_key(b"k", [0, 1, 2], [0, 1, 2])
    txn.set_pid_and_epoch(7, 3)
    txn.begin_transaction()
    internals.add_partitions_to_txn(producer, "out", [b"k"])
    assert txn.partitions_to_add() == {TopicPartition("out", chosen)}
    # The sender adds pending partitions before the group, and mutes them until then.
    assert "partitions_to_add" in Sender._maybe_do_transactional_request.__code__.co_names


async def test_a_producers_connections_are_its_client(producer: AIOKafkaProducer) -> None:
    # close_producer_connections closes them when stop() raised (a fenced sender).
    assert isinstance(producer.client, AIOKafkaClient)
    await internals.close_producer_connections(producer)
    await internals.close_producer_connections(SimpleNamespace())  # nothing to close


def test_the_fetcher_builds_partition_records_as_the_replacement_expects() -> None:
    base = internals.PartitionRecordsBase
    assert base is fetcher.PartitionRecords or issubclass(fetcher.PartitionRecords, base)
    params = list(inspect.signature(base.__init__).parameters)
    assert params[:3] == ["self", "tp", "records"]  # the replacement wraps ``records``
    assert callable(base._unpack_records)
    source = inspect.getsource(base)
    for used in ("self._tp", "next_fetch_offset", "has_next()", "next_batch()"):
        assert used in source, used
    # The fetcher looks the class up by this module-level name when it builds one.
    assert "PartitionRecords(" in inspect.getsource(fetcher.Fetcher)


def test_installing_the_replacement_is_idempotent() -> None:
    original = fetcher.PartitionRecords
    try:
        unreadable.install()
        installed = fetcher.PartitionRecords
        assert issubclass(installed, internals.PartitionRecordsBase)
        unreadable.install()
        assert fetcher.PartitionRecords is installed
    finally:
        fetcher.PartitionRecords = original


async def test_the_admin_client_sends_raw_requests_and_keeps_its_client() -> None:
    # crs-consumer check: Metadata without auto-creation and DescribeAcls have no admin
    # method; the brokers' ids come from the admin's client's cluster metadata.
    admin = AIOKafkaAdminClient(bootstrap_servers=NOWHERE)
    try:
        assert inspect.iscoroutinefunction(admin._send_request)
        assert next(iter(inspect.signature(admin._send_request).parameters)) == "request"
        assert isinstance(admin._client, AIOKafkaClient)
        assert internals.broker_ids(admin) == []  # nothing fetched yet
        admin._client.cluster._brokers = {3: BrokerMetadata(3, "127.0.0.1", 1, None)}
        assert internals.broker_ids(admin) == [3]
    finally:
        await admin.close()


async def test_a_consumers_client_fetches_every_topics_metadata(
    consumer: AIOKafkaConsumer,
) -> None:
    # crs-consumer dlq: an assign-only consumer tracks no topics.
    assert inspect.iscoroutinefunction(consumer._client.fetch_all_metadata)
    assert list(inspect.signature(consumer._client.fetch_all_metadata).parameters) == []
