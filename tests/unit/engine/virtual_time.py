"""A virtual-time event loop: the engine tests' fake time (see conftest.py)."""

from __future__ import annotations

import asyncio
import selectors
import time
from typing import Any


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


class _VirtualSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:  # no timer at all: only I/O or another thread can wake it
            return super().select(None)  # type: ignore[no-any-return]
        events = super().select(0)
        if not events and timeout > 0:
            self._loop.advance(timeout)
        return events  # type: ignore[no-any-return]
