"""Kubernetes object metadata and status conditions, trimmed to what the service reads.

Every field is optional: objects come from watch streams, fakes and tests alike, and a
missing field must decode to a neutral default instead of failing the whole object.
"""

from __future__ import annotations

import msgspec

__all__ = ["Condition", "K8sStruct", "ObjectMeta", "find_condition", "is_condition_true"]


class K8sStruct(
    msgspec.Struct,
    kw_only=True,
    frozen=True,
    rename="camel",
    omit_defaults=True,
    gc=False,
):
    """Base of all API-server types.

    ``frozen`` because cached objects are shared between coroutines; ``gc=False`` because
    decoded objects are trees (no cycles) and 60k of them would otherwise be GC-tracked;
    ``omit_defaults`` so :func:`service.model.to_k8s` writes back only what was set.
    Subclasses repeat ``frozen=True`` only because mypy does not inherit it.
    """


class ObjectMeta(K8sStruct, frozen=True):
    name: str | None = None
    resource_version: str | None = None
    labels: dict[str, str] | None = None
    uid: str | None = None
    generation: int | None = None
    creation_timestamp: str | None = None


class Condition(K8sStruct, frozen=True):
    type: str | None = None
    status: str | None = None
    reason: str | None = None
    message: str | None = None
    last_transition_time: str | None = None
    observed_generation: int | None = None


def find_condition(conditions: list[Condition] | None, type_: str) -> Condition | None:
    """First condition of ``type_`` (same as apimachinery's ``FindStatusCondition``)."""
    for cond in conditions or ():
        if cond.type == type_:
            return cond
    return None


def is_condition_true(conditions: list[Condition] | None, type_: str) -> bool:
    cond = find_condition(conditions, type_)
    return cond is not None and cond.status == "True"
