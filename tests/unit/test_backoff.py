"""The shared back-off formula (service/backoff.py)."""

from __future__ import annotations

import random

import pytest

from service.backoff import equal_jitter, exponential


def test_exponential_doubles_from_the_base_up_to_the_cap() -> None:
    delays = [exponential(n, 0.5, 30.0) for n in range(1, 10)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


def test_exponential_survives_a_very_long_outage() -> None:
    # 2.0 ** 5000 would overflow: the exponent is bounded, the cap still applies.
    assert exponential(5000, 0.5, 30.0) == 30.0


def test_exponential_before_the_first_attempt_is_half_the_base() -> None:
    # The stream engine's callers may pass attempt 0; that has always meant base / 2.
    assert exponential(0, 0.5, 30.0) == 0.25


@pytest.mark.parametrize("delay", [0.0, 0.1, 30.0])
def test_equal_jitter_stays_between_half_and_the_whole_delay(delay: float) -> None:
    rng = random.Random(7)
    drawn = [equal_jitter(delay, rng) for _ in range(200)]
    assert all(delay / 2 <= d <= delay for d in drawn)
    if delay:
        assert len(set(drawn)) > 100  # actually random, not a constant


def test_equal_jitter_is_reproducible_from_the_generator() -> None:
    a = [equal_jitter(4.0, random.Random(1)) for _ in range(3)]
    b = [equal_jitter(4.0, random.Random(1)) for _ in range(3)]
    assert a == b
