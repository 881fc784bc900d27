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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from service.crs import new_no_host_found_counter, new_placement_counter
from service.stream.deferred import DeferredCounter

__all__ = ["StreamMetrics"]

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
            "Records between the committed position and the high watermark",
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
        for reason in ("transient", "record_too_large", "authorization", "fenced"):
            self.commit_failures.labels(reason)
        self.fenced = Counter(
            "crs_fenced",
            "Input partitions whose producer was fenced by a newer owner (work dropped)",
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

    def forget_partition(self, topic: str, partition: int) -> None:
        for gauge in (self.lag, self.stalled, self.in_flight):
            with contextlib.suppress(KeyError):
                gauge.remove(topic, str(partition))
