"""The replica's transaction pace (CRS_COMMIT_RATE_MAX): the schedule, and the committers
waiting on it."""

from __future__ import annotations

import pytest

from service.stream.engine.pacing import ReplicaPace
from tests.fake_kafka import FakeBroker
from tests.unit.engine.harness import IN, TP0, TP1, Harness, now, outputs, until


def test_no_rate_never_waits() -> None:
    pace = ReplicaPace(0, 4)
    assert [pace.reserve(5.0) for _ in range(100)] == [0.0] * 100


def test_a_burst_at_once_then_one_slot_per_interval_in_booking_order() -> None:
    pace = ReplicaPace(10, 3)  # a slot per 0.1 s
    assert [pace.reserve(100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert [pace.reserve(100.0) for _ in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    # Booked for 100.3 already: later bookings queue behind it.
    assert pace.reserve(100.25) == pytest.approx(0.15)


def test_a_quiet_spell_saves_no_more_than_the_burst() -> None:
    pace = ReplicaPace(10, 3)
    pace.reserve(0.0)
    assert [pace.reserve(60.0) for _ in range(4)] == pytest.approx([0.0, 0.0, 0.0, 0.1])


async def test_past_the_rate_a_commit_waits_for_its_slot_and_carries_what_was_decided_meanwhile(
    broker: FakeBroker,
) -> None:
    # One slot per second for the replica, four back to back: two partitions' first four
    # commits are at once, the fifth waits for the next slot (about a second), and a
    # record of its partition decided during that wait is committed in the same
    # transaction.
    h = Harness(broker, commit_rate_max=1)
    await h.start(TP0, TP1)
    for i, tp in enumerate([TP0, TP1, TP0, TP1]):
        broker.append(IN, tp.partition, b"k%d" % i, b"v%d" % i)
        await until(lambda n=i + 1: len(outputs(broker)) == n)  # type: ignore[misc]
    assert broker.commits == 4
    started = now()
    broker.append(IN, 0, b"k4", b"v4")
    await until(lambda: h.uncommitted(TP0) == 1)  # decided; its commit waits for a slot
    broker.append(IN, 0, b"k5", b"v5")
    await until(lambda: h.uncommitted(TP0) == 2)
    await until(lambda: len(outputs(broker)) == 6, limit_s=3)
    assert now() - started >= 0.9
    assert broker.commits == 5  # both in the fifth slot's transaction
    await h.stop()
