"""A proxy in front of kube-apiserver that holds one replica's PATCH in flight.

The replica speaks plain HTTP to the proxy (its kubeconfig names ``http://127.0.0.1:
<port>`` and no credentials); the proxy speaks TLS to the API server with the dev
stack's admin certificate. Plain HTTP on the replica's side is what lets it see where a
request starts: once armed, the first connection that sends ``PATCH <path_prefix>`` has
everything from that request on held back, the way a stalled network or a paused
process holds a request that was already written. The replica's client times out or
the replica dies; the held bytes stay, with the connection to the API server open, until
:meth:`HoldProxy.release` delivers them and reads the API server's answer; from then on
that connection passes through too (a replica's next request on it, after a conflict say).

Every other connection (watches, reads, other writes) passes through untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["HoldProxy"]

_CHUNK = 64 * 1024


@dataclass
class _Held:
    upstream: asyncio.StreamWriter
    data: bytearray
    answer: bytearray = field(default_factory=bytearray)
    answered: asyncio.Event = field(default_factory=asyncio.Event)
    released: bool = False  # delivered: what the replica sends next passes through


@dataclass
class HoldProxy:
    """``async with HoldProxy(port, pki_dir) as proxy:`` listens on ``proxy.port``."""

    upstream_port: int
    pki_dir: Path
    path_prefix: bytes = b"/apis/cortex.cloud/v1alpha1/reservations/"
    armed: bool = False
    held_event: asyncio.Event = field(default_factory=asyncio.Event)
    _held: _Held | None = None
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return int(self._server.sockets[0].getsockname()[1])

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig for the replica behind this proxy, written to ``path``."""
        path.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: held\n  cluster:\n    server: http://127.0.0.1:{self.port}\n"
            "users:\n- name: anonymous\n  user: {}\n"
            "contexts:\n- name: held\n  context: {cluster: held, user: anonymous}\n"
            "current-context: held\n"
        )
        return path

    async def __aenter__(self) -> HoldProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    async def release(self, timeout_s: float = 30.0) -> str:
        """Deliver the held request; the API server's status line for it."""
        held = self._held
        assert held is not None, "no request held"
        held.upstream.write(bytes(held.data))
        held.data.clear()
        held.released = True
        await held.upstream.drain()
        async with asyncio.timeout(timeout_s):
            await held.answered.wait()
        return bytes(held.answer).split(b"\r\n", 1)[0].decode()

    def _tls(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki_dir / "ca.crt"))
        ctx.load_cert_chain(self.pki_dir / "admin.crt", self.pki_dir / "admin.key")
        return ctx

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(
            "127.0.0.1", self.upstream_port, ssl=self._tls(), server_hostname="127.0.0.1"
        )
        mine: list[_Held] = []  # this connection's hold, once it holds
        down = asyncio.create_task(self._down(up_r, client_w, mine))
        self._tasks.add(down)
        down.add_done_callback(self._tasks.discard)
        try:
            while chunk := await client_r.read(_CHUNK):
                if mine and not mine[0].released:
                    mine[0].data += chunk
                    continue
                if mine:  # a later request of the replica on this connection
                    up_w.write(chunk)
                    await up_w.drain()
                    continue
                start = chunk.find(b"PATCH " + self.path_prefix) if self.armed else -1
                if start < 0:
                    up_w.write(chunk)
                    await up_w.drain()
                    continue
                self.armed = False
                up_w.write(chunk[:start])
                await up_w.drain()
                self._held = _Held(up_w, bytearray(chunk[start:]))
                mine.append(self._held)
                self.held_event.set()
        except (ConnectionError, OSError):
            pass
        # The replica is gone (or closed): a held request keeps its connection to the API
        # server open, as a request already on the wire would, until it is answered.
        if not mine:
            up_w.close()

    async def _down(
        self, up_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, mine: list[_Held]
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while chunk := await up_r.read(_CHUNK):
                if mine:
                    held = mine[0]
                    held.answer += chunk
                    if b"\r\n" in held.answer:
                        held.answered.set()
                with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                    client_w.write(chunk)
                    await client_w.drain()
        client_w.close()
