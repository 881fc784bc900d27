"""Kubernetes access: the async client, error mapping, metrics and the list-mode state.

This is the only package that imports kubernetes_asyncio; everything above it sees the
:class:`~service.crs.ports.ClusterState` protocol and the ports error types.
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
