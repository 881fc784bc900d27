"""The committed-resource (CR) slot domain core: pure functions, no I/O.

Nothing here talks to Kafka or Kubernetes; callers hand in decoded objects.
"""

from service.crs.classify import CrSlot, classify_no_host_found, classify_placement
from service.crs.commitments import (
    ACTIVE_STATES,
    active_commitments,
    commitments_exhausted,
    is_active,
)
from service.crs.evaluator import (
    SlotEvaluator,
    hv_free_memory,
    is_slot,
    pick_slot,
    reservation_remaining_memory,
)
from service.crs.flavors import (
    FLAVOR_GROUPS_KNOWLEDGE_NAME,
    FlavorGroupLookupError,
    FlavorGroups,
    FlavorMatch,
    flavor_group_invalid_reason,
    parse_flavor_groups,
)
from service.crs.intent import INTENT_CREATE, INTENT_UNKNOWN, derive_intent, intent_from_hints
from service.crs.metrics import (
    NO_HOST_FOUND_LABELS,
    PLACEMENT_LABELS,
    new_no_host_found_counter,
    new_placement_counter,
)
from service.crs.outcome import AllocationStatus, Outcome, OutcomeKind
from service.crs.recorder import Recorder

__all__ = [
    "ACTIVE_STATES",
    "FLAVOR_GROUPS_KNOWLEDGE_NAME",
    "INTENT_CREATE",
    "INTENT_UNKNOWN",
    "NO_HOST_FOUND_LABELS",
    "PLACEMENT_LABELS",
    "AllocationStatus",
    "CrSlot",
    "FlavorGroupLookupError",
    "FlavorGroups",
    "FlavorMatch",
    "Outcome",
    "OutcomeKind",
    "Recorder",
    "SlotEvaluator",
    "active_commitments",
    "classify_no_host_found",
    "classify_placement",
    "commitments_exhausted",
    "derive_intent",
    "flavor_group_invalid_reason",
    "hv_free_memory",
    "intent_from_hints",
    "is_active",
    "is_slot",
    "new_no_host_found_counter",
    "new_placement_counter",
    "parse_flavor_groups",
    "pick_slot",
    "reservation_remaining_memory",
]
