"""Which CommittedResources apply to a request, and whether they are used up."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from service.model.k8s import CommittedResource
from service.quantity import ZERO, Quantity, quantity_sum

__all__ = ["ACTIVE_STATES", "active_commitments", "commitments_exhausted", "is_active"]

# planned/pending/superseded/expired commitments grant nothing (yet or any more).
ACTIVE_STATES: Final = frozenset({"confirmed", "guaranteed"})


def is_active(cr: CommittedResource) -> bool:
    return cr.spec.state in ACTIVE_STATES


def active_commitments(
    crs: Iterable[CommittedResource], project_id: str, flavor_group: str
) -> list[CommittedResource]:
    """The project's active commitments for the flavor group, in input order."""
    return [
        cr
        for cr in crs
        if cr.spec.project_id == project_id
        and cr.spec.flavor_group_name == flavor_group
        and cr.spec.state in ACTIVE_STATES
    ]


def commitments_exhausted(active: Iterable[CommittedResource]) -> bool:
    """Σ used memory ≥ Σ amount, compared exactly (no floats: "1.5Gi" sums must not drift).

    An empty list counts as exhausted (0 ≥ 0); the classifiers check for "no CR" first.
    """
    crs = list(active)
    total_amount = quantity_sum(cr.spec.amount for cr in crs)
    total_used = quantity_sum(_used_memory(cr) for cr in crs)
    return total_used >= total_amount


def _used_memory(cr: CommittedResource) -> Quantity:
    used = cr.status.used_resources
    if not used:
        return ZERO
    return used.get("memory", ZERO)
