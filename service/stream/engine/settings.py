"""The engine's settings, derived from the one declaration of the service's settings.

Every tuning knob is declared once, in :class:`service.app.config.Config` (its variable,
flag, constraint, meaning and default); :class:`StreamSettings` takes its defaults from
there (``_SHIPPED``) and :meth:`StreamSettings.from_config` builds it from a loaded
configuration, including the values derived from other settings (the rebalance
callbacks' bounds from the session timeout, the stop's from the shutdown budget). What
is not a setting of the service (the keep-alive fetch, the lag refresh, how long a
transaction opened ahead may stay open) has its default here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from aiokafka.structs import TopicPartition

from service.app.config import Config

__all__ = ["StreamSettings", "transactional_id_for"]

# The defaults the service ships (the engine's, for embedders and tests that build
# StreamSettings directly): Config's declaration, read once.
_SHIPPED = Config()


def transactional_id_for(prefix: str, tp: TopicPartition) -> str:
    """The transactional.id bound to input partition ``tp`` (the ACL prefix is ``prefix``)."""
    return f"{prefix}-{tp.topic}-{tp.partition}"


def revoke_commit_for(c: Config) -> float:
    """The revoke's commits get what is left of half a session (at least a second)."""
    return max(1.0, c.session_timeout_ms / 2000 - c.revoke_wait_s)


def assign_wait_for(c: Config) -> float:
    """No heartbeat during the assignment callback either: stay well inside a session."""
    return c.session_timeout_ms / 3000


def stop_wait_for(c: Config) -> float:
    """On SIGTERM, records in progress may finish for a third of the shutdown budget."""
    return c.shutdown_timeout_s / 3


@dataclass(frozen=True)
class StreamSettings:
    input_topic: str
    group_id: str
    exactly_once: bool = _SHIPPED.exactly_once
    # transactional.id = <prefix>-<topic>-<partition>; default: the group id.
    transactional_id_prefix: str | None = _SHIPPED.transactional_id_prefix
    max_batch: int = _SHIPPED.max_batch  # records per fetch
    max_in_flight: int = _SHIPPED.max_in_flight  # per partition, received, not committed
    key_concurrency: int = _SHIPPED.key_concurrency  # per partition, keys at once
    # The event size limit (the processor dead-letters larger ones unread): an unkeyed
    # record above it is not parsed for its lane either.
    max_event_bytes: int = _SHIPPED.max_event_bytes
    # A partition's sustained commit rate: one per interval ...
    commit_interval_ms: int = _SHIPPED.commit_interval_ms
    # ... and the commits that may follow each other sooner (a quiet partition).
    commit_burst: int = _SHIPPED.commit_burst
    commit_max_records: int = _SHIPPED.commit_max_records
    # The replica's transactions per second across its partitions (pacing.ReplicaPace).
    commit_rate_max: int = _SHIPPED.commit_rate_max
    # The transactional producers' retry back-off, also how long a transaction that
    # follows another waits for the broker to finish that one (see ownership._take_over).
    txn_retry_backoff_ms: int = _SHIPPED.txn_retry_backoff_ms
    retry_backoff_s: float = _SHIPPED.retry_backoff_s
    retry_backoff_max_s: float = _SHIPPED.retry_backoff_max_s
    # A revoke runs inside the group's rebalance: aiokafka does not heartbeat meanwhile,
    # so it must stay well below the session timeout or this member is evicted too.
    revoke_wait_s: float = _SHIPPED.revoke_wait_s
    # ... and its last commits (all partitions' together) at most this long.
    revoke_commit_s: float = revoke_commit_for(_SHIPPED)
    # How long an assignment waits for its take-overs before it hands them to the
    # background (aiokafka does not heartbeat during the callback either).
    assign_wait_s: float = assign_wait_for(_SHIPPED)
    stop_wait_s: float = stop_wait_for(_SHIPPED)  # on SIGTERM the member leaves anyway
    fence_recheck_s: float = _SHIPPED.fence_recheck_s
    commit_timeout_s: float = _SHIPPED.commit_timeout_s
    poll_timeout_ms: int = _SHIPPED.poll_timeout_ms
    # While every partition is full, how often the loop still asks aiokafka for one
    # record: a member that has not called getmany() for max_poll_interval_ms (300 s by
    # default) leaves the group (see StreamService.run).
    poll_keepalive_s: float = 60.0
    # How often the end offsets of partitions left out of fetching (backpressure) are
    # read for the lag gauge (see lag.Lag._update_lag).
    lag_refresh_s: float = 10.0
    # Least time between two fetches that returned records (see StreamService.run).
    fetch_linger_ms: int = _SHIPPED.fetch_linger_ms
    # A quiet partition whose records are still undecided this long after they arrived
    # (they wait on the Kubernetes API) opens its next transaction ahead; 0: never.
    txn_open_ahead_ms: int = _SHIPPED.txn_open_ahead_ms
    # ... and aborts it when nothing was decided this long after (well below the
    # producer's transaction.timeout.ms, 60 s, after which the broker would fence it).
    txn_open_ahead_max_s: float = 5.0
    # A placement's classification produced into the transaction opened ahead while its
    # write is in flight is discarded when not decided within this; 0: never produced ahead.
    txn_produce_ahead_ms: int = _SHIPPED.txn_produce_ahead_ms
    # Where a partition the group never committed starts: "earliest" (offset 0: every
    # retained record) or "latest" (its end when taken over). aiokafka also resets a
    # position out of range (retention deleted it, the log was truncated) so.
    auto_offset_reset: Literal["earliest", "latest"] = _SHIPPED.auto_offset_reset
    # The Kafka clients' connection settings (every client) and the consumer's own.
    client_args: dict[str, Any] = field(default_factory=dict)
    consumer_args: dict[str, Any] = field(default_factory=dict)

    @property
    def prefix(self) -> str:
        return self.transactional_id_prefix or self.group_id

    @classmethod
    def from_config(cls, c: Config) -> StreamSettings:
        """The engine's settings from the service's configuration ``c``."""
        return cls(
            input_topic=c.input_topic,
            group_id=c.group_id,
            exactly_once=c.exactly_once,
            transactional_id_prefix=c.effective_transactional_id_prefix,
            max_batch=c.max_batch,
            max_in_flight=c.max_in_flight,
            key_concurrency=c.key_concurrency,
            max_event_bytes=c.max_event_bytes,
            commit_interval_ms=c.commit_interval_ms,
            commit_burst=c.commit_burst,
            commit_rate_max=c.commit_rate_max,
            txn_retry_backoff_ms=c.txn_retry_backoff_ms,
            txn_open_ahead_ms=c.txn_open_ahead_ms,
            txn_produce_ahead_ms=c.txn_produce_ahead_ms,
            commit_max_records=c.commit_max_records,
            retry_backoff_s=c.retry_backoff_s,
            retry_backoff_max_s=c.retry_backoff_max_s,
            revoke_wait_s=c.revoke_wait_s,
            revoke_commit_s=revoke_commit_for(c),
            assign_wait_s=assign_wait_for(c),
            stop_wait_s=stop_wait_for(c),
            fence_recheck_s=c.fence_recheck_s,
            commit_timeout_s=c.commit_timeout_s,
            poll_timeout_ms=c.poll_timeout_ms,
            fetch_linger_ms=c.fetch_linger_ms,
            auto_offset_reset=c.auto_offset_reset,
            client_args=c.kafka_client_args(),
            consumer_args=c.kafka_consumer_args(),
        )
