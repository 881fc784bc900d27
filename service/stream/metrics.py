"""Service metrics beside the two reference counters.

The counters of decided events (the two reference counters, events, allocations, dead
letters, conflicts) are :class:`~service.stream.deferred.DeferredCounter`: in the stream
engine they advance when the event's transaction commits, so nothing is counted twice.

All series live in one registry the HTTP server exposes. Per-partition series (lag) are
removed when a partition is revoked, so a scrape never shows a stale partition's lag
from before a rebalance.
"""

from __future__ import annotations

import contextlib
import platform
from importlib import metadata

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    gc_collector,
    platform_collector,
    process_collector,
)

from service.crs import new_no_host_found_counter, new_placement_counter
from service.crs.outcome import AllocationStatus
from service.model import CrSlot, OutcomeKind
from service.stream.codec import OUTPUT_REJECTED, POISON_CODES
from service.stream.deferred import DeferredCounter

__all__ = [
    "COMMIT_FAILURE_REASONS",
    "DEAD_LETTER_CODES",
    "DEPENDENCIES",
    "EVENT_SERIES",
    "RETRY_REASONS",
    "StreamMetrics",
    "service_version",
]

# Known label values, pre-created at zero so that rate() and increase() see a series
# from the first scrape on (an alert on a counter that appears at 1 never fires).
RETRY_REASONS = ("k8s_unavailable", "k8s_forbidden", "kafka_commit")
DEAD_LETTER_CODES = (
    *POISON_CODES,
    "retries_exhausted",
    "k8s_error",
    "internal_error",
    OUTPUT_REJECTED,
)
COMMIT_FAILURE_REASONS = ("transient", "record_too_large", "authorization", "fenced")
DEPENDENCIES = ("kafka", "kubernetes")
# The kinds and cr_slots that can occur together (a no-host-found outcome is never
# slot_used/slot_missed; a placement never cr_exhausted/slot_exhausted/slot_blocked).
_PLACEMENT_SLOTS = (
    CrSlot.NO_CR,
    CrSlot.SLOT_USED,
    CrSlot.SLOT_MISSED,
    CrSlot.ERROR,
    CrSlot.PAYG,
    CrSlot.SKIPPED,
)
_NO_HOST_FOUND_SLOTS = (
    CrSlot.NO_CR,
    CrSlot.CR_EXHAUSTED,
    CrSlot.SLOT_BLOCKED,
    CrSlot.SLOT_EXHAUSTED,
    CrSlot.ERROR,
    CrSlot.PAYG,
    CrSlot.SKIPPED,
)
EVENT_SERIES: tuple[tuple[OutcomeKind, CrSlot], ...] = (
    *((OutcomeKind.PLACEMENT, s) for s in _PLACEMENT_SLOTS),
    *((OutcomeKind.NO_HOST_FOUND, s) for s in _NO_HOST_FOUND_SLOTS),
)


def service_version() -> str:
    try:
        return metadata.version("crs-consumer")
    except metadata.PackageNotFoundError:  # running from a source tree without install
        return "0+unknown"


# Per-event processing is ~0.2 ms from the watch cache, seconds when the API is slow.
_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
)


class StreamMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.placement = DeferredCounter(new_placement_counter(r))
        self.no_host_found = DeferredCounter(new_no_host_found_counter(r))
        self.events = DeferredCounter(
            Counter(
                "crs_events",
                "Input events processed, by outcome kind and cr_slot",
                ["kind", "cr_slot"],
                registry=r,
            )
        )
        self.allocations = DeferredCounter(
            Counter(
                "crs_allocations", "Allocation results for processed events", ["status"], registry=r
            )
        )
        self.dead_letters = DeferredCounter(
            Counter(
                "crs_dead_letters",
                "Events sent to the dead-letter topic, by error code",
                ["code"],
                registry=r,
            )
        )
        self.retries = Counter(
            "crs_retries", "Events or batches retried, by reason", ["reason"], registry=r
        )
        self.conflicts = DeferredCounter(
            Counter(
                "crs_patch_conflicts",
                "Reservation patches rejected with 409 and re-decided",
                registry=r,
            )
        )
        self.processing = Histogram(
            "crs_processing_seconds",
            "Time to process one input event (decode to outcome)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.commit = Histogram(
            "crs_commit_seconds",
            "Time to produce a batch's records and commit its offsets",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.lag = Gauge(
            "crs_consumer_lag",
            "Records between the committed position and the last stable offset",
            ["topic", "partition"],
            registry=r,
        )
        self.assigned = Gauge(
            "crs_assigned_partitions", "Input partitions assigned to this replica", registry=r
        )
        self.commit_failures = Counter(
            "crs_commit_failures",
            "Partition commits (transactions) that failed, by reason",
            ["reason"],
            registry=r,
        )
        self.opened_ahead = Counter(
            "crs_txn_opened_ahead",
            "Transactions a partition opened while its records waited on the Kubernetes "
            "API, by how they ended (committed, or aborted: nothing decided in time, or "
            "an output produced ahead discarded)",
            ["outcome"],
            registry=r,
        )
        for outcome in ("committed", "aborted"):
            self.opened_ahead.labels(outcome)
        self.produced_ahead = Counter(
            "crs_outputs_produced_ahead",
            "Placements' classifications produced into a transaction opened ahead while "
            "their allocation writes were in flight (CRS_TXN_PRODUCE_AHEAD_MS): published "
            "with their commit, or discarded with the transaction (the decision ended "
            "otherwise, another record was decided first, or no answer in time)",
            ["outcome"],
            registry=r,
        )
        for outcome in ("published", "discarded"):
            self.produced_ahead.labels(outcome)
        self.fenced = Counter(
            "crs_fenced",
            "Input partitions whose producer was fenced by a newer owner (work dropped)",
            registry=r,
        )
        self.client_restarts = Counter(
            "crs_kafka_client_restarts",
            "In-process restarts of the Kafka clients after one of aiokafka's background "
            "tasks ended (group coordination, heartbeat, fetch, metadata)",
            registry=r,
        )
        self.stable_offset_stuck = Gauge(
            "crs_input_stable_offset_stuck_seconds",
            "Seconds the input partition's last stable offset has stayed behind its high "
            "watermark without moving: a producer's transaction open that long holds the "
            "records behind it back from this read_committed consumer (lag reads 0)",
            ["topic", "partition"],
            registry=r,
        )
        self.offset_resets = Counter(
            "crs_offset_resets",
            "Input partitions whose fetch Kafka reset below the committed offset (the log "
            "truncated or the topic recreated): processed again from the reset offset",
            ["topic", "partition"],
            registry=r,
        )
        self.offset_reset_time = Gauge(
            "crs_offset_reset_timestamp_seconds",
            "When Kafka last reset the input partition's fetch below the committed offset "
            "(Unix time; the alert's clock: the counter's first reset is often its first "
            "sample)",
            ["topic", "partition"],
            registry=r,
        )
        self.stalled = Gauge(
            "crs_partition_stalled",
            "1 while an assigned partition cannot make progress (commit or producer failing)",
            ["topic", "partition"],
            registry=r,
        )
        self.in_flight = Gauge(
            "crs_partition_in_flight",
            "Records of a partition received but not yet committed",
            ["topic", "partition"],
            registry=r,
        )

        self._init_operability(r)

    def _init_operability(self, r: CollectorRegistry) -> None:
        # Process (CPU, memory, fds) and Python platform/GC series, as the default
        # registry would have them: the service uses its own registry.
        process_collector.ProcessCollector(registry=r)
        platform_collector.PlatformCollector(registry=r)
        gc_collector.GCCollector(registry=r)
        self.build_info = Info("crs_build", "Version of the running crs-consumer", registry=r)
        self.build_info.info({"version": service_version(), "python": platform.python_version()})
        self.dependency_up = Gauge(
            "crs_dependency_up",
            "1 when the last check of the dependency succeeded, else 0",
            ["dependency"],
            registry=r,
        )
        self.ready = Gauge(
            "crs_ready",
            "1 while /readyz answers 200, else 0 (the reason is in /readyz)",
            registry=r,
        )
        self.watch_last_activity = Gauge(
            "crs_watch_last_activity_timestamp_seconds",
            "Unix time of the last event, bookmark or renewal of each watch",
            ["kind"],
            registry=r,
        )
        # Set by the runtime's invariant monitor (watch mode only: without the watch
        # cache there is nothing to monitor, and a 0 would claim a clean cluster).
        self.invariant_violations = Gauge(
            "crs_allocation_invariant_violations",
            "Objects currently violating an allocation invariant, by kind (VM UUIDs for "
            "vm_in_multiple_slots, Reservations for the others; watch mode only)",
            ["kind"],
            registry=r,
        )
        for reason in RETRY_REASONS:
            self.retries.labels(reason)
        for code in DEAD_LETTER_CODES:
            self.dead_letters.labels(code)
        for status in AllocationStatus:
            self.allocations.labels(str(status))
        for kind, cr_slot in EVENT_SERIES:
            self.events.labels(kind, cr_slot)
        for reason in COMMIT_FAILURE_REASONS:
            self.commit_failures.labels(reason)
        for dep in DEPENDENCIES:
            self.dependency_up.labels(dep)

    @property
    def _per_partition(self) -> tuple[Gauge, ...]:
        """The gauges with a series per assigned partition (one list: forgetting a
        partition and forgetting them all must not drift apart)."""
        return (self.lag, self.stalled, self.in_flight, self.stable_offset_stuck)

    def forget_partition(self, topic: str, partition: int) -> None:
        for gauge in self._per_partition:
            with contextlib.suppress(KeyError):
                gauge.remove(topic, str(partition))

    def forget_partitions(self) -> None:
        """Every partition's series, and none assigned: the engine has closed."""
        for gauge in self._per_partition:
            gauge.clear()
        self.assigned.set(0)
