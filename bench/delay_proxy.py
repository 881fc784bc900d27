"""A TCP proxy that puts a fixed one-way latency on every chunk, in each direction.

Run: ``.venv/bin/python bench/delay_proxy.py --upstream 127.0.0.1:16443 --one-way-ms 10``
(listens on 127.0.0.1, port ``--port`` or ``CRS_DEVSTACK_DELAY_PROXY_PORT``, default any
free port; the port chosen is printed).

It models distance, not a slow link: each chunk read from one side is written to the
other ``one_way_s`` after it was read, and chunks behind it are not held back by its
delay (a reader task stamps chunks, a writer task releases them on time, in order). So a
request/response exchange costs ``2 * one_way_s`` more, however many are in flight, and
the throughput of a connection is unchanged. TLS passes through untouched (the client
still talks to the upstream's certificate; kube-apiserver's covers ``IP:127.0.0.1`` for
any port).

Used by ``bench_placements.py`` to put the API server "20 ms away" (``--one-way-ms 10``).
Kept dependency-free (asyncio only) so it needs nothing installed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field

__all__ = ["DelayProxy"]

_CHUNK = 64 * 1024


@dataclass
class DelayProxy:
    """``async with DelayProxy(host, port, one_way_s) as proxy:`` listens on ``proxy.port``."""

    upstream_host: str
    upstream_port: int
    one_way_s: float
    listen_port: int = 0
    connections: int = 0
    bytes_forwarded: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.listen_port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> DelayProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        self.connections += 1
        upstream_w: asyncio.StreamWriter | None = None
        try:
            upstream_r, upstream_w = await asyncio.open_connection(
                self.upstream_host, self.upstream_port
            )
            # Either direction ending ends the connection (a half-close is not modelled:
            # HTTP clients do not rely on it).
            pipes = [
                asyncio.create_task(self._pipe(client_r, upstream_w)),
                asyncio.create_task(self._pipe(upstream_r, client_w)),
            ]
            try:
                await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for p in pipes:
                    p.cancel()
                for p in pipes:
                    with contextlib.suppress(BaseException):
                        await p
        except OSError:
            pass
        finally:
            for w in (client_w, upstream_w):
                if w is not None:
                    w.close()
                    with contextlib.suppress(Exception):
                        await w.wait_closed()
            self._tasks.discard(task)  # type: ignore[arg-type]

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def release() -> None:
            while True:
                due, chunk = await queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not chunk:  # EOF travels with the same delay as data
                    return
                writer.write(chunk)
                await writer.drain()
                self.bytes_forwarded += len(chunk)

        releaser = asyncio.create_task(release())
        try:
            while True:
                chunk = await reader.read(_CHUNK)
                queue.put_nowait((time.monotonic() + self.one_way_s, chunk))
                if not chunk:
                    break
            await releaser
        finally:
            releaser.cancel()
            with contextlib.suppress(BaseException):
                await releaser


async def _main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", required=True, help="host:port to forward to")
    ap.add_argument("--one-way-ms", type=float, required=True)
    ap.add_argument(
        "--port", type=int, default=int(os.environ.get("CRS_DEVSTACK_DELAY_PROXY_PORT", "0"))
    )
    args = ap.parse_args()
    host, _, port = args.upstream.rpartition(":")
    async with DelayProxy(host, int(port), args.one_way_ms / 1000, args.port) as proxy:
        print(f"127.0.0.1:{proxy.port} -> {args.upstream}, +{args.one_way_ms:g} ms each way")
        await asyncio.Event().wait()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main())
