"""Counters that advance when their outcome commits (service.stream.deferred)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from service.stream import deferred


class CountingChild:
    """A counter child that records every inc call."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def inc(self, amount: float = 1) -> None:
        self.calls.append(amount)


def test_increments_inside_a_capture_wait_for_apply() -> None:
    counter = deferred.DeferredCounter(
        Counter("t_events", "test", ["kind"], registry=CollectorRegistry())
    )
    with deferred.capture() as counts:
        counter.labels("a").inc()
        counter.labels("a").inc(2)
    assert counter.labels("a")._value.get() == 0  # not committed yet
    deferred.apply([counts])
    assert counter.labels("a")._value.get() == 3
    counter.labels("b").inc()  # outside a capture: at once
    assert counter.labels("b")._value.get() == 1


def test_apply_sums_per_child_and_increments_each_once() -> None:
    a, b = CountingChild(), CountingChild()
    records: list[deferred.Increments] = [[(a, 1.0), (b, 1.0)], [(a, 1.0)], [], [(a, 2.0)]]
    deferred.apply(records)
    assert a.calls == [4.0]  # one locked inc for the whole commit, the same total
    assert b.calls == [1.0]
