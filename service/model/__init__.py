"""Typed wire models: Kubernetes custom resources and Nova scheduler messages.

Decode only through :func:`from_k8s` so quantities and errors are handled uniformly.
"""

from service.model.decode import DecodeError, encode_k8s, from_k8s, to_k8s
from service.model.k8s import (
    LABEL_RESERVATION_TYPE,
    RESERVATION_TYPE_COMMITTED_RESOURCE,
    CommittedResource,
    CommittedResourceAllocation,
    CommittedResourceReservationSpec,
    CommittedResourceReservationStatus,
    CommittedResourceSpec,
    CommittedResourceStatus,
    FlavorGroupFeature,
    FlavorInGroup,
    Hypervisor,
    HypervisorStatus,
    Knowledge,
    KnowledgeStatus,
    Reservation,
    ReservationSpec,
    ReservationStatus,
)
from service.model.meta import Condition, ObjectMeta, find_condition, is_condition_true
from service.model.nova import (
    Decision,
    DecisionResult,
    ExternalSchedulerHost,
    ExternalSchedulerOptions,
    ExternalSchedulerRequest,
    NovaFlavor,
    NovaObject,
    NovaRequestContext,
    NovaSpec,
)

__all__ = [
    "LABEL_RESERVATION_TYPE",
    "RESERVATION_TYPE_COMMITTED_RESOURCE",
    "CommittedResource",
    "CommittedResourceAllocation",
    "CommittedResourceReservationSpec",
    "CommittedResourceReservationStatus",
    "CommittedResourceSpec",
    "CommittedResourceStatus",
    "Condition",
    "Decision",
    "DecisionResult",
    "DecodeError",
    "ExternalSchedulerHost",
    "ExternalSchedulerOptions",
    "ExternalSchedulerRequest",
    "FlavorGroupFeature",
    "FlavorInGroup",
    "Hypervisor",
    "HypervisorStatus",
    "Knowledge",
    "KnowledgeStatus",
    "NovaFlavor",
    "NovaObject",
    "NovaRequestContext",
    "NovaSpec",
    "ObjectMeta",
    "Reservation",
    "ReservationSpec",
    "ReservationStatus",
    "encode_k8s",
    "find_condition",
    "from_k8s",
    "is_condition_true",
    "to_k8s",
]
