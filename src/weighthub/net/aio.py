"""Async frame I/O on raw non-blocking sockets, and cut-through forwarding of a pushed chunk.

`sock_recv_into` a preallocated buffer and `sock_sendall` of memoryviews: no copy in Python on
either side (the measured reason for framed TCP, see `wire`). Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass, field

import msgspec

from ..errors import LimitError
from . import auth, wire

log = logging.getLogger(__name__)


async def recv_exact(sock: socket.socket, view: memoryview, timeout: float) -> int:
    """Fill `view`; returns bytes read (< len(view) only at EOF). Each recv waits <= timeout."""
    loop = asyncio.get_running_loop()
    got = 0
    while got < len(view):
        # asyncio.timeout, not wait_for: wait_for wraps each recv in a task of its own, a
        # cost every stranger's connection paid (measured: it bounds how fast a server sheds them)
        async with asyncio.timeout(timeout):
            k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            break
        got += k
    return got


async def recv_header(sock: socket.socket, magic: bytes, timeout: float,
                      where: str) -> bytes | None:
    """The next frame's raw header; None on a clean EOF before it. Raises LimitError, OSError."""
    prefix = bytearray(wire.PREFIX.size)
    got = await recv_exact(sock, memoryview(prefix), timeout)
    if got == 0:
        return None
    if got < len(prefix):
        raise ConnectionError(f"{where}: connection closed inside a frame prefix")
    raw = bytearray(wire.header_length(bytes(prefix), magic, where))
    if await recv_exact(sock, memoryview(raw), timeout) < len(raw):
        raise ConnectionError(f"{where}: connection closed inside a frame header")
    return bytes(raw)


async def send(sock: socket.socket, head: bytes, body: bytes | memoryview | None,
               timeout: float) -> None:
    loop = asyncio.get_running_loop()
    await asyncio.wait_for(loop.sock_sendall(sock, head), timeout)
    if body:
        await asyncio.wait_for(loop.sock_sendall(sock, body), timeout)


async def connect(addr: str, timeout: float) -> socket.socket:
    loop = asyncio.get_running_loop()
    host, port = wire.parse_addr(addr)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, (host, port)), timeout)
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass(slots=True)
class Incoming:
    """A body arriving into `view`; forwarders follow `got` (bytes valid so far)."""

    view: memoryview
    got: int = 0
    broken: bool = False  # the upstream failed: forwarders stop
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def advance(self, got: int) -> None:
        async with self.changed:
            self.got = got
            self.changed.notify_all()

    async def wait_past(self, sent: int, timeout: float) -> int:
        """Wait until more than `sent` bytes are valid; how many (-1 if the upstream broke)."""
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: self.got > sent or self.broken),
                                   timeout)
            return -1 if self.broken else self.got

    async def break_(self) -> None:
        async with self.changed:
            self.broken = True
            self.changed.notify_all()


async def forward(hop: wire.Hop, req: wire.Request, body: Incoming, secret: bytes, *,
                  connect_timeout: float, io_timeout: float, done_timeout: float) -> list[str]:
    """Push the chunk arriving in `body` to `hop` (and, through it, its subtree), cut-through.

    Returns the addresses in the subtree that did not get the chunk (all of them if `hop`
    itself failed; what `hop` reports otherwise). Never raises for a peer's failure.
    """
    sub = msgspec.structs.replace(req, auth="", tree=hop.children)
    sub = msgspec.structs.replace(sub, auth=auth.sign(secret, *wire.auth_subject(sub)))
    size = len(body.view)
    try:
        sock = await connect(hop.addr, connect_timeout)
    except (OSError, TimeoutError, LimitError):
        return wire.addresses(hop)
    try:
        loop = asyncio.get_running_loop()
        await send(sock, wire.pack(wire.REQUEST_MAGIC, sub), None, io_timeout)
        sent = 0
        while sent < size:
            upto = await body.wait_past(sent, io_timeout)
            if upto < 0:
                return wire.addresses(hop)
            await asyncio.wait_for(loop.sock_sendall(sock, body.view[sent:upto]), io_timeout)
            sent = upto
        raw = await recv_header(sock, wire.RESPONSE_MAGIC, done_timeout, hop.addr)
        if raw is None:
            return wire.addresses(hop)
        resp = wire.decode_response(raw, hop.addr)
        return list(resp.failed) if resp.status == "ok" else wire.addresses(hop)
    except (OSError, TimeoutError, ConnectionError, LimitError):
        return wire.addresses(hop)
    except Exception:  # a bug, or an answer nothing above foresaw: that hop failed, the push goes on
        log.exception("forwarding %s to %s failed", req.key, hop.addr)
        return wire.addresses(hop)
    finally:
        sock.close()
