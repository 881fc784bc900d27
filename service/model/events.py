"""The Kafka event contracts: a Nova scheduling outcome in, a CR classification out.

Both are CloudEvents 1.0 (structured mode on the wire, see :mod:`service.stream.codec` for
binary mode). The types are the single source of truth: the decoder validates against them
and ``schemas/*.schema.json`` are generated from them (:mod:`service.model.schemagen`), so
values the contract fixes are ``Literal`` types or, for the classification's vocabularies,
the enums of :mod:`service.model.vocabulary` that the domain outcome uses too; both show
up as ``enum`` in the schemas.
Class docstrings and ``Meta`` descriptions end up in those schemas, so they are written for
whoever consumes the topics, not for readers of this code.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

import msgspec

from service.model.nova import Decision, ExternalSchedulerRequest
from service.model.vocabulary import AllocationStatus, CrSlot, OutcomeKind

__all__ = [
    "AllocationStatus",
    "ClassificationData",
    "CrSlot",
    "InputEvent",
    "InputRef",
    "OutcomeData",
    "OutcomeKind",
    "OutputEvent",
]

SpecVersion = Literal["1.0"]
InputEventType = Literal["cortex.nova.scheduling_outcome.v1"]
OutputEventType = Literal["cortex.crs.classification.v1"]
OutputSource = Literal["crs-consumer"]
OutputContentType = Literal["application/json"]

# RFC 3339 requires an offset; a naive timestamp is ambiguous and rejected.
Timestamp = Annotated[datetime, msgspec.Meta(tz=True, description="RFC 3339 timestamp")]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
Uuid = Annotated[str, msgspec.Meta(description="Nova instance UUID")]


class OutcomeData(msgspec.Struct, kw_only=True, frozen=True):
    """Payload of a scheduling outcome: Nova's request and the scheduler's decision."""

    decision: Decision
    request: Annotated[
        ExternalSchedulerRequest,
        msgspec.Meta(
            description="The request exactly as Nova sends it to its external scheduler; "
            "fields not listed here are allowed and ignored."
        ),
    ]


class InputEvent(msgspec.Struct, kw_only=True, frozen=True):
    """A Nova scheduling outcome (CloudEvents 1.0, structured mode).

    Topic default ``nova.scheduling-outcomes``; record key = instance UUID. Unknown
    attributes (CloudEvents extensions) are ignored.
    """

    specversion: SpecVersion
    id: Annotated[NonEmpty, msgspec.Meta(description="Unique per source; replays keep it")]
    source: NonEmpty
    type: InputEventType
    time: Timestamp | None = None
    subject: Annotated[
        str | None, msgspec.Meta(description="Instance UUID; must match the request's")
    ] = None
    datacontenttype: str | None = None
    data: OutcomeData


class InputRef(msgspec.Struct, kw_only=True, frozen=True):
    """Where the classified input record was read from.

    ``id`` is the input event's CloudEvents id. The consumer builds the reference before
    the value is decoded, so ``id`` may be empty there; a classification event always
    carries it.
    """

    id: Annotated[str, msgspec.Meta(description="The input event's CloudEvents id")] = ""
    topic: str
    partition: Annotated[int, msgspec.Meta(ge=0)]
    offset: Annotated[int, msgspec.Meta(ge=0)]


class ClassificationData(msgspec.Struct, kw_only=True, frozen=True):
    """The classification of one scheduling outcome against committed-resource slots.

    Every field is always present; "not applicable" is an explicit ``null``.
    """

    input: InputRef
    kind: OutcomeKind
    cr_slot: CrSlot
    instance_uuid: Uuid
    project_id: str
    flavor_name: str
    flavor_group: Annotated[str | None, msgspec.Meta(description="null for PAYG")]
    intent: str
    target_host: Annotated[str | None, msgspec.Meta(description="null when no host was found")]
    reservation: Annotated[
        str | None,
        msgspec.Meta(description="The Reservation slot written or already holding the VM"),
    ]
    allocation: AllocationStatus
    vm_memory_bytes: Annotated[int | None, msgspec.Meta(description="null when unknown")]


class OutputEvent(msgspec.Struct, kw_only=True, frozen=True):
    """A CR classification (CloudEvents 1.0, structured mode).

    Topic default ``cortex.crs.classifications``; record key = instance UUID. ``id`` is a
    UUIDv5 of the input event's id, so a replayed input yields the same output id and
    consumers can de-duplicate on it.
    """

    specversion: SpecVersion
    id: str
    source: OutputSource
    type: OutputEventType
    time: Annotated[Timestamp, msgspec.Meta(description="Processing time")]
    subject: Uuid
    datacontenttype: OutputContentType
    data: ClassificationData
