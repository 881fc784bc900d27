"""The image's lock files match pyproject.toml and are hash-pinned (deploy/lock.sh).

Drift is what fails here: a dependency added to, removed from or re-ranged in
pyproject.toml without re-running deploy/lock.sh, or a hand-edited lock. That the locked
set is complete (nothing missing once installed with ``--no-deps``) is proven by
test_packaging's run of deploy/check-dockerfile-steps.sh (``pip check``).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

# (lock file, what pip-compile writes as the direct dependencies' origin, their specs)
LOCKS = {
    "requirements.lock": (
        "crs-consumer (pyproject.toml)",
        PYPROJECT["project"]["dependencies"],
    ),
    "requirements-build.lock": (
        "crs-consumer (pyproject.toml::build-system.requires)",
        PYPROJECT["build-system"]["requires"],
    ),
}


def parse_lock(path: Path) -> dict[str, tuple[str, list[str], list[str]]]:
    """name -> (version, hashes, via) for every requirement of a pip-compile output."""
    entries: dict[str, tuple[str, list[str], list[str]]] = {}
    text = path.read_text()
    blocks = re.split(r"\n(?=[A-Za-z0-9])", text.split("\n", 1)[1])
    for block in blocks:
        head = block.split()[0] if block.strip() else ""
        if not head or head.startswith("#"):
            continue
        assert not head.startswith("-"), f"{path.name}: an option line {head!r} (index, links)"
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==([^\s\\]+)", head)
        assert m, f"{path.name}: {head!r} is not pinned with =="
        hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})", block)
        via = re.findall(r"#\s+(?:via\s+)?(\S.*)$", block, re.M)
        entries[canonicalize_name(m.group(1))] = (m.group(2), hashes, via)
    return entries


@pytest.mark.parametrize("lock", list(LOCKS))
def test_lock_pins_every_package_with_hashes(lock: str) -> None:
    path = REPO / lock
    assert "deploy/lock.sh" in path.read_text().split("\n\n", 1)[0], "regenerate with the script"
    entries = parse_lock(path)
    assert entries
    for name, (_, hashes, _) in entries.items():
        assert hashes, f"{lock}: {name} has no hash"


@pytest.mark.parametrize("lock", list(LOCKS))
def test_lock_matches_pyproject(lock: str) -> None:
    origin, specs = LOCKS[lock]
    entries = parse_lock(REPO / lock)
    wanted = {canonicalize_name(Requirement(s).name): Requirement(s) for s in specs}
    direct = {name for name, (_, _, via) in entries.items() if any(origin in v for v in via)}
    assert direct == set(wanted), f"{lock} is stale: run deploy/lock.sh"
    for name, requirement in wanted.items():
        version = entries[name][0]
        assert requirement.specifier.contains(version, prereleases=True), (
            f"{lock}: {name}=={version} is outside {requirement.specifier}; run deploy/lock.sh"
        )


def test_the_image_installs_only_from_the_locks() -> None:
    dockerfile = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    installs = re.findall(r"pip(?: --python \S+)? (install|wheel)([^&]*)", dockerfile)
    assert installs
    for verb, args in installs:
        assert "--no-deps" in args, f"pip {verb}{args} resolves dependencies itself"
    for lock in LOCKS:
        assert f"--require-hashes --no-deps -r {lock}" in " ".join(dockerfile.split()), lock
    assert "--no-build-isolation" in dockerfile
    (image,) = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", dockerfile, re.M)
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+@sha256:[0-9a-f]{64}", image), image
