"""How every benchmark ends: its workload checked, its goals turned into an exit code.

A figure is only worth printing when the run did what the benchmark says it measures (the
outcome mix, the allocations written, no dead letters, the results of the calls timed):
:func:`check_workload` raises :class:`WorkloadError` otherwise. :func:`finish` runs a
benchmark's ``main`` and turns its end into the process's exit code, so that ``make
bench`` stops on it:

* 0: the workload happened and every goal was met (or the benchmark has no goal);
* 1: a goal was MISSED (:func:`goals` printed which);
* 2: WORKLOAD FAILED, the figures mean nothing.

Standard library only: ``bench_core.py`` imports it without the dev stack's clients.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import NoReturn

GOAL_MISSED = 1
WORKLOAD_FAILED = 2


class WorkloadError(RuntimeError):
    """The run did not do what the benchmark describes: its figures mean nothing."""


def check_workload(ok: bool, what: str) -> None:
    """Raise :class:`WorkloadError` saying ``what`` was expected unless ``ok``."""
    if not ok:
        raise WorkloadError(what)


def goals(results: Mapping[str, bool], suffix: str = "") -> int:
    """Print each goal as met or MISSED on one line; the exit code they make."""
    line = "; ".join(f"{goal}: {'met' if ok else 'MISSED'}" for goal, ok in results.items())
    print(f"{line}{'   ' + suffix if suffix else ''}", flush=True)
    return 0 if all(results.values()) else GOAL_MISSED


def finish(main: Callable[[], int | None]) -> NoReturn:
    """Run a benchmark's ``main`` and exit with its code (None: 0), or with
    :data:`WORKLOAD_FAILED` and the reason when its workload did not happen."""
    try:
        code = main() or 0
    except WorkloadError as exc:
        print(f"WORKLOAD FAILED: {exc}", file=sys.stderr, flush=True)
        sys.exit(WORKLOAD_FAILED)
    if code == GOAL_MISSED:
        print("a goal was MISSED (exit 1)", file=sys.stderr, flush=True)
    sys.exit(code)
