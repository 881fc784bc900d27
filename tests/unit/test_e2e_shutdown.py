"""tests/e2e.py's shutdown of the in-process service fails the test on a crash or a hang
of its run task, and stops the runtime in every case (it suppressed both before)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests import e2e


class FakeRuntime:
    """The lifecycle calls running() makes; ``run`` as the test scripts it."""

    def __init__(self, run: str) -> None:
        self.how = run
        self.stop_requested = asyncio.Event()
        self.stopped = False

    async def run(self) -> None:
        if self.how == "crash-at-stop":
            await self.stop_requested.wait()
            raise RuntimeError("closing the consumer failed")
        if self.how == "hang":
            await asyncio.Event().wait()
        await self.stop_requested.wait()

    def request_stop(self) -> None:
        self.stop_requested.set()

    async def stop(self) -> None:
        self.stopped = True


async def shut_down(how: str) -> FakeRuntime:
    runtime = FakeRuntime(how)
    task = asyncio.create_task(runtime.run())
    await asyncio.sleep(0)
    fake: Any = runtime
    await e2e._shut_down(fake, task)
    return runtime


async def test_a_clean_stop_passes() -> None:
    assert (await shut_down("clean")).stopped


async def test_a_crash_at_shutdown_fails_the_test_and_still_stops() -> None:
    runtime = FakeRuntime("crash-at-stop")
    task = asyncio.create_task(runtime.run())
    await asyncio.sleep(0)
    fake: Any = runtime
    with pytest.raises(AssertionError, match="crashed: RuntimeError"):
        await e2e._shut_down(fake, task)
    assert runtime.stopped


async def test_a_hang_at_shutdown_fails_the_test_and_still_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(e2e, "SHUTDOWN_S", 0.05)
    runtime = FakeRuntime("hang")
    task = asyncio.create_task(runtime.run())
    await asyncio.sleep(0)
    fake: Any = runtime
    with pytest.raises(AssertionError, match=r"did not end within 0\.05 s"):
        await e2e._shut_down(fake, task)
    assert runtime.stopped
    assert task.cancelled()
