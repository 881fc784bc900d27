"""Typed views of the custom resources the service reads (field names as in the CRDs).

Only the fields the CR slot logic uses (plus a few useful for logging) are declared;
msgspec ignores the rest, which keeps 50k Reservations cheap to hold in memory.
Resource maps are ``dict[str, Quantity]``: the API server sends int-or-string values,
:mod:`service.model.decode` turns both into :class:`~service.quantity.Quantity`.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from service.model.gonull import Uint64, check_uint64
from service.model.meta import Condition, K8sStruct, ObjectMeta
from service.quantity import ZERO, Quantity

__all__ = [
    "LABEL_RESERVATION_TYPE",
    "RESERVATION_TYPE_COMMITTED_RESOURCE",
    "CommittedResource",
    "CommittedResourceAllocation",
    "CommittedResourceReservationSpec",
    "CommittedResourceReservationStatus",
    "CommittedResourceSpec",
    "CommittedResourceStatus",
    "FlavorGroupFeature",
    "FlavorInGroup",
    "Hypervisor",
    "HypervisorStatus",
    "Knowledge",
    "KnowledgeStatus",
    "Reservation",
    "ReservationSpec",
    "ReservationStatus",
]

LABEL_RESERVATION_TYPE: Final = "reservations.cortex.cloud/type"
RESERVATION_TYPE_COMMITTED_RESOURCE: Final = "committed-resource"

ResourceMap = dict[str, Quantity]


# --- Hypervisor (kvm.cloud.sap/v1) ---------------------------------------------------


class HypervisorStatus(K8sStruct, frozen=True):
    # None (absent or null) and {} differ: the reference uses effectiveCapacity whenever
    # the map is non-nil, even when it is empty.
    capacity: ResourceMap | None = None
    effective_capacity: ResourceMap | None = None
    allocation: ResourceMap | None = None


class Hypervisor(K8sStruct, frozen=True):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    status: HypervisorStatus = msgspec.field(default_factory=HypervisorStatus)


# --- Reservation (cortex.cloud/v1alpha1) ---------------------------------------------


class CommittedResourceAllocation(K8sStruct, frozen=True):
    creation_timestamp: str | None = None
    resources: ResourceMap = {}


class CommittedResourceReservationSpec(K8sStruct, frozen=True):
    project_id: str = msgspec.field(default="", name="projectID")
    resource_group: str = ""
    resource_name: str | None = None
    commitment_uuid: str | None = msgspec.field(default=None, name="commitmentUUID")
    creator: str | None = None
    domain_id: str | None = msgspec.field(default=None, name="domainID")
    parent_generation: int | None = None
    allocations: dict[str, CommittedResourceAllocation] | None = None

    def matches_group(self, project_id: str, flavor_group: str) -> bool:
        return self.project_id == project_id and self.resource_group == flavor_group


class ReservationSpec(K8sStruct, frozen=True):
    type: str | None = None
    target_host: str = ""
    resources: ResourceMap | None = None
    committed_resource_reservation: CommittedResourceReservationSpec | None = None
    availability_zone: str | None = None
    scheduling_domain: str | None = None
    start_time: str | None = None
    end_time: str | None = None


class CommittedResourceReservationStatus(K8sStruct, frozen=True):
    allocations: dict[str, str] | None = None
    observed_parent_generation: int | None = None


class ReservationStatus(K8sStruct, frozen=True):
    conditions: list[Condition] | None = None
    host: str | None = None
    committed_resource_reservation: CommittedResourceReservationStatus | None = None


class Reservation(K8sStruct, frozen=True):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: ReservationSpec = msgspec.field(default_factory=ReservationSpec)
    status: ReservationStatus = msgspec.field(default_factory=ReservationStatus)

    @property
    def name(self) -> str:
        return self.metadata.name or ""


# --- CommittedResource (cortex.cloud/v1alpha1) ---------------------------------------


class CommittedResourceSpec(K8sStruct, frozen=True):
    project_id: str = msgspec.field(default="", name="projectID")
    flavor_group_name: str = ""
    state: str = ""
    amount: Quantity = ZERO
    resource_type: str | None = None
    availability_zone: str | None = None
    commitment_uuid: str | None = msgspec.field(default=None, name="commitmentUUID")
    domain_id: str | None = msgspec.field(default=None, name="domainID")
    scheduling_domain: str | None = None
    start_time: str | None = None
    end_time: str | None = None
    confirmed_at: str | None = None
    allow_rejection: bool | None = None


class CommittedResourceStatus(K8sStruct, frozen=True):
    used_resources: ResourceMap | None = None
    conditions: list[Condition] | None = None
    status_summary: str | None = None


class CommittedResource(K8sStruct, frozen=True):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: CommittedResourceSpec = msgspec.field(default_factory=CommittedResourceSpec)
    status: CommittedResourceStatus = msgspec.field(default_factory=CommittedResourceStatus)


# --- Knowledge (cortex.cloud/v1alpha1) and the flavor-group feature ------------------


class KnowledgeStatus(K8sStruct, frozen=True):
    conditions: list[Condition] | None = None
    # Free-form JSON ({"features": [...]}); decoded lazily by service.crs.flavors so a
    # malformed payload is a lookup *error*, not a failure to decode the Knowledge itself.
    raw: Any = None
    raw_length: int | None = None
    last_content_change: str | None = None
    last_extracted: str | None = None


class Knowledge(K8sStruct, frozen=True):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    status: KnowledgeStatus = msgspec.field(default_factory=KnowledgeStatus)


class FlavorInGroup(K8sStruct, frozen=True):
    # Go declares these uint64: a negative number or one above 2^64 - 1 makes the whole
    # payload invalid there.
    name: str = ""
    vcpus: Uint64 = 0
    memory_mb: Uint64 = msgspec.field(default=0, name="memoryMB")
    disk_gb: Uint64 = msgspec.field(default=0, name="diskGB")
    ephemeral_gb: Uint64 = msgspec.field(default=0, name="ephemeralGB")
    extra_specs: dict[str, str] | None = None

    def __post_init__(self) -> None:
        check_uint64(self.vcpus, self.memory_mb, self.disk_gb, self.ephemeral_gb)


class FlavorGroupFeature(K8sStruct, frozen=True):
    name: str = ""
    flavors: list[FlavorInGroup] = []
    largest_flavor: FlavorInGroup = msgspec.field(default_factory=FlavorInGroup)
    smallest_flavor: FlavorInGroup = msgspec.field(default_factory=FlavorInGroup)
    ram_core_ratio: Uint64 | None = None
    ram_core_ratio_min: Uint64 | None = None
    ram_core_ratio_max: Uint64 | None = None

    def __post_init__(self) -> None:
        check_uint64(self.ram_core_ratio, self.ram_core_ratio_min, self.ram_core_ratio_max)
