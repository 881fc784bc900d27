"""The closed vocabularies of a classification: one type each, for the domain and the wire.

The domain outcome (:class:`service.crs.outcome.Outcome`) and the classification event
(:class:`service.model.events.ClassificationData`) use these same enums, so mypy proves that
whatever the Recorder decides is on the published contract; msgspec encodes a member as its
value and the generated schemas list the values as ``enum``. The values are also metric
label values shared with the Go implementation's dashboards: they never change, only grow
(and growing one is a contract change for every consumer).

They live in the model layer because the wire types must not import the domain
(``crs -> model``, never the reverse); :mod:`service.crs` re-exports them.
"""

from __future__ import annotations

import enum

__all__ = ["AllocationStatus", "CrSlot", "OutcomeKind"]


class OutcomeKind(enum.StrEnum):
    """Which scheduler result was classified."""

    PLACEMENT = "placement"
    NO_HOST_FOUND = "no_host_found"


class CrSlot(enum.StrEnum):
    """The committed-resource class of a scheduling outcome."""

    NO_CR = "no_cr"
    SLOT_USED = "slot_used"
    SLOT_MISSED = "slot_missed"
    CR_EXHAUSTED = "cr_exhausted"
    SLOT_EXHAUSTED = "slot_exhausted"
    SLOT_BLOCKED = "slot_blocked"
    # Not produced by the classifiers: the surrounding controller's outcomes.
    ERROR = "error"  # flavor-group lookup failed; counted with flavor_group="unknown"
    PAYG = "payg"  # flavor in no group; never counted
    SKIPPED = "skipped"  # options.skip_committed_resource_tracking; never counted


class AllocationStatus(enum.StrEnum):
    """What happened to the Reservation slot for this VM."""

    WRITTEN = "written"  # the VM was added to a slot by this call
    ALREADY_PRESENT = "already_present"  # a matching slot on the target host had it already
    NO_SLOT = "no_slot"  # slot_used, but no slot on the target host could take it
    NOT_APPLICABLE = "not_applicable"  # not a slot_used placement: nothing to write
    FAILED = "failed"  # conflicts did not resolve within the retry budget
