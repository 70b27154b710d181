"""Admission to a chunk server: what a connection must do before it may hold a serving slot.

A connection that has not yet sent a complete, authenticated request is *pending*. Pending
connections hold no serving slot (`ChunkServer.max_connections` counts authenticated ones only),
so silent or trickling strangers cannot make the server busy for its peers. What bounds them:

    deadline      the first request (frame prefix and header) must be complete and authenticated
                  within `auth_timeout` of the accept. A whole-request deadline, not an idle
                  timeout: a peer that trickles one byte per second is cut at it all the same.
    per source    at most `max_pending_per_source` pending connections from one address (one
                  /64 for IPv6: one host can draw on a whole /64 at no cost).
    in total      at most `max_pending` pending connections (each holds a descriptor and a task).

At a cap the *oldest* pending connection goes: it has had the longest to authenticate and has
not, while the newest is most likely a live client whose request is in flight. At the source's
cap it is the source's oldest; at the total cap, the oldest of the source holding the most
(the heaviest user pays first, so a peer with one request in flight is the last to go). So an
attacker's new connections push out its own old ones, and a peer that shares its address still
gets in unless `max_pending_per_source` connections from there arrive within the peer's one
round trip. Every check is a count at accept time, before anything is read or allocated.

`Pending` is the bookkeeping (pure, no sockets); `authenticate` turns a request header into an
authenticated request or the refusal to answer with, for any header whatsoever: a parser or
token failure of any kind is a refusal (BAD_REQUEST or AUTH), never an exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..errors import AuthError, LimitError
from . import auth, wire

log = logging.getLogger(__name__)
H = TypeVar("H")

# A client sends its request right after connecting: < 1 ms on a LAN, a round trip on a WAN, and
# the largest header (64 KiB) needs only 13 KB/s to arrive in 5 s. A stranger holds a pending
# connection at most this long.
AUTH_TIMEOUT_S = 5.0
# Each holds a descriptor, a small task and at most one header buffer (64 KiB): 256 of them
# stay well inside the common 1024-descriptor limit beside the serving slots, and 16 MiB.
MAX_PENDING = 256
# A host running several receivers (4 fetch workers each) has far fewer requests in flight at
# once, and each is pending for one round trip only.
MAX_PENDING_PER_SOURCE = 32


@dataclass(eq=False, slots=True)
class Peer:
    """One accepted connection: its socket, the source it counts against, its task."""

    sock: socket.socket
    source: str
    accepted: float  # the event loop's clock: the first request's deadline counts from here
    task: asyncio.Task[None] | None = None

    def on_end(self, ended: Callable[[Peer], None]) -> Callable[[asyncio.Task[None]], None]:
        """A done callback for `task` that calls `ended(self)`."""
        return lambda _task: ended(self)


def source_of(host: str) -> str:
    """The address a connection counts against: the host, or its /64 for IPv6."""
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:  # a dual-stack listener's IPv4 client
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class Pending(Generic[H]):
    """Pending connections (handles) in accept order, by source, under two caps.

    Not thread-safe: the chunk server uses it from its event loop only.
    """

    def __init__(self, max_total: int, max_per_source: int) -> None:
        if max_total < 1 or max_per_source < 1:
            raise ValueError(f"pending caps must be >= 1 (total {max_total}, "
                             f"per source {max_per_source})")
        self.max_total = max_total
        self.max_per_source = max_per_source
        self._all: dict[H, str] = {}  # handle -> source; dicts keep insertion (accept) order
        self._by_source: dict[str, dict[H, None]] = {}

    def __len__(self) -> int:
        return len(self._all)

    def __contains__(self, handle: object) -> bool:
        return handle in self._all

    def count(self, source: str) -> int:
        return len(self._by_source.get(source, ()))

    def add(self, source: str, handle: H) -> list[H]:
        """Admit `handle` as pending; the handles evicted to make room (the caller closes them)."""
        evicted: list[H] = []
        mine = self._by_source.get(source)
        if mine is not None and len(mine) >= self.max_per_source:
            evicted.append(next(iter(mine)))
            self.remove(evicted[-1])
        elif len(self._all) >= self.max_total:
            # at most max_total sources to look through; ties go to the source seen first
            heaviest = max(self._by_source.values(), key=len)
            evicted.append(next(iter(heaviest)))
            self.remove(evicted[-1])
        self._all[handle] = source
        self._by_source.setdefault(source, {})[handle] = None
        return evicted

    def remove(self, handle: H) -> bool:
        """Forget `handle` (authenticated, or gone); False if it was not pending."""
        source = self._all.pop(handle, None)
        if source is None:
            return False
        mine = self._by_source[source]
        del mine[handle]
        if not mine:
            del self._by_source[source]
        return True


def authenticate(raw: bytes, secret: bytes, replay: auth.ReplayGuard,
                 where: str) -> wire.Request | wire.Response:
    """The request in header `raw` if it is well formed and its token valid; else the refusal.

    Never raises for what a peer sent: whatever the parser or the token check raises becomes
    BAD_REQUEST (a malformed header) or AUTH (a token refused), with what to do in the message.
    """
    try:
        req = wire.decode_request(raw, where)
    except LimitError as exc:
        return wire.Response(wire.BAD_REQUEST, str(exc))
    except Exception as exc:  # the parser failed some other way (too deep, …): still the peer's
        log.warning("%s: unparsable request header: %s: %s", where, type(exc).__name__, exc)
        return wire.Response(wire.BAD_REQUEST, f"{where}: bad request header ({type(exc).__name__}:"
                                               f" {exc}); send a request frame as in weighthub.net.wire")
    try:
        auth.verify(secret, req.auth, *wire.auth_subject(req), replay=replay)
    except AuthError as exc:
        log.warning("%s: refused %s %s: %s", where, req.op, req.key, exc)
        return wire.Response(wire.AUTH, f"{where}: {exc}")
    except Exception as exc:  # a token the checker could not even read: refused like a bad one
        log.warning("%s: refused %s %s: unreadable auth token (%s: %s)", where, req.op, req.key,
                    type(exc).__name__, exc)
        return wire.Response(wire.AUTH, f"{where}: {req.op} {req.key}: malformed auth token "
                                        f"({type(exc).__name__}); sign requests with weighthub.net.auth.sign")
    return req


def refuse_now(sock: socket.socket, resp: wire.Response) -> None:
    """Send `resp` if the socket takes it at once, else nothing: a connection being dropped for
    load gets no buffer, no task and no wait (a small frame fits an idle socket's send buffer)."""
    with contextlib.suppress(OSError, LimitError):
        sock.send(wire.pack(wire.RESPONSE_MAGIC, resp))
