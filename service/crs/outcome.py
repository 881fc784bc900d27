"""The result of recording one scheduling outcome, as the stream layer publishes it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

__all__ = ["AllocationStatus", "Outcome", "OutcomeKind"]

OutcomeKind = Literal["placement", "no_host_found"]


class AllocationStatus(StrEnum):
    """What happened to the Reservation slot for this VM."""

    WRITTEN = "written"  # the VM was added to a slot by this call
    ALREADY_PRESENT = "already_present"  # a matching slot on the target host had it already
    NO_SLOT = "no_slot"  # slot_used, but no slot on the target host could take it
    NOT_APPLICABLE = "not_applicable"  # not a slot_used placement: nothing to write
    FAILED = "failed"  # conflicts did not resolve within the retry budget


@dataclass(frozen=True, slots=True)
class Outcome:
    """Everything downstream needs to know about one recorded outcome.

    ``cr_slot`` is one of the reference classes (``no_cr``, ``slot_used``, ``slot_missed``,
    ``cr_exhausted``, ``slot_exhausted``, ``slot_blocked``, ``error``) or ``payg`` /
    ``skipped`` for events the counters do not count. ``flavor_group`` is None for PAYG
    and ``"unknown"`` when the flavor-group lookup failed.
    """

    kind: OutcomeKind
    cr_slot: str
    intent: str
    instance_uuid: str
    project_id: str
    flavor_name: str
    flavor_group: str | None
    target_host: str | None
    reservation: str | None = None
    allocation: AllocationStatus = AllocationStatus.NOT_APPLICABLE
    vm_memory_bytes: int | None = None
    conflicts: int = 0
