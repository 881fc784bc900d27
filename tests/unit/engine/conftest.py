"""The in-memory broker each engine test runs against."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from tests.fake_kafka import FakeBroker


@pytest_asyncio.fixture
async def broker() -> AsyncIterator[FakeBroker]:
    yield FakeBroker()
