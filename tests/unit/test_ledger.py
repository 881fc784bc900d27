"""The partition ledger: watermark, done-above-watermark metadata, restore after a crash."""

from __future__ import annotations

import random
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from service.stream import ledger as ledger_module
from service.stream.ledger import (
    MAX_METADATA_CHARS,
    Ledger,
    decode_metadata,
    encode_metadata,
)


def test_an_overflowing_commit_keeps_what_earlier_commits_recorded_as_done() -> None:
    """Open offsets that no longer fit the metadata must not erase done offsets an earlier
    commit published above the watermark: a new owner would process them again."""
    ledger: Ledger[int] = Ledger(start=0)
    for o in range(10):
        ledger.receive(o)
    ledger.complete(3, 3)  # 0, 1, 2 and 4.. are stuck (waiting on the API)
    first = ledger.plan()
    assert first is not None
    assert (first.offset, first.metadata) == (0, "crs1:3:1,2")
    ledger.committed(first)
    with mock.patch.object(ledger_module, "MAX_METADATA_CHARS", 12):
        ledger.complete(9, 9)  # high 9, open 1, 2, 4..8: no longer fits
        assert ledger.plan() is None  # nothing below the watermark to publish
        ledger.complete(0, 0)
        ledger.complete(1, 1)
        plan = ledger.plan()  # watermark 2; 4..8 still open above it
    assert plan is not None
    assert [o for o, _ in plan.items] == [0, 1]  # 9 waits: it does not fit
    assert plan.offset == 2
    taken_over: Ledger[int] = Ledger(plan.offset, plan.metadata)
    assert [o for o in range(2, 10) if taken_over.receive(o)] == [2, 4, 5, 6, 7, 8, 9]


def test_in_order_completion_commits_the_next_offset_without_metadata() -> None:
    ledger: Ledger[str] = Ledger(start=10)
    for o in (10, 11, 12):
        assert ledger.receive(o)
    for o in (10, 11, 12):
        ledger.complete(o, f"out{o}")
    plan = ledger.plan()
    assert plan is not None
    assert plan.offset == 13
    assert plan.metadata == ""
    assert [o for o, _ in plan.items] == [10, 11, 12]
    ledger.committed(plan)
    assert ledger.plan() is None
    assert ledger.in_flight == 0


def test_a_stuck_record_holds_the_watermark_but_not_the_outputs_behind_it() -> None:
    ledger: Ledger[str] = Ledger(start=0)
    for o in range(5):
        ledger.receive(o)
    for o in (0, 2, 4):
        ledger.complete(o, "x")
    plan = ledger.plan()
    assert plan is not None
    assert plan.offset == 1  # the lowest open offset
    assert [o for o, _ in plan.items] == [0, 2, 4]  # published now, not after offset 1
    assert decode_metadata(1, plan.metadata) == (4, [3])


def test_restored_metadata_skips_what_the_previous_owner_did() -> None:
    # Previous owner: watermark 1, done up to 4 except 3.
    meta = encode_metadata(1, 4, [3])
    ledger: Ledger[str] = Ledger(start=1, metadata=meta)
    processed = [o for o in range(1, 7) if ledger.receive(o)]
    assert processed == [1, 3, 5, 6]
    # Nothing new is committed until something is done.
    assert ledger.plan() is None


def test_restored_open_offsets_not_yet_fetched_stay_open_in_the_next_commit() -> None:
    meta = encode_metadata(100, 200, [150])
    ledger: Ledger[str] = Ledger(start=100, metadata=meta)
    assert ledger.receive(100)
    ledger.complete(100, "x")
    plan = ledger.plan()
    assert plan is not None
    # 150 has not been fetched yet: it must still be listed as open.
    assert plan.offset == 150
    assert decode_metadata(150, plan.metadata) == (200, [])


def test_duplicate_delivery_after_a_seek_is_ignored() -> None:
    ledger: Ledger[str] = Ledger(start=5)
    assert ledger.receive(5)
    assert not ledger.receive(5)
    assert not ledger.receive(3)


def test_gaps_in_offsets_are_not_open_records() -> None:
    # Transaction markers occupy offsets that never arrive as records.
    ledger: Ledger[str] = Ledger(start=0)
    ledger.receive(0)
    ledger.receive(2)
    ledger.complete(2, "x")
    ledger.complete(0, "y")
    plan = ledger.plan()
    assert plan is not None
    assert plan.offset == 3
    assert plan.metadata == ""


def test_unparseable_metadata_is_ignored() -> None:
    assert decode_metadata(5, "written by another tool") == (None, [])
    assert decode_metadata(5, "crs1:zz:!!") == (None, [])
    ledger: Ledger[str] = Ledger(start=5, metadata="crs1:not-base36!:")
    assert ledger.receive(5)
    assert ledger.receive(6)


def test_too_many_open_offsets_fall_back_to_the_contiguous_prefix() -> None:
    ledger: Ledger[str] = Ledger(start=0)
    n = 4000
    for o in range(n):
        ledger.receive(o)
    ledger.complete(0, "first")
    for o in range(2, n, 2):  # every other record done: thousands of open offsets
        ledger.complete(o, "x")
    plan = ledger.plan()
    assert plan is not None
    assert len(plan.metadata) <= MAX_METADATA_CHARS
    assert plan.offset == 1
    assert plan.metadata == ""
    assert [o for o, _ in plan.items] == [0]


@settings(max_examples=200, deadline=None)
@given(
    offsets=st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=30),
    seed=st.integers(min_value=0, max_value=2**32),
    start=st.integers(min_value=0, max_value=1000),
)
def test_the_settled_position_is_what_the_commit_writes_once_all_received_are_done(
    offsets: list[int], seed: int, start: int
) -> None:
    # What a transaction opened ahead sends as its offset (see the engine's commit
    # loop): right whenever every record received by then is done at the commit.
    ledger: Ledger[str] = Ledger(start=start)
    received, o = [], start
    for gap in offsets:  # gaps: transaction markers in the input
        o += gap
        assert ledger.receive(o)
        received.append(o)
        o += 1
    predicted = ledger.settled_position()
    random.Random(seed).shuffle(received)
    for r in received:
        ledger.complete(r, "x")
    plan = ledger.plan()
    assert plan is not None
    assert (plan.offset, plan.metadata) == (predicted, "")


def test_no_settled_position_while_restored_offsets_are_open() -> None:
    ledger: Ledger[str] = Ledger(start=100, metadata=encode_metadata(100, 200, [150]))
    assert ledger.receive(100)
    assert ledger.settled_position() is None  # 150 is still to come
    assert Ledger[str]().settled_position() is None  # nothing received yet


@settings(max_examples=1000, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=60),
    seed=st.integers(min_value=0, max_value=2**32),
    crashes=st.integers(min_value=0, max_value=4),
    limit=st.sampled_from([MAX_METADATA_CHARS, 12, 20]),
)
def test_any_completion_order_with_crashes_publishes_each_record_exactly_once(
    n: int, seed: int, crashes: int, limit: int
) -> None:
    """Owners take turns over one partition; each crashes at a random moment, losing what
    it had not committed. Across all of them, every offset is published exactly once,
    also when the open offsets often do not fit the metadata (a limit of 12 characters)."""
    with mock.patch.object(ledger_module, "MAX_METADATA_CHARS", limit):
        _owners_take_turns(n, random.Random(seed), crashes)


def _owners_take_turns(n: int, rng: random.Random, crashes: int) -> None:
    published: list[int] = []
    committed_offset: int | None = None
    committed_meta = ""
    for turn in range(crashes + 1):
        last = turn == crashes
        ledger: Ledger[int] = Ledger(committed_offset, committed_meta)
        start = committed_offset or 0
        todo = [o for o in range(start, n) if ledger.receive(o)]
        rng.shuffle(todo)
        stop_after = len(todo) if last else rng.randint(0, len(todo))
        for i, o in enumerate(todo):
            if i >= stop_after:
                break
            ledger.complete(o, o)
            if rng.random() < 0.3 or (last and i == len(todo) - 1):
                plan = ledger.plan()
                if plan is not None:
                    published.extend(p for _, p in plan.items)
                    committed_offset, committed_meta = plan.offset, plan.metadata
                    ledger.committed(plan)
        if last:
            plan = ledger.plan()
            if plan is not None:
                published.extend(p for _, p in plan.items)
                committed_offset, committed_meta = plan.offset, plan.metadata
    assert sorted(published) == list(range(n))
    assert committed_offset == n
