"""Every use of aiokafka's private parts, in one place, behind typed Protocols.

aiokafka's public API lacks a few things the engine needs: the committed offset read
without taking an error for "none" (:mod:`service.stream.committed`), the end of a
background task (which public calls hide), a fetch position without waiting, a
producer's (id, epoch), adding a partition to a transaction ahead of its records,
closing a client whose ``stop()`` raised, reading past a record it cannot parse
(:mod:`service.stream.unreadable`), and a few requests and metadata that
``crs-consumer check`` and ``crs-consumer dlq`` need. Each reaches into aiokafka here
and nowhere else; ``tests/unit/test_aiokafka_internals.py`` pins each assumption
against the installed aiokafka (written against 0.14, pinned in requirements.lock), so
an upgrade that moves one fails a named test, not production. Functions degrade as
each says when a part is missing (a fake client in the unit tests has only some).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol

from aiokafka.consumer import fetcher as _fetcher
from aiokafka.structs import TopicPartition

__all__ = [
    "GroupCoordinator",
    "PartitionRecordsBase",
    "add_partitions_to_txn",
    "broker_ids",
    "close_client_after_failed_stop",
    "close_producer_connections",
    "ended_background_task",
    "fetch_all_metadata",
    "fetch_position",
    "group_coordinator",
    "install_partition_records",
    "producer_identity",
    "send_admin_request",
    "send_to_coordinator",
]


class GroupCoordinator(Protocol):
    """What :mod:`service.stream.committed` uses of aiokafka's consumer ``_coordinator``."""

    group_id: str

    async def ensure_coordinator_known(self) -> None: ...

    def coordinator_dead(self) -> None: ...


def group_coordinator(consumer: Any) -> GroupCoordinator:
    """The started consumer's group coordinator (``AIOKafkaConsumer._coordinator``)."""
    coordinator: GroupCoordinator = consumer._coordinator
    return coordinator


async def send_to_coordinator(coordinator: GroupCoordinator, request: Any) -> Any:
    """Send ``request`` to the group's coordinator (``GroupCoordinator._send_req``, which
    marks the coordinator dead itself when the request cannot be sent)."""
    return await coordinator._send_req(request)  # type: ignore[attr-defined]


# aiokafka's consumer background tasks: (what it does, owner attribute, task attribute).
_ALWAYS_WATCHED = (
    ("group coordination", "_coordinator", "_coordination_task"),
    ("fetching", "_fetcher", "error_future"),
    # The client's metadata refresh: never started again either, and every request
    # that needs fresh metadata (a partition leader moved) would wait for it.
    ("metadata refresh", "_client", "_sync_task"),
)
# Started again by a rejoin (see ended_background_task).
_WATCHED_AFTER_A_RAISE = (
    ("heartbeat", "_coordinator", "_heartbeat_task"),
    ("committed offsets refresh", "_coordinator", "_commit_refresh_task"),
)


def ended_background_task(consumer: Any, *, fetch_raised: bool) -> tuple[str, BaseException] | None:
    """(which, error) once one of aiokafka's consumer tasks has ended with an error for
    good (``fetch_raised``: the last getmany() raised).

    aiokafka runs the group protocol (join, sync, every rejoin) in one background task,
    heartbeats and the committed offsets' refresh in two more, the fetching in a fourth
    and the client's metadata refresh in a fifth. Only a rejoin starts the second and
    third again, nothing the others; an error they do not expect ends them. Measured
    for the first: assignment bytes it cannot decode, which any client that joins the
    group by its id and leads a rebalance can hand out; every getmany() then raises that
    error, and the member drops out of the group when its session expires and never
    joins again. The fetch task's end raises nothing: getmany() returns no record, for
    good, while all looks well. Either way retrying cannot help, a new consumer does.

    The heartbeat and the committed offsets' refresh are watched only after getmany()
    raised: they are started again by a rejoin, which nothing asks for once they have
    ended outside one; the coordination routine hands their error to every getmany()
    instead, and that is the sign (a heartbeat that ends during a rebalance is dropped
    silently by the rejoin). Measured: the heartbeat's first GROUP_AUTHORIZATION_FAILED
    (the group ACL revoked for a moment) ended it, and the member never rejoined once
    the ACL was back.
    """
    watched = _ALWAYS_WATCHED + (_WATCHED_AFTER_A_RAISE if fetch_raised else ())
    for which, owner_name, name in watched:
        task = getattr(getattr(consumer, owner_name, None), name, None)
        if task is not None and task.done() and not task.cancelled():
            error: BaseException | None = task.exception()
            if error is not None:
                return which, error
    return None


async def close_client_after_failed_stop(consumer: Any) -> None:
    """Close the connections of a consumer whose ``stop()`` raised (bounded, quiet).

    aiokafka's stop() re-raises the error of a task that ended with one (the fetch task)
    before it closes its client's connections and metadata task; after a restart of the
    clients they would stay open, one set per restart. The client's close() re-raises an
    ended metadata task's error the same way, before closing anything: that task is
    forgotten first."""
    client = getattr(consumer, "_client", None)
    if client is None:
        return
    sync = getattr(client, "_sync_task", None)
    if sync is not None and sync.done():
        client._sync_task = None
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.close(), 5.0)


async def close_producer_connections(producer: Any) -> None:
    """Close the connections of a producer whose ``stop()`` raised (bounded, quiet):
    aiokafka's stop() raises before closing them when the sender ends fenced."""
    client = getattr(producer, "client", None)
    if client is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), 5.0)


def fetch_position(consumer: Any, tp: TopicPartition) -> int | None:
    """aiokafka's fetch position of ``tp`` if it is valid, else None, without waiting.

    Not ``position()``: while a partition awaits an offset reset that coroutine waits for
    it (request_timeout_ms, again and again), which would hold the consume loop, and it
    takes the group's pending error, which the fetch loop must see.
    """
    try:
        state = consumer._subscription.subscription.assignment.state_value(tp)
    except AttributeError:  # no subscription or assignment (yet)
        return None
    if state is None or not state.has_valid_position:
        return None
    return int(state.position)


def producer_identity(producer: Any) -> tuple[int, int] | None:
    """(producer id, epoch) of a transactional producer that has started; else None."""
    txn = getattr(producer, "_txn_manager", None)
    if txn is None or txn.producer_id is None or txn.producer_id < 0:
        return None
    return int(txn.producer_id), int(txn.producer_epoch)


def add_partitions_to_txn(producer: Any, topic: str, keys: list[bytes]) -> None:
    """Add the partitions of ``topic`` that ``keys`` go to to ``producer``'s open
    transaction now, ahead of their records.

    aiokafka has no public call for it; its send() takes these two steps (the
    producer's partitioner ``_partition``, then the transaction manager's
    ``maybe_add_partition_to_txn``, whose sender adds the partition before the group).
    Without them, or without the topic's metadata yet, nothing is added (the first send
    adds it, as usual).
    """
    txn = getattr(producer, "_txn_manager", None)
    metadata = getattr(producer, "_metadata", None)
    choose = getattr(producer, "_partition", None)
    if not keys or txn is None or metadata is None or choose is None:
        return
    if not metadata.partitions_for_topic(topic):
        return
    for partition in {choose(topic, None, key, None, key, None) for key in keys}:
        txn.maybe_add_partition_to_txn(TopicPartition(topic, partition))


async def send_admin_request(admin: Any, request: Any) -> Any:
    """Send ``request`` (a protocol request the admin client has no method for:
    Metadata without auto-creation, DescribeAcls) through an admin client
    (``AIOKafkaAdminClient._send_request``, to the least loaded broker)."""
    return await admin._send_request(request)


def broker_ids(admin: Any) -> list[int]:
    """The node ids of the brokers a started admin client knows (its ``_client``'s
    cluster metadata)."""
    return [int(b.nodeId) for b in admin._client.cluster.brokers()]


async def fetch_all_metadata(consumer: Any) -> Any:
    """The cluster's metadata for every topic, fetched now by a started consumer's client
    (``AIOKafkaClient.fetch_all_metadata``: an assign-only consumer tracks no topics)."""
    return await consumer._client.fetch_all_metadata()


# aiokafka's per-partition record iterator, as the fetcher had it before any
# replacement: built as ``(tp, records, aborted_transactions, fetch_offset,
# key_deserializer, value_deserializer, check_crcs, isolation_level)``, it keeps ``_tp``,
# reads batches through ``records.has_next()`` / ``records.next_batch()`` in
# ``_unpack_records()`` and keeps ``next_fetch_offset``, where the next fetch starts.
PartitionRecordsBase: Any = _fetcher.PartitionRecords


def install_partition_records(cls: type[Any]) -> None:
    """Make aiokafka's fetcher build ``cls`` (a subclass of :data:`PartitionRecordsBase`)
    for every fetched partition (idempotent)."""
    if _fetcher.PartitionRecords is not cls:
        _fetcher.PartitionRecords = cls
