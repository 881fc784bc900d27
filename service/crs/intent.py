"""Scheduling intent of a Nova request, used as a metric label.

Nova marks non-create operations with the ``_nova_check_type`` scheduler hint, as a
string or as a one-element list depending on the code path. A request without a
usable hint is ``Unknown`` rather than ``create``: guessing would mislabel metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from service.model.nova import ExternalSchedulerRequest

__all__ = [
    "HINT_KEY",
    "INTENT_CREATE",
    "INTENT_UNKNOWN",
    "KNOWN_INTENTS",
    "derive_intent",
    "intent_from_hints",
    "resolve_intent",
]

HINT_KEY: Final = "_nova_check_type"
INTENT_CREATE: Final = "create"
INTENT_UNKNOWN: Final = "Unknown"

_INTENTS: Final[Mapping[str, str]] = {
    "rebuild": "rebuild",
    "resize": "resize",
    "live_migrate": "live_migration",
    "evacuate": "evacuate",
    "reserve_for_failover": "reserve_for_failover",
    "reuse_failover_reservation": "reuse_failover_reservation",
    "reserve_for_committed_resource": "reserve_for_committed_resource",
    "capacity_probe": "capacity_probe",
}


# Every value an intent label can take; anything else would be unbounded label cardinality.
KNOWN_INTENTS: Final[frozenset[str]] = frozenset(
    {INTENT_CREATE, INTENT_UNKNOWN, *_INTENTS.values()}
)


def intent_from_hints(hints: Mapping[str, Any] | None) -> str:
    """Intent from a scheduler-hints mapping (see module doc)."""
    if hints is None:
        return INTENT_UNKNOWN
    raw = hints.get(HINT_KEY)
    # Like Go's GetSchedulerHintStr: a list yields its first element if that is a str.
    if isinstance(raw, list):
        raw = raw[0] if raw else None
    if not isinstance(raw, str):
        return INTENT_UNKNOWN
    return _INTENTS.get(raw, INTENT_CREATE)


def derive_intent(request: ExternalSchedulerRequest) -> str:
    return intent_from_hints(request.spec.data.scheduler_hints)


def resolve_intent(given: str | None, request: ExternalSchedulerRequest) -> str:
    """The intent a producer put in the decision when it is a known one, else derived.

    The decision's intent is the reference controller's (derived the same way); an
    unknown string is not trusted as a metric label value.
    """
    if given in KNOWN_INTENTS:
        return given
    return derive_intent(request)
