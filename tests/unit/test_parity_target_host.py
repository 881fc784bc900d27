"""targetHost absent/null vs "": the reference tests the pointer, not the string.

The reference controller calls RecordPlacement whenever ``Status.Result.TargetHost`` is
non-nil (after checking the skip option) and RecordNoHostFound only when it is nil, so a
decision with ``targetHost: ""`` is a placement onto the host named "".
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from service.crs import Recorder
from service.stream.codec import INPUT_TYPE, decode_input
from tests import nova
from tests.unit.test_parity import KNOWLEDGE, P, _State


class _Counter:
    """The labels().inc() surface of a prometheus Counter, keeping counts per label set."""

    def __init__(
        self,
        counts: dict[tuple[tuple[str, str], ...], float] | None = None,
        key: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.counts = {} if counts is None else counts
        self._key = key

    def labels(self, *args: str, **kwargs: str) -> _Counter:
        return _Counter(self.counts, tuple(sorted(kwargs.items())))

    def inc(self, amount: float = 1) -> None:
        self.counts[self._key] = self.counts.get(self._key, 0) + amount


def _record(result: dict[str, Any], *, skip: bool | None) -> tuple[Any, _Counter, _Counter]:
    request = nova.request(
        "vm-1", project_id=P, flavor_name="f-small", hosts=["h0"], skip_cr_tracking=skip
    )
    event = {
        "specversion": "1.0",
        "id": "e-1",
        "source": "test",
        "type": INPUT_TYPE,
        "data": {"decision": {"result": result}, "request": request},
    }
    decoded = decode_input(json.dumps(event).encode(), None, max_bytes=1 << 20)
    placements, no_host = _Counter(), _Counter()
    recorder = Recorder(_State(KNOWLEDGE), placements, no_host)
    outcome = asyncio.run(recorder.record(decoded.data.decision, decoded.data.request))
    return outcome, placements, no_host


@pytest.mark.parametrize(
    "result",
    [{"orderedHosts": ["h0"]}, {"targetHost": None, "orderedHosts": ["h0"]}],
    ids=["absent", "null"],
)
@pytest.mark.parametrize("skip", [None, True])
def test_absent_or_null_target_is_no_host_found(result: dict[str, Any], skip: bool | None) -> None:
    outcome, placements, no_host = _record(result, skip=skip)
    assert (outcome.kind, outcome.target_host) == ("no_host_found", None)
    # The skip option is consulted for placements only.
    assert outcome.cr_slot == "slot_blocked"
    assert sum(no_host.counts.values()) == 1
    assert placements.counts == {}


def test_empty_target_with_skip_counts_nothing() -> None:
    outcome, placements, no_host = _record({"targetHost": "", "orderedHosts": ["h0"]}, skip=True)
    assert (outcome.kind, outcome.cr_slot, outcome.target_host) == ("placement", "skipped", "")
    assert placements.counts == {}
    assert no_host.counts == {}


def test_empty_target_is_a_placement_classified_on_the_candidates() -> None:
    outcome, placements, no_host = _record({"targetHost": "", "orderedHosts": ["h0"]}, skip=None)
    # h0 (a candidate) has a matching slot: slot_used; no slot on host "" to write into.
    assert (outcome.kind, outcome.cr_slot, outcome.target_host) == ("placement", "slot_used", "")
    assert outcome.allocation == "no_slot"
    assert placements.counts == {
        (("cr_slot", "slot_used"), ("flavor_group", "ga"), ("intent", "Unknown")): 1
    }
    assert no_host.counts == {}
