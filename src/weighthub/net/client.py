"""PeerClient: blocking calls to one chunk server, each bounded by timeouts.

Blocking sockets, because its callers are synchronous (the Store protocol, the Receiver's fetch
threads, the Publisher's encode threads). `recv_into` a preallocated buffer keeps one stream at
the transport's speed. A connection is opened per request and closed after it (a few hundred
microseconds on a LAN against chunks of MiB); nothing is shared between threads.

Timeouts: `connect_timeout` for the connection, `io_timeout` for each socket operation, and
`deadline` for the whole request, so a peer that dribbles bytes cannot hold a caller longer
than that. Errors name the peer, and say whether to wait or to ask another:
PeerTimeout (no answer in time, unreachable, the connection dropped mid-answer), PeerRefused
(nothing listens on the port, busy, not holding the version, a malformed answer), AuthError (our
token was refused), ObjectNotFound (the peer does not have the key).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import cast

import msgspec

from ..errors import AuthError, LimitError, NetError, ObjectNotFound, PeerRefused, PeerTimeout
from ..format import chunk_checksum
from . import auth, wire


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds: to connect, per socket operation, and for a whole request."""

    connect: float = 3.0
    io: float = 10.0
    deadline: float = 60.0


DEFAULT_TIMEOUTS = Timeouts()


class PeerClient:
    """Requests to the chunk server at `addr` ("host:port").

    Args:
        addr: the server.
        secret: the shared secret (`auth.load_secret`).
        timeouts: see module docstring.
        max_body: largest response body accepted (refused before allocating).
    """

    def __init__(self, addr: str, secret: bytes, *, timeouts: Timeouts = DEFAULT_TIMEOUTS,
                 max_body: int = 1 << 30) -> None:
        self.addr = addr
        self.host, self.port = wire.parse_addr(addr)
        self.secret = secret
        self.connect_timeout = timeouts.connect
        self.io_timeout = timeouts.io
        self.deadline = timeouts.deadline
        self.max_body = max_body

    def __repr__(self) -> str:
        return f"PeerClient({self.addr!r})"

    # -- ops --------------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        """A store object of a version the peer serves. Raises ObjectNotFound, PeerTimeout,
        PeerRefused, AuthError."""
        return self._call(wire.Request("get", key=key))[1]

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of a store object (clipped at its end)."""
        return self._call(wire.Request("range", key=key, start=start, stop=stop))[1]

    def dense_range(self, version: int, tensor: str, start: int, stop: int, *, lease: str) -> bytes:
        """Bytes [start, stop) of `tensor`'s canonical bits at `version`, under read lease `lease`.

        The holder defers its next apply while the lease is open: call `release(lease)` when done.
        """
        return self._call(wire.Request("dense", version=version, tensor=tensor, start=start,
                                       stop=stop, lease=lease))[1]

    def release(self, lease: str) -> None:
        self._call(wire.Request("release", lease=lease))

    def versions(self) -> list[int]:
        return list(self._call(wire.Request("versions"))[0].versions)

    def push(self, key: str, data: bytes | memoryview, tree: list[wire.Hop] | None = None,
             checksum: str | None = None) -> list[str]:
        """Push a chunk to this peer, which forwards it to `tree` (its subtree) and stages it.

        Returns the addresses in the subtree that did not get it (the peer itself got it).
        Raises PeerTimeout / PeerRefused if the peer itself failed to take it.
        """
        view = memoryview(data).cast("B")
        digest = checksum or chunk_checksum(view)
        resp, _ = self._call(wire.Request("push", key=key, size=len(view), checksum=digest,
                                          tree=tree or []), view)
        return list(resp.failed)

    # -- transport --------------------------------------------------------------------------
    def _call(self, req: wire.Request, body: memoryview | None = None) -> tuple[wire.Response, bytes]:
        req = msgspec.structs.replace(req, auth=auth.sign(self.secret, *wire.auth_subject(req)))
        where = f"peer {self.addr}"
        end = time.monotonic() + self.deadline
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except ConnectionRefusedError as exc:
            raise PeerRefused(f"{where}: connection refused (nothing listens there: the peer is "
                              "down or moved); ask another") from exc
        except OSError as exc:  # timed out or unreachable: as good as no answer
            raise PeerTimeout(f"{where}: cannot connect within {self.connect_timeout:g}s "
                              f"({exc}); the peer is down or partitioned: ask another") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.io_timeout)
            sock.sendall(wire.pack(wire.REQUEST_MAGIC, req))
            if body is not None:
                self._send_body(sock, body, end, where)
            prefix = self._recv(sock, wire.PREFIX.size, end, where)
            hlen = wire.header_length(prefix, wire.RESPONSE_MAGIC, where)
            resp = wire.decode_response(self._recv(sock, hlen, end, where), where)
            if resp.size > self.max_body or resp.size < 0:
                raise LimitError(f"{where}: response body of {resp.size} bytes over {self.max_body}")
            data = self._recv(sock, resp.size, end, where) if resp.size else b""
        except TimeoutError as exc:
            raise PeerTimeout(f"{where}: no answer within {self.io_timeout:g}s for "
                              f"{req.op} {req.key}") from exc
        except OSError as exc:  # reset or broken pipe: the peer went away mid-request
            raise PeerTimeout(f"{where}: {req.op} {req.key} failed ({exc}); the connection "
                              "dropped") from exc
        except LimitError as exc:
            raise PeerRefused(f"{where}: malformed answer: {exc}") from exc
        finally:
            sock.close()
        _raise_for(resp, req, where)
        return resp, data

    def _send_body(self, sock: socket.socket, body: memoryview, end: float, where: str) -> None:
        step = 4 << 20  # check the deadline between pieces
        for i in range(0, len(body), step):
            if time.monotonic() > end:
                raise PeerTimeout(f"{where}: push not done within {self.deadline:g}s")
            sock.sendall(body[i:i + step])

    def _recv(self, sock: socket.socket, n: int, end: float, where: str) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            if time.monotonic() > end:
                raise PeerTimeout(f"{where}: answer not complete within {self.deadline:g}s "
                                  f"({got}/{n} bytes); too slow")
            k = sock.recv_into(view[got:])
            if k == 0:
                raise PeerTimeout(f"{where}: connection closed after {got}/{n} bytes")
            got += k
        # Large bodies stay in their receive buffer (a copy to bytes would cost ~10% of the
        # transfer): a bytearray has bytes' whole read API, and nobody else holds it.
        return bytes(buf) if n < 4096 else cast(bytes, buf)


def _raise_for(resp: wire.Response, req: wire.Request, where: str) -> None:
    if resp.status == "ok":
        return
    msg = resp.message or f"{where}: {resp.status}"
    if resp.status == wire.AUTH:
        raise AuthError(f"{msg} (refused by {where}: check that WEIGHTHUB_SECRET matches)")
    if resp.status == wire.NOT_FOUND:
        raise ObjectNotFound(msg)
    if resp.status in (wire.REFUSED, wire.FAILED):  # busy, or not holding what was asked
        raise PeerRefused(msg)
    raise NetError(f"{msg} ({req.op} refused as a bad request)")
