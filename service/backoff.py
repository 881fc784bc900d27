"""Capped exponential back-off: the one formula the service's retry loops share.

Pure (no clock, no sleep, no I/O): callers sleep themselves, and jitter draws from the
caller's random generator so a test can fix it.
"""

from __future__ import annotations

import random
from typing import Final

__all__ = ["equal_jitter", "exponential"]

# Past this many doublings every realistic delay has hit its cap long ago; bounding the
# exponent keeps a retry count from a days-long outage from overflowing the float.
_MAX_DOUBLINGS: Final = 64


def exponential(attempt: int, base_s: float, max_s: float) -> float:
    """``base_s`` for attempt 1, doubling with each further attempt, at most ``max_s``."""
    return min(base_s * 2.0 ** min(attempt - 1, _MAX_DOUBLINGS), max_s)


def equal_jitter(delay_s: float, rng: random.Random) -> float:
    """Half of ``delay_s`` fixed, half random ("equal jitter").

    Clients that failed together spread their retries out, and none retries sooner than
    half its back-off.
    """
    return delay_s / 2 + rng.uniform(0.0, delay_s / 2)
