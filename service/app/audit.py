"""The allocation invariant monitor's two faces: the service's tick and ``crs-consumer audit``.

In the service (watch mode) :class:`~service.k8s.cache.WatchClusterState` feeds every
CR Reservation change into its :class:`~service.crs.invariants.InvariantIndex`;
:func:`watch_invariants` ticks it once a second (so a VM listed twice is reported once
the grace has passed, with no further event), sets the gauge
``crs_allocation_invariant_violations{kind}`` and logs one bounded line per kind whose
set of objects changed. In list mode there is no cache to watch and no monitor (the
gauge has no series): run ``crs-consumer audit`` instead, e.g. as a CronJob.

``crs-consumer audit`` lists the CR Reservations once (paged, the same client settings
as ``check``), runs the same index over them and prints a table or ``--json``. It has no
history: the grace of ``vm_in_multiple_slots`` counts from the allocations'
``creationTimestamp``. Exit codes: 0 nothing found, 1 violations found, 2 the API server
could not be read (or the configuration is unusable). It never writes.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any, Final, TextIO

import structlog
from prometheus_client import Gauge

from service.app.config import Config
from service.crs.invariants import KINDS, InvariantIndex, Violation, audit

__all__ = ["EXIT_CLEAN", "EXIT_ERROR", "EXIT_FOUND", "report", "run_audit", "watch_invariants"]

log = structlog.get_logger(__name__)

EXIT_CLEAN = 0
EXIT_FOUND = 1
EXIT_ERROR = 2

# Objects named per log line (the count says how many there are in all).
LOG_NAMES: Final = 10
_TICK_S: Final = 1.0


def report(index: InvariantIndex, gauge: Gauge) -> None:
    """One tick: let the grace pass, set the gauge, log each kind whose set changed."""
    index.evaluate()
    counts = index.counts()
    for kind in KINDS:
        gauge.labels(kind).set(counts[kind])
    for kind in sorted(index.take_changed()):
        count = counts[kind]
        sample = index.violations(kind, limit=LOG_NAMES)
        emit = log.warning if count else log.info
        emit(
            "allocation_invariant_violations",
            kind=str(kind),
            count=count,
            objects=[_line(v) for v in sample],
            more=max(count - len(sample), 0),
        )


def _line(v: Violation) -> str:
    if v.reservations == (v.object,):
        return f"{v.object}: {v.detail}"
    return f"{v.object}: {', '.join(v.reservations[:4])}" + (
        f" and {len(v.reservations) - 4} more" if len(v.reservations) > 4 else ""
    )


async def watch_invariants(
    index: InvariantIndex, gauge: Gauge, interval_s: float = _TICK_S
) -> None:
    """The service's monitor loop (a runtime task, cancelled at stop)."""
    while True:
        try:
            report(index, gauge)
        except Exception:  # a bug here must not end the monitor silently
            log.error("invariant_monitor_failed", exc_info=True)
        await asyncio.sleep(interval_s)


# --------------------------------------------------------------------------- the CLI


async def run_audit(config: Config, *, as_json: bool = False, out: TextIO = sys.stdout) -> int:
    """``crs-consumer audit``: one pass over the cluster's CR Reservations."""
    from service.app.check import _describe_k8s
    from service.k8s import KubeClient
    from service.k8s.client import CR_RESERVATION_SELECTOR, RESERVATIONS
    from service.model import Reservation

    def fail(text: str) -> int:
        print(f"crs-consumer audit: FAILED: {text}", file=sys.stderr)
        return EXIT_ERROR

    source = f"KUBECONFIG={config.kubeconfig}" if config.kubeconfig else "in-cluster"
    if not config.kubeconfig and not os.environ.get("KUBERNETES_SERVICE_HOST"):
        return fail("KUBECONFIG is unset and this is not a pod: set KUBECONFIG")
    try:
        client = await KubeClient.create(config.kubeconfig, request_timeout_s=config.k8s_timeout_s)
    except Exception as exc:  # a bad kubeconfig or no service account
        return fail(f"{source} is not usable: {type(exc).__name__}: {exc}")
    try:
        listed = await client.list_objects(
            RESERVATIONS,
            Reservation,
            label_selector=CR_RESERVATION_SELECTOR,
            limit=config.k8s_page_size,
        )
    except Exception as exc:  # unreachable, unauthenticated, forbidden, CRD missing
        return fail(f"listing reservations: {_describe_k8s(exc, client)}")
    finally:
        await client.close()
    index = audit(
        listed.items, listed.undecodable, grace_s=config.invariant_grace_s, now=time.time()
    )
    found = [v for kind in KINDS for v in index.violations(kind)]
    counts = index.counts()
    checked = len(listed.items) + len(listed.undecodable)
    if as_json:
        doc: dict[str, Any] = {
            "checked": checked,
            "grace_s": config.invariant_grace_s,
            "grace_from": "creationTimestamp",
            "counts": {str(k): counts[k] for k in KINDS},
            "violations": [
                {
                    "kind": str(v.kind),
                    "object": v.object,
                    "reservations": list(v.reservations),
                    "detail": v.detail,
                }
                for v in found
            ],
        }
        print(json.dumps(doc, indent=2), file=out)
    else:
        _table(found, out)
        summary = ", ".join(f"{k}={counts[k]}" for k in KINDS)
        print(
            f"{checked} committed-resource reservations checked; {summary} "
            f"(one-shot: the {config.invariant_grace_s:g}s grace of vm_in_multiple_slots "
            "counts from the allocations' creationTimestamp)",
            file=out,
        )
    return EXIT_FOUND if found else EXIT_CLEAN


def _table(found: list[Violation], out: TextIO) -> None:
    if not found:
        return
    rows = [("KIND", "OBJECT", "RESERVATIONS", "DETAIL")]
    rows += [(str(v.kind), v.object, ",".join(v.reservations), v.detail) for v in found]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)), r[3], file=out)
