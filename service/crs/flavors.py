"""Flavor groups from ``Knowledge/flavor-groups``: which group a flavor belongs to.

A missing or not-Ready Knowledge is an *error* (counted as ``cr_slot="error"``), never
PAYG: treating it as PAYG would silently stop CR accounting while the extractor is down.
Parsing happens once per Knowledge version; the per-event lookup is one dict access.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import structlog

from service.model.decode import DecodeError, from_k8s
from service.model.k8s import FlavorGroupFeature, FlavorInGroup, Knowledge
from service.model.meta import is_condition_true

__all__ = [
    "FLAVOR_GROUPS_KNOWLEDGE_NAME",
    "FlavorGroupLookupError",
    "FlavorGroups",
    "FlavorMatch",
    "flavor_group_invalid_reason",
    "parse_flavor_groups",
]

FLAVOR_GROUPS_KNOWLEDGE_NAME: Final = "flavor-groups"
_MIB: Final = 1024 * 1024

_log = structlog.get_logger(__name__)


class FlavorGroupLookupError(Exception):
    """Flavor groups are unavailable (Knowledge missing, not Ready, or malformed)."""


@dataclass(frozen=True, slots=True)
class FlavorMatch:
    """A flavor found in a group. Sizes come from the group's flavor, not the request."""

    group: str
    flavor: FlavorInGroup

    @property
    def vm_memory_bytes(self) -> int:
        return self.flavor.memory_mb * _MIB

    @property
    def vcpus(self) -> int:
        return self.flavor.vcpus


class _RawFeatures(msgspec.Struct, frozen=True):
    features: list[FlavorGroupFeature] | None = None


def flavor_group_invalid_reason(f: FlavorGroupFeature) -> str | None:
    """Why a feature must be skipped, or None when it is valid.

    Valid ratio shapes: fixed (``ramCoreRatio`` alone, or all three equal), variable
    (``min`` and ``max`` only, ``min < max``), or none at all. Fixed and variable groups
    also need a non-zero ``smallestFlavor.memoryMB`` (it is the slot unit).
    """
    ratio, lo, hi = f.ram_core_ratio, f.ram_core_ratio_min, f.ram_core_ratio_max
    is_fixed = (ratio is not None and lo is None and hi is None) or (
        ratio is not None and ratio == lo and ratio == hi
    )
    is_variable = ratio is None and lo is not None and hi is not None
    is_none = ratio is None and lo is None and hi is None
    if not (is_fixed or is_variable or is_none):
        return "inconsistent ram/core ratio fields"
    if is_variable and lo is not None and hi is not None and lo >= hi:
        return f"ramCoreRatioMin ({lo}) must be less than ramCoreRatioMax ({hi})"
    if (is_fixed or is_variable) and f.smallest_flavor.memory_mb == 0:
        return "smallestFlavor.memoryMB must be non-zero"
    return None


class FlavorGroups:
    """The valid flavor groups of one Knowledge version, indexed by flavor name."""

    __slots__ = ("_by_flavor", "_groups")

    def __init__(self, groups: Mapping[str, FlavorGroupFeature]) -> None:
        self._groups = dict(groups)
        by_flavor: dict[str, FlavorMatch] = {}
        # Go searches a map, so a flavor listed in two groups resolves randomly there;
        # here the first group (in Knowledge order) wins, deterministically. Listed in
        # docs/semantics.md ("Where this service deliberately differs").
        for name, group in self._groups.items():
            for flavor in group.flavors:
                by_flavor.setdefault(flavor.name, FlavorMatch(group=name, flavor=flavor))
        self._by_flavor = by_flavor

    def lookup(self, flavor_name: str) -> FlavorMatch | None:
        """The group of ``flavor_name``; None means PAYG (not in any valid group)."""
        return self._by_flavor.get(flavor_name)

    @property
    def groups(self) -> Mapping[str, FlavorGroupFeature]:
        return self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups)


def parse_flavor_groups(knowledge: Knowledge | None) -> FlavorGroups:
    """Valid flavor groups of ``knowledge``; raises :class:`FlavorGroupLookupError`."""
    if knowledge is None:
        raise FlavorGroupLookupError(f"Knowledge {FLAVOR_GROUPS_KNOWLEDGE_NAME!r} not found")
    if not is_condition_true(knowledge.status.conditions, "Ready"):
        raise FlavorGroupLookupError(f"Knowledge {FLAVOR_GROUPS_KNOWLEDGE_NAME!r} is not ready")
    features = _decode_features(knowledge.status.raw)
    groups: dict[str, FlavorGroupFeature] = {}
    for feature in features:
        reason = flavor_group_invalid_reason(feature)
        if reason is not None:
            _log.warning("skipping invalid flavor group", flavor_group=feature.name, reason=reason)
            continue
        groups[feature.name] = feature  # a repeated group name replaces the earlier one
    return FlavorGroups(groups)


def _decode_features(raw: Any) -> list[FlavorGroupFeature]:
    # An empty/absent payload is an empty list (as in Go), not an error.
    if raw is None or raw == {} or raw == b"" or raw == "":
        return []
    if not isinstance(raw, dict | bytes | str):
        raise FlavorGroupLookupError(
            f"malformed flavor group features: expected an object, got {type(raw).__name__}"
        )
    try:
        # from_k8s applies Go's null rule: a null feature, flavor or largest/smallest
        # flavor is the zero value, so one bad entry does not take every group down.
        parsed = from_k8s(raw, _RawFeatures)
    except DecodeError as exc:
        raise FlavorGroupLookupError(f"malformed flavor group features: {exc}") from exc
    return parsed.features or []
