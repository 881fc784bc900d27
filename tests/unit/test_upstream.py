"""Where the upstream-comparison tests find upstream files, and what happens without them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.upstream import REPO, UPSTREAM_CRDS, UPSTREAM_EXAMPLES, Upstream


def upstream(default: Path) -> Upstream:
    return Upstream("CRS_UPSTREAM_THINGS", default, "thing.yaml", "upstream things")


def test_the_variable_wins_over_the_default(tmp_path: Path) -> None:
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "thing.yaml").write_text("{}")
    (tmp_path / "default").mkdir()
    (tmp_path / "default" / "thing.yaml").write_text("{}")
    got = upstream(tmp_path / "default").path({"CRS_UPSTREAM_THINGS": str(tmp_path / "set")})
    assert got == tmp_path / "set"
    assert upstream(tmp_path / "default").path({}) == tmp_path / "default"


def test_nothing_there_skips_naming_the_variable(tmp_path: Path) -> None:
    with pytest.raises(pytest.skip.Exception) as info:
        upstream(tmp_path / "absent").path({})
    shown = os.path.relpath(tmp_path / "absent", REPO)
    expected = f"upstream things not found: set CRS_UPSTREAM_THINGS (default {shown})"
    assert str(info.value) == expected


def test_a_variable_pointing_elsewhere_fails(tmp_path: Path) -> None:
    with pytest.raises(pytest.fail.Exception, match=r"CRS_UPSTREAM_THINGS=.*: no thing\.yaml"):
        upstream(tmp_path).path({"CRS_UPSTREAM_THINGS": str(tmp_path)})


def test_the_defaults_are_beside_the_repository() -> None:
    # As CI has them: ../shared/reference/... relative to the repository, no machine path.
    assert UPSTREAM_CRDS.default == REPO.parent / "shared" / "reference" / "crds"
    assert UPSTREAM_EXAMPLES.default == REPO.parent / "shared" / "reference" / "examples"
    assert (UPSTREAM_CRDS.variable, UPSTREAM_EXAMPLES.variable) == (
        "CRS_UPSTREAM_CRDS",
        "CRS_UPSTREAM_EXAMPLES",
    )
