"""The result of recording one scheduling outcome, as the stream layer publishes it."""

from __future__ import annotations

import contextlib
from enum import StrEnum
from typing import Final

import msgspec

from service.model.vocabulary import AllocationStatus, CrSlot, OutcomeKind

# The vocabularies are defined with the wire types (the model layer) and re-exported here,
# where the domain has always exposed them.
__all__ = ["AllocationStatus", "CrSlot", "Outcome", "OutcomeKind"]


class Outcome(msgspec.Struct, frozen=True):
    """Everything downstream needs to know about one recorded outcome.

    ``cr_slot`` is one of the reference classes (``no_cr``, ``slot_used``, ``slot_missed``,
    ``cr_exhausted``, ``slot_exhausted``, ``slot_blocked``, ``error``) or ``payg`` /
    ``skipped`` for events the counters do not count. ``kind``, ``cr_slot`` and
    ``allocation`` have the very types the classification event carries. ``flavor_group``
    is None for PAYG and ``"unknown"`` when the flavor-group lookup failed.

    A frozen msgspec Struct, not a frozen dataclass: one is built per event, and the
    dataclass's ``__init__`` (a ``object.__setattr__`` per field) took 2.2 µs against
    0.4, about 2 % of a routine event's CPU in a backlog. ``msgspec.structs.replace``
    copies one with changes.
    """

    kind: OutcomeKind
    cr_slot: CrSlot
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

    def __post_init__(self) -> None:
        # mypy proves that typed callers pass members. A plain string from untyped code
        # (a fixture's dict, a debugger) becomes its member here or is refused, so an
        # off-contract value is stopped where it is made, never on the way to the wire.
        # (msgspec does not check types on construction, only when decoding.)
        for name, vocabulary in _VOCABULARIES:
            value = getattr(self, name)
            if type(value) is not vocabulary:
                msgspec.structs.force_setattr(self, name, _member(vocabulary, name, value))


_VOCABULARIES: Final[tuple[tuple[str, type[StrEnum]], ...]] = (
    ("kind", OutcomeKind),
    ("cr_slot", CrSlot),
    ("allocation", AllocationStatus),
)


def _member(vocabulary: type[StrEnum], name: str, value: object) -> StrEnum:
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return vocabulary(value)
    values = sorted(m.value for m in vocabulary)
    raise ValueError(f"{name} {value!r} is not one of {values}")
