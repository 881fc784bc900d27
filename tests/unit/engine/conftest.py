"""Every engine test runs on fake time, against an in-memory broker.

The event loop of tests/unit/engine/ is a :class:`VirtualTimeLoop`: its clock moves only
when nothing is left to run, and then straight to the next timer. Every ``asyncio.sleep``
and ``wait_for`` bound of the engine, of the fake broker (its delays) and of the tests
passes on that clock; it never waits in real time, and a bound passes only once every
task that could run before it has run, however busy the machine is. The engine's own
clock (``clock=``) is the loop's (``Harness``) or a :class:`~harness.FakeClock` the test
moves by hand.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.fake_kafka import FakeBroker
from tests.unit.engine.virtual_time import VirtualTimeLoop


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    return {"virtual_time": VirtualTimeLoop}


@pytest.fixture
def broker() -> FakeBroker:
    return FakeBroker()
