"""A virtual-time event loop: the engine tests' fake time (see conftest.py)."""

from __future__ import annotations

import asyncio
import selectors
import time
from typing import Any

# Loop turns in a row with work ready and the clock standing still, after which the
# clock moves on to the next timer all the same: a task that spins (sleep(0)) until a
# timer fires gets there as on a real loop, whose clock runs meanwhile, instead of
# livelocking the test. Far more turns than any test's bursts of work take.
_SPIN_TURNS = 100_000


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose time is virtual: where the real loop would block in select()
    until its next timer, this one polls without waiting and jumps its clock to that
    timer. Real I/O and thread wake-ups are still seen (each select polls them)."""

    def __init__(self) -> None:
        super().__init__(_VirtualSelector(self))
        self._virtual_now = time.monotonic()  # from where the real loop's clock is

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        self._virtual_now += seconds

    def next_timer_in(self) -> float | None:
        """Seconds until the earliest timer, None without one."""
        scheduled = self._scheduled  # type: ignore[attr-defined]
        return max(scheduled[0].when() - self._virtual_now, 0.0) if scheduled else None


class _VirtualSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop
        self._spins = 0

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:  # no timer at all: only I/O or another thread can wake it
            return super().select(None)  # type: ignore[no-any-return]
        events = super().select(0)
        if events or timeout > 0:
            self._spins = 0
            if not events:
                self._loop.advance(timeout)
        else:
            self._spins += 1
            if self._spins >= _SPIN_TURNS and (wait := self._loop.next_timer_in()) is not None:
                self._spins = 0
                self._loop.advance(wait)
        return events  # type: ignore[no-any-return]
