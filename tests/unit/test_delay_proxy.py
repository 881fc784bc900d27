"""The benchmarks' TCP delay proxy (bench/delay_proxy.py) against a local echo server."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import time
from collections.abc import AsyncIterator
from types import ModuleType

import pytest_asyncio

from tests.conftest import REPO


def _load() -> ModuleType:
    # bench/ is a directory of scripts, not a package.
    spec = importlib.util.spec_from_file_location("delay_proxy", REPO / "bench" / "delay_proxy.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


delay_proxy = _load()
# Long enough that a loaded CI machine's loop stalls (they add up over the two hops: one
# measured 0.25 s) fit in SLACK_S while SLACK_S stays below one more delay: a proxy that
# delayed twice, or held a chunk behind the one before it, still fails.
ONE_WAY_S = 0.5
SLACK_S = 0.25


@pytest_asyncio.fixture
async def echo_port() -> AsyncIterator[int]:
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def _roundtrip(port: int, payload: bytes) -> tuple[bytes, float]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        t = time.monotonic()
        w.write(payload)
        await w.drain()
        got = await r.readexactly(len(payload))
        return got, time.monotonic() - t
    finally:
        w.close()
        await w.wait_closed()


async def test_each_direction_gets_the_delay_and_bytes_pass_unchanged(echo_port: int) -> None:
    direct, direct_s = await _roundtrip(echo_port, b"x")
    async with delay_proxy.DelayProxy("127.0.0.1", echo_port, ONE_WAY_S) as proxy:
        payload = os.urandom(300_000)  # several chunks
        got, rtt = await _roundtrip(proxy.port, payload)
        assert got == payload
        small, small_rtt = await _roundtrip(proxy.port, b"ping")
        assert small == b"ping"
        assert proxy.connections == 2
    assert direct == b"x"
    assert direct_s < ONE_WAY_S
    # Two one-way delays (there and back), not more: the proxy adds latency, not queueing.
    assert 2 * ONE_WAY_S <= small_rtt < 2 * ONE_WAY_S + SLACK_S, small_rtt
    assert 2 * ONE_WAY_S <= rtt < 2 * ONE_WAY_S + 0.5, rtt


async def test_chunks_in_flight_are_not_delayed_one_after_another(echo_port: int) -> None:
    """Ten messages sent 10 ms apart on one connection each come back one round trip
    after it was sent. A proxy that slept per read, in line, would forward the second
    message only after the first one's delay: it comes back about one delay late (what
    arrived meanwhile is read at once, so only the messages just behind a sleep are)."""
    async with delay_proxy.DelayProxy("127.0.0.1", echo_port, ONE_WAY_S) as proxy:
        r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
        try:
            sent: list[float] = []
            for i in range(10):
                sent.append(time.monotonic())
                w.write(bytes([i]) * 10)
                await w.drain()
                await asyncio.sleep(0.01)
            rtts = []
            for i in range(10):  # all sent before the first can be back
                assert await r.readexactly(10) == bytes([i]) * 10
                rtts.append(time.monotonic() - sent[i])
        finally:
            w.close()
            await w.wait_closed()
    assert all(2 * ONE_WAY_S <= rtt < 2 * ONE_WAY_S + SLACK_S for rtt in rtts), rtts


async def test_concurrent_connections_do_not_wait_for_each_other(echo_port: int) -> None:
    async with delay_proxy.DelayProxy("127.0.0.1", echo_port, ONE_WAY_S) as proxy:
        t = time.monotonic()
        results = await asyncio.gather(*(_roundtrip(proxy.port, b"%d" % i) for i in range(8)))
        elapsed = time.monotonic() - t
    assert [got for got, _ in results] == [b"%d" % i for i in range(8)]
    assert elapsed < 2 * ONE_WAY_S + SLACK_S, elapsed  # one after another: 8 round trips
