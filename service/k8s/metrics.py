"""Prometheus instrumentation of Kubernetes API calls.

Every call the service makes is counted by verb, kind and HTTP status (``"error"`` when
no status came back: timeouts, refused connections), so a dashboard can tell "the API
server is slow" from "we are being throttled" from "our RBAC is wrong" without logs.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram

__all__ = ["K8sMetrics"]

# The codes CrsKubernetesForbidden alerts on (deploy/monitoring/rules.yaml).
_REFUSALS = ("401", "403")

# API calls range from ~1 ms (a get) to seconds (a 50k-object list page set).
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class K8sMetrics:
    """``crs_k8s_requests_total{verb,kind,code}`` and ``crs_k8s_request_duration_seconds``.

    ``registry=None`` uses a fresh private registry (never the global default one), so
    creating several clients in one process cannot collide on metric names.
    """

    __slots__ = ("_seen", "duration", "requests")

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "crs_k8s_requests",
            "Kubernetes API requests by verb, resource kind and HTTP status code.",
            labelnames=("verb", "kind", "code"),
            registry=reg,
        )
        self.duration = Histogram(
            "crs_k8s_request_duration_seconds",
            "Duration of Kubernetes API requests (including reading the response body).",
            labelnames=("verb", "kind"),
            buckets=_BUCKETS,
            registry=reg,
        )
        self._seen: set[tuple[str, str]] = set()

    def expect(self, calls: Iterable[tuple[str, str]]) -> None:
        """Create the refusal series (401, 403) of these (verb, kind) pairs at 0.

        The CrsKubernetesForbidden alert takes increase() over them, and a series that
        appears with a burst of refusals already at its final value shows none: a new
        pod whose very first PATCH is refused (a Role without ``patch``) would never
        alert. Created before the first call, they are scraped at 0 first. Only the
        refusals: every code for every pair would flood the scrape for nothing.
        """
        for verb, kind in calls:
            if (verb, kind) not in self._seen:
                self._seen.add((verb, kind))
                for refused in _REFUSALS:
                    self.requests.labels(verb=verb, kind=kind, code=refused)

    def observe(self, verb: str, kind: str, code: int | str, seconds: float) -> None:
        """Record one finished request; ``code`` is the HTTP status or ``"error"``."""
        if (verb, kind) not in self._seen:  # a call not declared ahead: from now on
            self.expect(((verb, kind),))
        self.requests.labels(verb=verb, kind=kind, code=str(code)).inc()
        self.duration.labels(verb=verb, kind=kind).observe(seconds)
