"""The project's own test fixtures, and the upstream material some tests compare against.

Everything a test needs is in the repository (``tests/fixtures/``), so a clone with
nothing beside it passes ``make test``. A few tests compare with upstream Cortex files the
repository does not carry: its CRD manifests and its Nova decision example. They read the
directory named by a variable, or by default the one where a checkout with the shared
reference material has it (``../shared/reference/...`` beside the repository, as in CI).
Neither there: those tests are skipped, the reason naming the variable. The variable set
but not pointing at the files: they fail, as the operator asked for them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
NOVA_DECISION = FIXTURES / "nova-decision.yaml"


def nova_decision() -> dict[str, Any]:
    """The project's Nova decision example (a Decision: spec.novaRaw and status.result)."""
    doc: dict[str, Any] = yaml.safe_load(NOVA_DECISION.read_text())
    return doc


@dataclass(frozen=True)
class Upstream:
    """A directory of upstream files, from ``variable`` or else ``default`` when present."""

    variable: str
    default: Path
    marker: str  # a file the directory must hold
    what: str

    def path(self, env: dict[str, str] | None = None) -> Path:
        """The directory, or a skip (nothing configured) or failure (misconfigured)."""
        value = (os.environ if env is None else env).get(self.variable)
        if value:
            path = Path(value)
            if not (path / self.marker).is_file():
                pytest.fail(f"{self.variable}={value}: no {self.marker} there", pytrace=False)
            return path
        if (self.default / self.marker).is_file():
            return self.default
        shown = os.path.relpath(self.default, REPO)
        pytest.skip(f"{self.what} not found: set {self.variable} (default {shown})")


UPSTREAM_CRDS = Upstream(
    "CRS_UPSTREAM_CRDS",
    REPO.parent / "shared" / "reference" / "crds",
    "cortex.cloud_reservations.yaml",
    "upstream Cortex CRDs",
)
UPSTREAM_EXAMPLES = Upstream(
    "CRS_UPSTREAM_EXAMPLES",
    REPO.parent / "shared" / "reference" / "examples",
    "nova-decisions.yaml",
    "upstream Cortex Nova example",
)


def upstream_nova_decision() -> dict[str, Any]:
    """Upstream Cortex's Nova decision example, or a skip naming CRS_UPSTREAM_EXAMPLES."""
    path = UPSTREAM_EXAMPLES.path() / UPSTREAM_EXAMPLES.marker
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    return doc
