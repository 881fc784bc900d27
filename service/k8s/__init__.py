"""Kubernetes access: the async client, error mapping, metrics and the list-mode state.

This is the only package that imports kubernetes_asyncio; everything above it sees the
:class:`~service.crs.ports.ClusterState` protocol and the ports error types.

One responsibility per module: ``client`` is the transport (requests, list pages, the
watch stream, with timeouts, metrics and error mapping), ``errors`` the mapping itself,
``metrics`` the request metrics; ``state`` is the list-mode ClusterState. Watch mode:
``informer`` runs the list/watch protocol for one kind over a small transport protocol,
``store`` keeps its objects (newer resourceVersion wins), ``indexes`` turns their
changes into what a request reads, and ``cache`` is the ClusterState on top.
"""

from service.k8s.client import (
    COMMITTED_RESOURCES,
    CR_RESERVATION_SELECTOR,
    HYPERVISORS,
    KNOWLEDGES,
    RESERVATIONS,
    RESOURCE_KINDS,
    KubeClient,
    ListResult,
    ResourceKind,
)
from service.k8s.errors import error_for_status, map_exception
from service.k8s.metrics import K8sMetrics
from service.k8s.state import ListClusterState

__all__ = [
    "COMMITTED_RESOURCES",
    "CR_RESERVATION_SELECTOR",
    "HYPERVISORS",
    "KNOWLEDGES",
    "RESERVATIONS",
    "RESOURCE_KINDS",
    "K8sMetrics",
    "KubeClient",
    "ListClusterState",
    "ListResult",
    "ResourceKind",
    "error_for_status",
    "map_exception",
]
