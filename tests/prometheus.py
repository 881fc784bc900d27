"""Prometheus and promtool for the tests, installed by devstack/prometheus (cached)."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MONITORING = REPO / "deploy" / "monitoring"


@functools.cache
def prometheus_bin_dir() -> Path:
    """The directory with ``prometheus`` and ``promtool``; fails the test loudly if the
    project's install script cannot provide them (never a skip)."""
    proc = subprocess.run(
        [str(REPO / "devstack" / "prometheus")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"devstack/prometheus failed:\n{proc.stderr[-3000:]}", pytrace=False)
    return Path(proc.stdout.strip().splitlines()[-1])


def promtool(*args: str, cwd: Path = MONITORING) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(prometheus_bin_dir() / "promtool"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        check=False,
    )
