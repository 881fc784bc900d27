"""The two Prometheus counters of the CR recorder (names and label order are fixed).

prometheus_client appends ``_total`` to counter names, so the counters are created as
``cortex_nova_placement`` / ``cortex_nova_no_host_found`` and exposed exactly as the Go
service exposes them: ``cortex_nova_placement_total`` / ``cortex_nova_no_host_found_total``.

With ``registry=None`` the counter goes into a fresh private ``CollectorRegistry``, never
into the global default one: tests and benchmarks create many counters, and registering
a name twice in one registry raises. Pass the application's registry explicitly.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter

__all__ = [
    "NO_HOST_FOUND_LABELS",
    "PLACEMENT_LABELS",
    "new_no_host_found_counter",
    "new_placement_counter",
]

PLACEMENT_LABELS: Final = ("flavor_group", "intent", "cr_slot")
NO_HOST_FOUND_LABELS: Final = ("cr_slot", "flavor_group", "intent")


def new_placement_counter(registry: CollectorRegistry | None = None) -> Counter:
    return Counter(
        "cortex_nova_placement",
        "Successful Nova placements by committed resource slot outcome.",
        labelnames=list(PLACEMENT_LABELS),
        registry=registry if registry is not None else CollectorRegistry(),
    )


def new_no_host_found_counter(registry: CollectorRegistry | None = None) -> Counter:
    return Counter(
        "cortex_nova_no_host_found",
        "Nova no-host-found results classified by committed resource coverage "
        "(no_cr/cr_exhausted/slot_exhausted/slot_blocked/error).",
        labelnames=list(NO_HOST_FOUND_LABELS),
        registry=registry if registry is not None else CollectorRegistry(),
    )
