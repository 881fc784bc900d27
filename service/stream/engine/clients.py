"""How the engine's Kafka clients are configured: every argument they get, in one place.

The consumer (one per engine), the transactional producers (one per owned partition, see
:mod:`.ownership`) and, in at-least-once mode, the one shared idempotent producer.
"""

from __future__ import annotations

from typing import Any

from aiokafka.structs import TopicPartition

from service.stream.engine.settings import StreamSettings, transactional_id_for
from service.stream.partitioner import partition_for_key

__all__ = ["consumer_args", "shared_producer_args", "transactional_producer_args"]


def consumer_args(s: StreamSettings) -> dict[str, Any]:
    """The group member's: offsets committed by the engine only, read_committed."""
    return {
        **s.client_args,
        "group_id": s.group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": s.auto_offset_reset,
        "isolation_level": "read_committed",
        "max_poll_records": s.max_batch,
        **s.consumer_args,
    }


def transactional_producer_args(s: StreamSettings, tp: TopicPartition) -> dict[str, Any]:
    """The producer bound to input partition ``tp`` (exactly-once mode).

    retry_backoff_ms: a transaction begun right after the previous commit is answered
    CONCURRENT_TRANSACTIONS until the broker has written that one's markers (a few ms),
    and aiokafka then waits its retry back-off (default 100 ms) before asking again:
    measured (bench/bench_txn.py), a back-to-back transaction took 99 ms of wall time
    with 100, 18.4-18.7 ms with 10, 8.6-9.1 ms with 2. A broker outage and its recovery
    cost the service the same CPU and log lines with 2 as with 10 (aiokafka paces
    reconnects by other means).
    """
    return {
        **s.client_args,
        "transactional_id": transactional_id_for(s.prefix, tp),
        "retry_backoff_ms": s.txn_retry_backoff_ms,
        "partitioner": partition_for_key,
    }


def shared_producer_args(s: StreamSettings) -> dict[str, Any]:
    """The one idempotent producer of at-least-once mode."""
    return {
        **s.client_args,
        "enable_idempotence": True,
        "acks": "all",
        "partitioner": partition_for_key,
    }
