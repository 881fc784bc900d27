"""The replica's transaction pace: how many transactions all its partitions begin per second.

Each partition paces its own commits (committer.TokenBucket), but what a transaction
costs (about 1.5-2.5 ms of this process's CPU and as much of the broker's, whatever it
carries) is paid by the replica and the broker as a whole: four partitions each allowed
their own pace begin up to four times as many as one (bench_latency.py at 200 events/s:
0.77 transactions per event against the write-first bound's 0.46). A replica-wide limit
makes the partitions' transactions carry more records each once they would exceed it,
and costs nothing below it. What it buys is bounded: at 200 events/s the transactions
are about a sixth of the service's CPU, and waiting for a slot costs latency
(BENCHMARKS.md, "How much of it is the transactions"), so it is off by default.
"""

from __future__ import annotations

__all__ = ["BURST", "ReplicaPace"]

# Transactions of different partitions that may begin back to back under the limit.
BURST = 4


class ReplicaPace:
    """At most ``rate`` transactions per second begun across the replica, ``burst`` of
    them back to back (a GCRA: a virtual schedule of one slot per 1/rate seconds).

    :meth:`reserve` books the next slot and says how long to wait for it; bookings are
    served in the order they are made, so no partition starves. ``rate`` 0: no limit.
    """

    __slots__ = ("_due", "_interval", "_slack")

    def __init__(self, rate: float, burst: int = BURST) -> None:
        self._interval = 1.0 / rate if rate > 0 else 0.0
        self._slack = max(burst - 1, 0) * self._interval
        self._due = float("-inf")  # when the next slot is due on the schedule

    def reserve(self, now: float) -> float:
        """Book a transaction's slot; the seconds until it may begin (0: at once)."""
        if not self._interval:
            return 0.0
        # Unused slots of a quiet spell are kept only up to the burst.
        start = max(self._due, now - self._slack)
        self._due = start + self._interval
        return max(start - now, 0.0)
