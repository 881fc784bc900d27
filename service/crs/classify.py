"""Classification of a scheduling outcome in terms of committed-resource coverage.

The results are :class:`~service.model.vocabulary.CrSlot` members: the same type the
classification event carries, and, being a ``StrEnum``, the same strings (metric label
values shared with the Go implementation's dashboards) wherever a ``str`` is expected.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.crs.commitments import commitments_exhausted
from service.crs.evaluator import SlotEvaluator
from service.model.k8s import CommittedResource
from service.model.vocabulary import CrSlot

__all__ = ["CrSlot", "classify_no_host_found", "classify_placement"]


def classify_placement(
    evaluator: SlotEvaluator,
    active_crs: Sequence[CommittedResource],
    candidate_hosts: Sequence[str],
    project_id: str,
    flavor_group: str,
) -> CrSlot:
    """Outcome of a successful placement.

    ``no_cr`` when there is no active CR or it is used up; ``slot_used`` when any
    *candidate* host (the pipeline's ordered hosts) has a matching slot with memory
    left; otherwise ``slot_missed``. Candidates, not just the target: the question is
    whether the pipeline could have used a slot.
    """
    if not active_crs or commitments_exhausted(active_crs):
        return CrSlot.NO_CR
    for host in candidate_hosts:
        if evaluator.has_slot_with_memory(host, project_id, flavor_group):
            return CrSlot.SLOT_USED
    return CrSlot.SLOT_MISSED


def classify_no_host_found(
    active_crs: Sequence[CommittedResource],
    evaluator: SlotEvaluator,
    input_hosts: Sequence[str],
    project_id: str,
    flavor_group: str,
    vm_mem_bytes: int,
) -> CrSlot:
    """Why no host was found (argument order as in the reference).

    ``no_cr`` without an active CR, ``cr_exhausted`` when it is used up,
    ``slot_blocked`` when some *input* host had a usable slot (so a filter, not
    capacity, excluded it), otherwise ``slot_exhausted``.
    """
    if not active_crs:
        return CrSlot.NO_CR
    if commitments_exhausted(active_crs):
        return CrSlot.CR_EXHAUSTED
    for host in input_hosts:
        if evaluator.has_usable_slot(host, project_id, flavor_group, vm_mem_bytes):
            return CrSlot.SLOT_BLOCKED
    return CrSlot.SLOT_EXHAUSTED
