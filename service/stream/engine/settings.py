"""The engine's settings (derived from :class:`service.app.config.Config`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiokafka.structs import TopicPartition


def transactional_id_for(prefix: str, tp: TopicPartition) -> str:
    """The transactional.id bound to input partition ``tp`` (the ACL prefix is ``prefix``)."""
    return f"{prefix}-{tp.topic}-{tp.partition}"


@dataclass(frozen=True)
class StreamSettings:
    input_topic: str
    group_id: str
    exactly_once: bool = True
    # transactional.id = <prefix>-<topic>-<partition>; default: the group id.
    transactional_id_prefix: str | None = None
    max_batch: int = 500  # records per fetch
    max_in_flight: int = 2000  # per partition, received but not committed
    key_concurrency: int = 256  # per partition, keys processed at once
    # The event size limit (the processor dead-letters larger ones unread): an unkeyed
    # record above it is not parsed for its lane either.
    max_event_bytes: int = 1 << 20
    commit_interval_ms: int = 100  # a partition's sustained commit rate: one per interval
    commit_burst: int = 3  # commits that may follow each other sooner (a quiet partition)
    commit_max_records: int = 500
    # The transactional producers' retry back-off, also how long a transaction that
    # follows another waits for the broker to finish that one (see _acquire).
    txn_retry_backoff_ms: int = 2
    retry_backoff_s: float = 0.5
    retry_backoff_max_s: float = 30.0
    # A revoke runs inside the group's rebalance: aiokafka does not heartbeat meanwhile,
    # so it must stay well below the session timeout or this member is evicted too.
    revoke_wait_s: float = 2.0
    # ... and its last commits (all partitions' together) at most this long.
    revoke_commit_s: float = 3.0
    # How long an assignment waits for its take-overs before it hands them to the
    # background (aiokafka does not heartbeat during the callback either).
    assign_wait_s: float = 3.0
    stop_wait_s: float = 10.0  # on SIGTERM the member leaves anyway: finish more
    fence_recheck_s: float = 15.0
    commit_timeout_s: float = 30.0
    poll_timeout_ms: int = 500
    # While every partition is full, how often the loop still asks aiokafka for one
    # record: a member that has not called getmany() for max_poll_interval_ms (300 s by
    # default) leaves the group (see run).
    poll_keepalive_s: float = 60.0
    # How often the end offsets of partitions left out of fetching (backpressure) are
    # read for the lag gauge (see _update_lag).
    lag_refresh_s: float = 10.0
    # Least time between two fetches that returned records (see run).
    fetch_linger_ms: int = 20
    # A quiet partition whose records are still undecided this long after they arrived
    # (they wait on the Kubernetes API) opens its next transaction ahead; 0: never.
    txn_open_ahead_ms: int = 2
    # ... and aborts it when nothing was decided this long after (well below the
    # producer's transaction.timeout.ms, 60 s, after which the broker would fence it).
    txn_open_ahead_max_s: float = 5.0
    client_args: dict[str, Any] = field(default_factory=dict)
    consumer_args: dict[str, Any] = field(default_factory=dict)

    @property
    def prefix(self) -> str:
        return self.transactional_id_prefix or self.group_id
