"""Flavor groups: Knowledge readiness, ratio validation, PAYG and O(1) lookup."""

from __future__ import annotations

import json
from typing import Any

import pytest
import structlog

from service.crs import (
    FlavorGroupLookupError,
    FlavorMatch,
    flavor_group_invalid_reason,
    parse_flavor_groups,
)
from service.model import FlavorGroupFeature, Knowledge, from_k8s

MI = 2**20


def flavor(name: str, vcpus: int = 4, memory_mb: int = 16384) -> dict[str, Any]:
    return {"name": name, "vcpus": vcpus, "memoryMB": memory_mb, "diskGB": 50}


def feature(
    name: str = "hana_fixed",
    flavors: list[dict[str, Any]] | None = None,
    *,
    smallest_mb: int | None = None,
    **ratios: int,
) -> dict[str, Any]:
    flavors = (
        flavors
        if flavors is not None
        else [flavor(f"{name}_c4_m16"), flavor(f"{name}_c8_m32", 8, 32768)]
    )
    smallest = min(flavors, key=lambda f: f["memoryMB"]) if flavors else flavor("none", 0, 0)
    largest = max(flavors, key=lambda f: f["memoryMB"]) if flavors else smallest
    if smallest_mb is not None:
        smallest = {**smallest, "memoryMB": smallest_mb}
    return {
        "name": name,
        "flavors": flavors,
        "largestFlavor": largest,
        "smallestFlavor": smallest,
        **ratios,
    }


def knowledge(features: Any = None, *, ready: str | None = "True", raw: Any = None) -> Knowledge:
    status: dict[str, Any] = {}
    if ready is not None:
        status["conditions"] = [{"type": "Ready", "status": ready}]
    if raw is not None:
        status["raw"] = raw
    elif features is not None:
        status["raw"] = {"features": features}
    return from_k8s({"metadata": {"name": "flavor-groups"}, "status": status}, Knowledge)


RATIO_SHAPES = [
    pytest.param({"ramCoreRatio": 4096}, None, id="fixed"),
    pytest.param(
        {"ramCoreRatio": 4096, "ramCoreRatioMin": 4096, "ramCoreRatioMax": 4096},
        None,
        id="fixed-all-three",
    ),
    pytest.param({"ramCoreRatioMin": 2048, "ramCoreRatioMax": 16384}, None, id="variable"),
    pytest.param({}, None, id="none"),
    pytest.param({"ramCoreRatioMin": 2048}, "inconsistent", id="min-only"),
    pytest.param({"ramCoreRatioMax": 2048}, "inconsistent", id="max-only"),
    pytest.param(
        {"ramCoreRatio": 4096, "ramCoreRatioMin": 2048}, "inconsistent", id="ratio-and-min"
    ),
    pytest.param(
        {"ramCoreRatio": 4096, "ramCoreRatioMax": 8192}, "inconsistent", id="ratio-and-max"
    ),
    pytest.param(
        {"ramCoreRatio": 4096, "ramCoreRatioMin": 2048, "ramCoreRatioMax": 8192},
        "inconsistent",
        id="all-three-differ",
    ),
    pytest.param(
        {"ramCoreRatio": 4096, "ramCoreRatioMin": 4096, "ramCoreRatioMax": 8192},
        "inconsistent",
        id="all-three-max-differs",
    ),
    pytest.param(
        {"ramCoreRatioMin": 8192, "ramCoreRatioMax": 8192}, "less than", id="variable-min-eq-max"
    ),
    pytest.param(
        {"ramCoreRatioMin": 9000, "ramCoreRatioMax": 8192}, "less than", id="variable-min-gt-max"
    ),
]


@pytest.mark.parametrize(("ratios", "error"), RATIO_SHAPES)
def test_ratio_shapes(ratios: dict[str, int], error: str | None) -> None:
    feat = from_k8s(feature(**ratios), FlavorGroupFeature)
    reason = flavor_group_invalid_reason(feat)
    if error is None:
        assert reason is None
    else:
        assert reason is not None
        assert error in reason


SMALLEST_ZERO = [
    pytest.param({"ramCoreRatio": 4096}, False, id="fixed-needs-memory"),
    pytest.param(
        {"ramCoreRatioMin": 2048, "ramCoreRatioMax": 4096}, False, id="variable-needs-memory"
    ),
    pytest.param({}, True, id="no-ratio-does-not-care"),
]


@pytest.mark.parametrize(("ratios", "valid"), SMALLEST_ZERO)
def test_smallest_flavor_memory_zero(ratios: dict[str, int], valid: bool) -> None:
    feat = from_k8s(feature(smallest_mb=0, **ratios), FlavorGroupFeature)
    assert (flavor_group_invalid_reason(feat) is None) is valid


def test_invalid_groups_are_skipped_and_logged() -> None:
    kn = knowledge(
        [
            feature("good", ramCoreRatio=4096),
            feature("bad", ramCoreRatioMin=1),
            feature("zero", smallest_mb=0, ramCoreRatio=4096),
        ]
    )
    with structlog.testing.capture_logs() as logs:
        groups = parse_flavor_groups(kn)
    assert list(groups) == ["good"]
    assert groups.lookup("bad_c4_m16") is None
    assert groups.lookup("zero_c4_m16") is None
    skipped = {entry["flavor_group"] for entry in logs if entry["log_level"] == "warning"}
    assert skipped == {"bad", "zero"}


def test_lookup_returns_group_flavor_sizes_not_request_sizes() -> None:
    groups = parse_flavor_groups(
        knowledge(
            [
                feature(
                    "g1",
                    [flavor("m1.large", 2, 4096), flavor("m1.xl", 8, 32768)],
                    ramCoreRatio=2048,
                )
            ]
        )
    )
    match = groups.lookup("m1.large")
    assert match is not None
    assert match == FlavorMatch(group="g1", flavor=match.flavor)
    assert match.group == "g1"
    assert match.flavor.name == "m1.large"
    assert match.vm_memory_bytes == 4096 * MI
    assert match.vcpus == 2
    assert len(groups) == 1
    assert set(groups.groups) == {"g1"}


def test_unknown_flavor_is_payg() -> None:
    groups = parse_flavor_groups(knowledge([feature("g1", ramCoreRatio=4096)]))
    assert groups.lookup("not-in-any-group") is None


def test_flavor_in_two_groups_resolves_to_first_deterministically() -> None:
    shared = flavor("shared")
    groups = parse_flavor_groups(knowledge([feature("a", [shared]), feature("b", [shared])]))
    match = groups.lookup("shared")
    assert match is not None
    assert match.group == "a"


def test_repeated_group_name_last_definition_wins() -> None:
    groups = parse_flavor_groups(
        knowledge([feature("g", [flavor("old")]), feature("g", [flavor("new")])])
    )
    assert groups.lookup("old") is None
    match = groups.lookup("new")
    assert match is not None
    assert match.group == "g"


ERRORS = [
    pytest.param(None, id="knowledge-missing"),
    pytest.param(knowledge([feature()], ready="False"), id="not-ready"),
    pytest.param(knowledge([feature()], ready="Unknown"), id="ready-unknown"),
    pytest.param(knowledge([feature()], ready=None), id="no-conditions"),
    pytest.param(knowledge(raw={"features": "nope"}), id="features-not-a-list"),
    pytest.param(knowledge(raw={"features": [{"name": 5}]}), id="feature-wrong-type"),
    pytest.param(
        knowledge(raw={"features": [{"name": "g", "flavors": [{"vcpus": -1}]}]}), id="negative"
    ),
    pytest.param(knowledge(raw=[1, 2]), id="raw-not-an-object"),
]


@pytest.mark.parametrize("kn", ERRORS)
def test_lookup_errors(kn: Knowledge | None) -> None:
    with pytest.raises(FlavorGroupLookupError):
        parse_flavor_groups(kn)


EMPTY = [
    pytest.param(knowledge(), id="no-raw"),
    pytest.param(knowledge(raw={}), id="empty-object"),
    pytest.param(knowledge(raw={"features": None}), id="null-features"),
    pytest.param(knowledge(raw={"features": []}), id="empty-features"),
]


@pytest.mark.parametrize("kn", EMPTY)
def test_ready_without_features_means_everything_is_payg(kn: Knowledge) -> None:
    groups = parse_flavor_groups(kn)
    assert len(groups) == 0
    assert groups.lookup("anything") is None


def test_raw_as_json_text_is_accepted() -> None:
    kn = knowledge(raw=json.dumps({"features": [feature("g", [flavor("f")])]}))
    groups = parse_flavor_groups(kn)
    assert groups.lookup("f") is not None


def test_lookup_is_a_dict_hit() -> None:
    many = [feature(f"g{i}", [flavor(f"f{i}_{j}") for j in range(20)]) for i in range(200)]
    groups = parse_flavor_groups(knowledge(many))
    match = groups.lookup("f199_19")
    assert match is not None
    assert match.group == "g199"
    assert len(groups._by_flavor) == 4000
