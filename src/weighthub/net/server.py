"""ChunkServer: every holder (publisher, relay, receiver) serves the versions it holds.

What it serves:
    objects   store objects (manifests, chunks) by key from `store` (the holder's local copy:
              its store directory, or its staging cache), only for versions in `versions()`:
              those the holder registered with `serve(v)` and those it received pushed chunks
              of. Others are refused with the list it serves ("serving [4, 5], asked for 6").
    dense     canonical bytes of a tensor at the version the holder's target holds, through
              `DenseReader` (cluster.leases: the holder's apply waits for readers).
    push      a relay push (a chunk, or a committed version's manifest): the body is forwarded
              cut-through to the request's subtree while it arrives, checked against its SHA-256
              (`format.chunk_checksum`, as in manifests), then staged into `store` (so the node's
              pushed-cache source finds it and the server can serve it on). The checksum only
              guards the transfer: a node trusts a relayed manifest only if it matches the
              digest the hub recorded for the version (`node`).

Lifecycle: `start()` binds (port 0 picks a free one; `address` says which) and runs an asyncio
loop in a daemon thread; `stop()` closes the listener and every connection, then joins.
Every request is authenticated (`auth`), bounded (max body, max connections) and timed
(io timeout per socket operation, request timeout per request, idle timeout between
requests). File reads, hashing and dense copies run in threads, off the event loop.

A connection takes a serving slot (`max_connections`) only once its first request is complete
and authenticated; before, it is pending, under a deadline and caps (`admission`). Whatever a
connection sends, it gets an answer or a clean close: no exception escapes its task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import threading
from collections.abc import Callable
from typing import Protocol

from ..errors import (
    LimitError,
    NetError,
    ObjectNotFound,
    PeerUnavailable,
    StoreError,
    UsageError,
)
from ..format import chunk_checksum
from ..store.base import Store, check_key
from . import admission, aio, auth, wire
from .admission import Peer

log = logging.getLogger(__name__)
_VERSION_KEY = re.compile(r"^v(\d{12})/")


class DenseReader(Protocol):
    """What serves dense reads of the version a holder holds (cluster.leases.ReadLeases)."""

    def held_versions(self) -> list[int]: ...

    def read(self, version: int, lease: str, tensor: str, start: int, stop: int) -> bytes: ...

    def release(self, lease: str) -> None: ...


def key_version(key: str) -> int:
    """The version a store key belongs to ('v000000000042/...' -> 42). Raises LimitError."""
    m = _VERSION_KEY.match(key)
    if m is None:
        raise LimitError(f"key {key!r} does not belong to a version (expected 'v<12 digits>/...')")
    return int(m.group(1))


class ChunkServer:
    """Serves a holder's versions to peers. See the module docstring.

    Args:
        store: where objects are read from and pushed chunks are staged.
        secret: shared secret (`auth.load_secret`).
        leases: the holder's read leases over its target, for dense reads (None: no dense).
        host, port: where to listen (port 0: a free one).
        max_body: largest body served or accepted (bytes); larger requests are refused.
        max_connections: concurrent authenticated connections; more are refused ("busy").
        io_timeout: longest wait for one socket operation (seconds).
        request_timeout: longest time one request may take, forwarding included.
        idle_timeout: an authenticated connection idle this long is closed, and a later
            request's header must be complete within it.
        auth_timeout: a new connection's first request must be complete and authenticated
            this long after the accept, however it paces its bytes (see `admission`).
        max_pending, max_pending_per_source: caps on connections not yet authenticated, in
            total and per source address; at a cap the oldest goes (see `admission`).
        on_push: called (key, failed addresses) after a pushed chunk is staged.
    """

    def __init__(self, store: Store, secret: bytes, *, leases: DenseReader | None = None,
                 host: str = "127.0.0.1", port: int = 0, max_body: int = 256 << 20,
                 max_connections: int = 64, io_timeout: float = 10.0,
                 request_timeout: float = 60.0, idle_timeout: float = 60.0,
                 auth_timeout: float = admission.AUTH_TIMEOUT_S, max_pending: int = admission.MAX_PENDING,
                 max_pending_per_source: int = admission.MAX_PENDING_PER_SOURCE,
                 on_push: Callable[[str, list[str]], None] | None = None) -> None:
        self.store = store
        self.secret = secret
        self.leases = leases
        self.max_body = max_body
        self.max_connections = max_connections
        self.io_timeout = io_timeout
        self.request_timeout = request_timeout
        self.idle_timeout = idle_timeout
        self.auth_timeout = auth_timeout
        self.on_push = on_push
        self._pending: admission.Pending[Peer] = admission.Pending(max_pending, max_pending_per_source)
        self._serving: set[Peer] = set()
        self._replay = auth.ReplayGuard()
        self._served: set[int] = set()
        self._lock = threading.Lock()
        # A deep accept queue: under a burst of connections (peers joining, or strangers) a
        # peer's connect completes and waits its turn in the queue instead of losing its SYN
        # and retrying after 1 s, 3 s… (the client's connect timeout is 3 s).
        self._listener = socket.create_server((host, port), backlog=1024)
        self._listener.setblocking(False)
        self.host, self.port = self._listener.getsockname()[:2]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._peers: set[Peer] = set()  # strong references (and their tasks) until each ends

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # -- what is served ---------------------------------------------------------------------
    def serve(self, version: int) -> None:
        """Serve the objects of `version` (the holder has committed it, or holds its chunks)."""
        with self._lock:
            self._served.add(version)

    def release(self, version: int) -> None:
        """Stop serving the objects of `version` (the hub released this holder from it)."""
        with self._lock:
            self._served.discard(version)

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._served)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> ChunkServer:
        ready = threading.Event()

        def run() -> None:
            asyncio.run(self._main(ready))

        self._thread = threading.Thread(target=run, name=f"chunk-server-{self.port}", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise NetError(f"chunk server {self.address} did not start within 10 s")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._stopping is not None and self._thread is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(timeout)
        self._listener.close()

    def __enter__(self) -> ChunkServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _main(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        accept = asyncio.create_task(self._accept())
        ready.set()
        await self._stopping.wait()
        accept.cancel()
        self._listener.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # each closes its socket as it ends

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(self._listener)
                conn.setblocking(False)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError as exc:  # out of file descriptors, reset at once, …: serve the others
                log.warning("chunk server %s: accept failed: %s", self.address, exc)
                await asyncio.sleep(0.1)
                continue
            peer = Peer(conn, admission.source_of(addr[0]), loop.time())
            for old in self._pending.add(peer.source, peer):
                self._drop(old)
            peer.task = loop.create_task(self._connection(peer))
            self._peers.add(peer)
            # closes the socket even for a task cancelled before it ran (a dropped newcomer)
            peer.task.add_done_callback(peer.on_end(self._ended))
            # A new connection's request is usually there already: let it be read (and the
            # connection leave the pending set) before the next accept, so a burst of
            # strangers cannot push out a peer whose request has arrived.
            await asyncio.sleep(0)

    def _drop(self, peer: Peer) -> None:
        """Close a pending connection to make room (a cap was reached); say why if it listens."""
        pending = self._pending
        admission.refuse_now(peer.sock, wire.Response(wire.REFUSED, (
            f"chunk server {self.address}: closed before a request arrived: too many "
            f"unauthenticated connections (at most {pending.max_per_source} per source, "
            f"{pending.max_total} in all); send the request right after connecting, or retry")))
        if peer.task is not None:
            peer.task.cancel()

    def _ended(self, peer: Peer) -> None:
        self._pending.remove(peer)
        self._serving.discard(peer)
        self._peers.discard(peer)
        peer.sock.close()

    # -- one connection ---------------------------------------------------------------------
    async def _connection(self, peer: Peer) -> None:
        """Serve one connection until it ends. Nothing escapes: a failure that is not the
        peer going away is a bug, logged; the connection closes and the server goes on."""
        where = f"chunk server {self.address}"
        try:
            await self._converse(peer, where)
        except LimitError as exc:  # not a weighthub frame, or a header length out of bounds
            with contextlib.suppress(OSError, TimeoutError):
                await self._reply(peer.sock, wire.Response(wire.BAD_REQUEST, str(exc)))
        except (OSError, TimeoutError, ConnectionError):
            pass  # the peer went away or stalled: nothing to answer
        except Exception:
            log.exception("%s: connection from %s failed; closed it", where, peer.source)

    async def _converse(self, peer: Peer, where: str) -> None:
        conn = peer.sock
        admitted = False
        while True:
            # First request: complete and authenticated by a deadline from the accept, however
            # the bytes are paced. Later ones (authenticated already): within the idle timeout.
            limit = (asyncio.timeout(self.idle_timeout) if admitted
                     else asyncio.timeout_at(peer.accepted + self.auth_timeout))
            try:
                async with limit:
                    raw = await aio.recv_header(conn, wire.REQUEST_MAGIC, self.idle_timeout, where)
            except TimeoutError:
                if not admitted:
                    log.debug("%s: %s sent no complete request within %gs; closed", where,
                              peer.source, self.auth_timeout)
                return
            if raw is None:
                return
            req = admission.authenticate(raw, self.secret, self._replay, where)
            if isinstance(req, wire.Response):
                await self._reply(conn, req)
                return  # an unread push body may follow: drop the connection
            if not admitted:
                self._pending.remove(peer)
                if len(self._serving) >= self.max_connections:
                    await self._reply(conn, wire.Response(wire.REFUSED, (
                        f"{where} is busy ({self.max_connections} connections); retry or ask "
                        "another holder")))
                    return
                self._serving.add(peer)
                admitted = True
            if req.size > self.max_body:
                await self._reply(conn, wire.Response(
                    wire.BAD_REQUEST, f"{where}: body of {req.size} bytes over the limit "
                                      f"{self.max_body}"))
                return
            async with asyncio.timeout(self.request_timeout):
                if not await self._handle(conn, req, where):
                    return

    async def _reply(self, conn: socket.socket, resp: wire.Response,
                     body: bytes | memoryview | None = None) -> None:
        await aio.send(conn, wire.pack(wire.RESPONSE_MAGIC, resp), body, self.io_timeout)

    async def _handle(self, conn: socket.socket, req: wire.Request, where: str) -> bool:
        """Serve one request; False when the connection must close (a push that went wrong)."""
        if req.op == "push":
            return await self._push(conn, req, where)
        try:
            resp, body = await self._answer(req, where)
        except ObjectNotFound as exc:
            resp, body = wire.Response(wire.NOT_FOUND, f"{where}: {exc}"), None
        except PeerUnavailable as exc:
            resp, body = wire.Response(wire.REFUSED, f"{where}: {exc}",
                                       versions=self._versions_for(req)), None
        except (UsageError, LimitError) as exc:
            resp, body = wire.Response(wire.BAD_REQUEST, f"{where}: {exc}"), None
        except StoreError as exc:
            resp, body = wire.Response(wire.FAILED, f"{where}: {exc}"), None
        except Exception as exc:  # a bug or an odd store: answer, keep serving, leave a trace
            log.exception("%s: %s %s failed", where, req.op, req.key)
            resp, body = wire.Response(wire.FAILED, f"{where}: {type(exc).__name__}: {exc}"), None
        await self._reply(conn, resp, body)
        return True

    def _versions_for(self, req: wire.Request) -> list[int]:
        if req.op == "dense":
            return self.leases.held_versions() if self.leases else []
        return self.versions()

    async def _answer(self, req: wire.Request, where: str) -> tuple[wire.Response, bytes | None]:
        if req.op == "versions":
            return wire.Response("ok", versions=self.versions()), None
        if req.op == "release":
            if self.leases is not None:
                self.leases.release(req.lease)
            return wire.Response("ok"), None
        if req.op == "dense":
            if self.leases is None:
                raise PeerUnavailable("this node serves no dense tensors")
            if req.stop - req.start > self.max_body:
                raise LimitError(f"dense range of {req.stop - req.start} bytes over {self.max_body}")
            data = await asyncio.to_thread(self.leases.read, req.version, req.lease, req.tensor,
                                           req.start, req.stop)
            return wire.Response("ok", size=len(data), version=req.version), data
        check_key(req.key)
        version = key_version(req.key)
        if version not in self.versions():
            raise PeerUnavailable(f"serving {self.versions()}, asked for {version} ({req.key})")
        if req.op == "range":
            if req.stop - req.start > self.max_body:
                raise LimitError(f"range of {req.stop - req.start} bytes over {self.max_body}")
            data = await asyncio.to_thread(self.store.get_range, req.key, req.start, req.stop)
        else:
            data = await asyncio.to_thread(self._read_object, req.key)
        return wire.Response("ok", size=len(data)), data

    def _read_object(self, key: str) -> bytes:
        # one bounded read: a size() then get() could see the object swapped in between
        return self.store.get(key, max_bytes=self.max_body)

    # -- relay push -------------------------------------------------------------------------
    async def _push(self, conn: socket.socket, req: wire.Request, where: str) -> bool:
        try:
            check_key(req.key)
            version = key_version(req.key)
        except (UsageError, LimitError) as exc:
            await self._reply(conn, wire.Response(wire.BAD_REQUEST, f"{where}: {exc}"))
            return False
        body = aio.Incoming(memoryview(bytearray(req.size)))
        forwarders = [asyncio.create_task(aio.forward(
            hop, req, body, self.secret, connect_timeout=self.io_timeout,
            io_timeout=self.io_timeout, done_timeout=self.request_timeout)) for hop in req.tree]
        try:
            return await self._take_push(conn, req, version, body, forwarders, where)
        finally:  # cut off (request timeout, upstream died): the subtree's pushes end with it
            for f in forwarders:
                f.cancel()

    async def _take_push(self, conn: socket.socket, req: wire.Request, version: int,
                         body: aio.Incoming, forwarders: list[asyncio.Task[list[str]]],
                         where: str) -> bool:
        loop = asyncio.get_running_loop()
        got = 0
        try:
            while got < req.size:
                k = await asyncio.wait_for(loop.sock_recv_into(conn, body.view[got:]), self.io_timeout)
                if k == 0:
                    raise ConnectionError(f"{where}: push of {req.key} cut at {got}/{req.size} bytes")
                got += k
                await body.advance(got)
        except BaseException:
            await body.break_()
            raise
        # Stage as soon as the bytes are verified; the subtree's answers may take longer.
        digest = await asyncio.to_thread(chunk_checksum, body.view)
        problem = None
        if digest != req.checksum:
            problem = f"pushed {req.key} has SHA-256 {digest[:12]}…, sender said {req.checksum[:12]}…"
        else:
            try:
                await asyncio.to_thread(self.store.put, req.key, body.view)
            except StoreError as exc:
                problem = f"staging {req.key}: {exc}"
        failed = [a for f in await asyncio.gather(*forwarders) for a in f]
        if problem is not None:
            log.warning("%s: %s; not staged", where, problem)
            await self._reply(conn, wire.Response(wire.FAILED, f"{where}: {problem}; not staged",
                                                  failed=failed))
            return True
        self.serve(version)
        if failed:
            log.warning("%s: %s did not reach %s", where, req.key, failed)
        if self.on_push is not None:
            self.on_push(req.key, failed)  # on the event loop: must be quick
        await self._reply(conn, wire.Response("ok", failed=failed))
        return True
