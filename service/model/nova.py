"""The request Nova sends to the external scheduler, and the scheduling decision.

Nova serialises its objects as ``{"nova_object.data": {...}, "nova_object.name": ...}``;
the keys contain dots, so every wrapped field is named explicitly. Only what the CR logic
needs is declared; everything else in the (large) request spec is ignored on decode.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

__all__ = [
    "Decision",
    "DecisionResult",
    "ExternalSchedulerHost",
    "ExternalSchedulerOptions",
    "ExternalSchedulerRequest",
    "NovaFlavor",
    "NovaObject",
    "NovaRequestContext",
    "NovaSpec",
]

T = TypeVar("T")


class _NovaStruct(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """Base for Nova wire types: snake_case keys exactly as Nova sends them."""


class NovaObject(_NovaStruct, Generic[T], frozen=True):
    data: T = msgspec.field(name="nova_object.data")
    name: str | None = msgspec.field(default=None, name="nova_object.name")
    namespace: str | None = msgspec.field(default=None, name="nova_object.namespace")
    version: str | None = msgspec.field(default=None, name="nova_object.version")
    changes: list[str] | None = msgspec.field(default=None, name="nova_object.changes")


class NovaFlavor(_NovaStruct, frozen=True):
    name: str = ""
    memory_mb: int = 0
    vcpus: int = 0
    root_gb: int = 0
    ephemeral_gb: int = 0
    swap: int = 0
    flavorid: str | None = None
    id: int | None = None
    extra_specs: dict[str, str] | None = None


class NovaSpec(_NovaStruct, frozen=True):
    project_id: str = ""
    user_id: str | None = None
    instance_uuid: str = ""
    availability_zone: str | None = None
    num_instances: int = 1
    # Values are a string or a one-element list, depending on the Nova code path.
    scheduler_hints: dict[str, Any] | None = None
    flavor: NovaObject[NovaFlavor] | None = None
    ignore_hosts: list[str] | None = None
    force_hosts: list[str] | None = None
    force_nodes: list[str] | None = None


class NovaRequestContext(_NovaStruct, frozen=True):
    # Often stripped (the reference example has ``context: {}``), so all optional.
    project_id: str | None = None
    user_id: str | None = msgspec.field(default=None, name="user")
    request_id: str | None = None
    global_request_id: str | None = None
    project_name: str | None = None
    user_name: str | None = None


class ExternalSchedulerHost(_NovaStruct, frozen=True):
    host: str
    hypervisor_hostname: str | None = None


class ExternalSchedulerOptions(_NovaStruct, frozen=True):
    skip_committed_resource_tracking: bool = False


class ExternalSchedulerRequest(_NovaStruct, frozen=True):
    spec: NovaObject[NovaSpec]
    context: NovaRequestContext = msgspec.field(default_factory=NovaRequestContext)
    hosts: list[ExternalSchedulerHost] = []
    weights: dict[str, float] = {}
    pipeline: str | None = None
    live: bool = False
    rebuild: bool = False
    resize: bool = False
    vmware: bool = False
    options: ExternalSchedulerOptions = msgspec.field(default_factory=ExternalSchedulerOptions)

    @property
    def project_id(self) -> str:
        """The project whose committed resources apply to this request.

        The reference recorder reads ``context.project_id``, so that wins whenever Nova
        sends it. Samples with a stripped context (``context: {}``, as in the reference
        example) would otherwise match no commitment at all, so the spec's
        ``project_id`` (the instance owner) is the fallback.
        """
        return self.context.project_id or self.spec.data.project_id

    @property
    def context_project_id(self) -> str:
        """``context.project_id`` exactly as the Go recorder uses it ("" when absent)."""
        return self.context.project_id or ""

    @property
    def instance_uuid(self) -> str:
        return self.spec.data.instance_uuid

    @property
    def flavor_name(self) -> str:
        flavor = self.spec.data.flavor
        return flavor.data.name if flavor is not None else ""

    @property
    def input_hosts(self) -> list[str]:
        """The compute host names Nova offered, in request order (Go's ``GetHosts``)."""
        return [h.host for h in self.hosts]


class DecisionResult(msgspec.Struct, kw_only=True, frozen=True, rename="camel", omit_defaults=True):
    # target_host None means "no host found".
    target_host: str | None = None
    ordered_hosts: list[str] = []


class Decision(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """The outcome of one scheduling request, as the recorder consumes it."""

    result: DecisionResult
    name: str | None = None
    intent: str | None = None
