"""The request Nova sends to the external scheduler, and the scheduling decision.

Nova serialises its objects as ``{"nova_object.data": {...}, "nova_object.name": ...}``;
the keys contain dots, so every wrapped field is named explicitly. Only what the CR logic
needs is declared; everything else in the (large) request spec is ignored on decode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec
from msgspec.structs import force_setattr

from service.model.gonull import GoNull, Int64, Uint64, check_uint64

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

# A default of None for a field typed ``T``: the value is replaced in __post_init__.
_NULL: Any = None


def _nulls_to(items: list[Any], zero: Callable[[], Any]) -> list[Any]:
    return [zero() if item is None else item for item in items]


class _NovaStruct(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """Base for Nova wire types: snake_case keys exactly as Nova sends them.

    Every field of the Go request types is optional and a ``null`` anywhere decodes as the
    zero value (:mod:`service.model.gonull`); fields typed :data:`GoNull` get that value
    in ``__post_init__``. A value of the wrong type is still an error, as in Go.
    """


class NovaObject(_NovaStruct, Generic[T], frozen=True):
    # Absent or null data is the zero value of T; the owner of the field fills it in
    # (a generic instance does not know its T at runtime).
    data: GoNull[T] = msgspec.field(default=_NULL, name="nova_object.data")
    name: str | None = msgspec.field(default=None, name="nova_object.name")
    namespace: str | None = msgspec.field(default=None, name="nova_object.namespace")
    version: str | None = msgspec.field(default=None, name="nova_object.version")
    changes: list[str | None] | None = msgspec.field(default=None, name="nova_object.changes")


class NovaFlavor(_NovaStruct, frozen=True):
    name: GoNull[str] = ""
    memory_mb: GoNull[Uint64] = 0
    vcpus: GoNull[Uint64] = 0
    root_gb: GoNull[Uint64] = 0
    ephemeral_gb: GoNull[Uint64] = 0
    swap: GoNull[Int64] = 0
    flavorid: str | None = None
    id: Int64 | None = None
    extra_specs: dict[str, str | None] | None = None

    def __post_init__(self) -> None:
        # One tuple test on the common path; the loop only runs when a null was sent.
        if None in (self.name, self.memory_mb, self.vcpus, self.root_gb, self.ephemeral_gb):
            for field, zero in (
                ("name", ""),
                ("memory_mb", 0),
                ("vcpus", 0),
                ("root_gb", 0),
                ("ephemeral_gb", 0),
            ):
                if getattr(self, field) is None:
                    force_setattr(self, field, zero)
        if _is_null(self.swap):
            force_setattr(self, "swap", 0)
        check_uint64(self.memory_mb, self.vcpus, self.root_gb, self.ephemeral_gb)


class NovaSpec(_NovaStruct, frozen=True):
    project_id: GoNull[str] = ""
    user_id: str | None = None
    instance_uuid: GoNull[str] = ""
    availability_zone: str | None = None
    num_instances: GoNull[Uint64] = 0
    # Values are a string or a one-element list, depending on the Nova code path.
    scheduler_hints: dict[str, Any] | None = None
    flavor: NovaObject[NovaFlavor] | None = None
    ignore_hosts: list[str | None] | None = None
    force_hosts: list[str | None] | None = None
    force_nodes: list[str | None] | None = None

    def __post_init__(self) -> None:
        if _is_null(self.project_id):
            force_setattr(self, "project_id", "")
        if _is_null(self.instance_uuid):
            force_setattr(self, "instance_uuid", "")
        if _is_null(self.num_instances):
            force_setattr(self, "num_instances", 0)
        check_uint64(self.num_instances)
        if self.flavor is not None and _is_null(self.flavor.data):
            force_setattr(self.flavor, "data", NovaFlavor())


class NovaRequestContext(_NovaStruct, frozen=True):
    # Often stripped (the reference example has ``context: {}``), so all optional.
    project_id: str | None = None
    user_id: str | None = msgspec.field(default=None, name="user")
    request_id: str | None = None
    global_request_id: str | None = None
    project_name: str | None = None
    user_name: str | None = None


class ExternalSchedulerHost(_NovaStruct, frozen=True):
    # None stands for Go's "" (a null or absent host): checking hundreds of hosts per
    # request in __post_init__ would cost more than reading them through input_hosts.
    host: str | None = None
    hypervisor_hostname: str | None = None


class ExternalSchedulerOptions(_NovaStruct, frozen=True):
    skip_committed_resource_tracking: GoNull[bool] = False

    def __post_init__(self) -> None:
        if _is_null(self.skip_committed_resource_tracking):
            force_setattr(self, "skip_committed_resource_tracking", False)


def _zero_spec() -> NovaObject[NovaSpec]:
    return NovaObject(data=NovaSpec())


def _is_null(value: object) -> bool:
    # Takes ``object`` so that checking a GoNull field for None type-checks.
    return value is None


class ExternalSchedulerRequest(_NovaStruct, frozen=True):
    spec: GoNull[NovaObject[NovaSpec]] = msgspec.field(default_factory=_zero_spec)
    context: GoNull[NovaRequestContext] = msgspec.field(default_factory=NovaRequestContext)
    # A Go encoder writes nil slices and maps as null.
    hosts: GoNull[list[GoNull[ExternalSchedulerHost]]] = []
    weights: GoNull[dict[str, GoNull[float]]] = {}
    pipeline: str | None = None
    # live, rebuild, resize, vmware: sent by Nova, not fields of the reference's request
    # type, so not fields here either. Go skips them unread whatever their value; a typed
    # field made a number msgspec refuses there (1e309) a dead letter.
    options: GoNull[ExternalSchedulerOptions] = msgspec.field(
        default_factory=ExternalSchedulerOptions
    )

    def __post_init__(self) -> None:
        if _is_null(self.spec):
            force_setattr(self, "spec", _zero_spec())
        elif _is_null(self.spec.data):
            force_setattr(self.spec, "data", NovaSpec())
        if _is_null(self.context):
            force_setattr(self, "context", NovaRequestContext())
        if _is_null(self.options):
            force_setattr(self, "options", ExternalSchedulerOptions())
        hosts: list[Any] | None = self.hosts
        if hosts is None:
            force_setattr(self, "hosts", [])
        elif None in hosts:
            force_setattr(self, "hosts", _nulls_to(hosts, ExternalSchedulerHost))
        weights: dict[str, Any] | None = self.weights
        if weights is None:
            force_setattr(self, "weights", {})
        elif None in weights.values():
            force_setattr(self, "weights", {k: 0.0 if w is None else w for k, w in weights.items()})

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
        """The compute host names Nova offered, in request order (Go's ``GetHosts``).

        A null or absent ``host`` is Go's zero value, "".
        """
        return [h.host or "" for h in self.hosts]


class DecisionResult(msgspec.Struct, kw_only=True, frozen=True, rename="camel", omit_defaults=True):
    # Absent or null means "no host found"; "" is a placement on the host named "" (the
    # reference tests the pointer for nil, not the string for emptiness).
    target_host: str | None = None
    ordered_hosts: GoNull[list[GoNull[str]]] = []

    def __post_init__(self) -> None:
        hosts: list[Any] | None = self.ordered_hosts
        if hosts is None:
            force_setattr(self, "ordered_hosts", [])
        elif None in hosts:
            force_setattr(self, "ordered_hosts", _nulls_to(hosts, str))


class Decision(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """The outcome of one scheduling request, as the recorder consumes it."""

    result: DecisionResult
    name: str | None = None
    intent: str | None = None
