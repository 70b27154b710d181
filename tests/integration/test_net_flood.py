"""A chunk server under unauthenticated load and hostile request headers, over real sockets.

Strangers (`stranger_flood`, a process of their own) connect from many loopback addresses and
never send a complete request: silent ones, and tricklers that send one byte of a request frame
at a time, well inside every idle timeout; whatever the server closes they reopen. An
authenticated peer (`PeerClient`, the shared secret) must keep being served, bit-exact, within
its timeouts. The server runs in this process so that its log records (an unhandled task
exception included) are seen by `caplog`; the other tests open their few connections here.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import os
import resource
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from stranger_flood import Flood

from weighthub.net import auth, wire
from weighthub.net.client import PeerClient
from weighthub.net.server import ChunkServer
from weighthub.store import LocalStore

SECRET = b"flood-test-secret-7c2e94a1b3d5"
KEY = "v000000000003/full-0/c0.whc"
BOUND_S = 10.0  # hang guard for one wait on the server (not a speed target)


@pytest.fixture(scope="module", autouse=True)
def enough_descriptors() -> Iterator[None]:
    """Both ends of ~500 connections live in this process: raise the soft limit to the hard."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard == resource.RLIM_INFINITY else max(soft, min(hard, 8192))
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def blob(tmp_path: Path) -> tuple[LocalStore, bytes]:
    store = LocalStore(tmp_path / "store")
    data = os.urandom(1 << 20)
    store.put(KEY, data)
    return store, data


def start(store: LocalStore, **options: float) -> ChunkServer:
    server = ChunkServer(store, SECRET, **options).start()  # type: ignore[arg-type]
    server.serve(3)
    return server


@pytest.fixture
def servers() -> Iterator[list[ChunkServer]]:
    started: list[ChunkServer] = []
    yield started
    for s in started:
        s.stop()


def connect_from(source: str, port: int) -> socket.socket:
    sock = socket.socket()
    try:
        sock.bind((source, 0))
        sock.settimeout(2)
        sock.connect(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return sock


def closed_by_server(sock: socket.socket, timeout: float) -> bytes | None:
    """What the server sent before closing `sock` (b"" for nothing), or None if still open
    after `timeout`."""
    got = b""
    end = time.monotonic() + timeout
    while (left := end - time.monotonic()) > 0:
        if not select.select([sock], [], [], left)[0]:
            break
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk
    return None


def still_open(socks: list[socket.socket], wait: float = 0.2) -> list[bool]:
    """Which of `socks` the server has neither closed nor written to within `wait` (one wait
    for all: what the server does to them happened before the caller's last observation)."""
    readable = set(select.select(socks, [], [], wait)[0])
    return [s not in readable for s in socks]


def response_of(frame: bytes) -> wire.Response:
    hlen = wire.header_length(frame[: wire.PREFIX.size], wire.RESPONSE_MAGIC, "test")
    return wire.decode_response(frame[wire.PREFIX.size: wire.PREFIX.size + hlen], "test")


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def floods() -> Iterator[list[Flood]]:
    started: list[Flood] = []
    yield started
    for f in started:
        f.kill()


@pytest.mark.slow  # ~9 s: the fetches span more than one whole-request deadline (5 s)
def test_authenticated_peer_is_served_while_500_strangers_trickle(
        blob: tuple[LocalStore, bytes], servers: list[ChunkServer], floods: list[Flood]) -> None:
    store, data = blob
    server = start(store)  # the shipped defaults: the claim is about them
    servers.append(server)
    client = PeerClient(server.address, SECRET)  # its default timeouts: the "normal" ones
    quiet = []
    for _ in range(3):
        t0 = time.perf_counter()
        assert digest(client.get(KEY)) == digest(data)
        quiet.append(time.perf_counter() - t0)

    # 50 stranger addresses, 10 connections each: under the per-source cap, twice the total
    # pending cap; none from 127.0.0.1, the peer's own address (see the caps test for that)
    floods.append(flood := Flood.start(server.port, 500, [f"127.0.1.{i}" for i in range(1, 51)]))
    loaded = []
    for _ in range(6):
        t0 = time.perf_counter()
        assert digest(client.get(KEY)) == digest(data)  # raises PeerRefused "busy" on a full server
        loaded.append(time.perf_counter() - t0)
        time.sleep(1.2)
    counts = flood.stop()
    # the flood was real: the server cut strangers (caps, then the deadline) and they came back
    assert counts["reopened"] >= 250, counts
    print(f"\nauthenticated fetch of 1 MiB: quiet {1e3 * min(quiet):.1f}-{1e3 * max(quiet):.1f} ms, "
          f"under 500 strangers {1e3 * min(loaded):.1f}-{1e3 * max(loaded):.1f} ms "
          f"(median {1e3 * sorted(loaded)[len(loaded) // 2]:.1f} ms); stranger connections "
          f"opened {counts['opened']}, cut and reopened {counts['reopened']}")


def test_a_trickler_is_cut_at_the_whole_request_deadline(
        blob: tuple[LocalStore, bytes], servers: list[ChunkServer]) -> None:
    server = start(blob[0], auth_timeout=1.0, idle_timeout=30.0)
    servers.append(server)
    frame = wire.PREFIX.pack(wire.REQUEST_MAGIC, 200) + b"{" * 200
    t0 = time.monotonic()  # before the connect: the server's clock starts at its accept
    with connect_from("127.0.0.2", server.port) as trickler, \
            connect_from("127.0.0.2", server.port) as silent:
        got = None
        for i in range(int(BOUND_S / 0.1)):  # a byte every 0.1 s: far inside the idle timeout
            with contextlib.suppress(OSError):
                trickler.send(frame[i: i + 1])
            got = closed_by_server(trickler, 0.1)
            if got is not None:
                break
        waited = time.monotonic() - t0
        assert got is not None, f"a trickler still connected after {waited:.1f}s"
        assert waited >= 1.0 - 0.05  # not before the deadline either
        assert closed_by_server(silent, BOUND_S) is not None
    # the server took no harm: the next peer is served
    assert PeerClient(server.address, SECRET).get(KEY) == blob[1]


def test_pending_connections_are_capped_per_source_and_in_total(
        blob: tuple[LocalStore, bytes], servers: list[ChunkServer]) -> None:
    server = start(blob[0], auth_timeout=30.0, max_pending=10, max_pending_per_source=4)
    servers.append(server)
    socks: list[socket.socket] = []
    try:
        # per source: the 4 newest of 7 stay, the 3 oldest are told why and closed
        socks += [connect_from("127.0.0.2", server.port) for _ in range(7)]
        cut = [closed_by_server(s, BOUND_S) for s in socks[:3]]
        assert all(c is not None for c in cut), cut
        refusal = response_of(cut[0])  # type: ignore[arg-type]
        assert refusal.status == wire.REFUSED and "unauthenticated" in refusal.message, refusal
        assert all(still_open(socks[3:7]))

        # in total: 10 pending at most; the source holding the most (127.0.0.2) pays first
        socks += [connect_from(f"127.0.0.{3 + i % 3}", server.port) for i in range(8)]
        assert all(closed_by_server(s, BOUND_S) is not None for s in socks[3:5])
        assert all(still_open(socks[5:]))

        # a peer sharing the strangers' address still gets in: it is the newest of its source
        req = wire.Request("get", key=KEY)
        req = wire.Request("get", key=KEY, auth=auth.sign(SECRET, *wire.auth_subject(req)))
        with connect_from("127.0.0.2", server.port) as peer:
            peer.settimeout(BOUND_S)
            peer.sendall(wire.pack(wire.REQUEST_MAGIC, req))
            f = peer.makefile("rb")
            prefix = f.read(wire.PREFIX.size)
            resp = response_of(prefix + f.read(wire.header_length(prefix, wire.RESPONSE_MAGIC, "")))
            assert resp.status == "ok", resp
            assert digest(f.read(resp.size)) == digest(blob[1])
    finally:
        for s in socks:
            s.close()


def _nested_tree(depth: int) -> bytes:
    return (b'{"op": "push", "tree": ' + b'[{"addr": "a", "children": ' * depth + b"[]"
            + b"}]" * depth + b"}")


HOSTILE = {  # what a peer sends -> the status it must get back
    "token with a non-ASCII digit": (
        wire.pack(wire.REQUEST_MAGIC, wire.Request("get", key=KEY, auth="WH1 \u00b2 n s")), wire.AUTH),
    "token with a huge timestamp": (
        wire.pack(wire.REQUEST_MAGIC, wire.Request("get", key=KEY, auth="WH1 " + "9" * 200 + " n s")),
        wire.AUTH),
    "token of control characters": (
        wire.pack(wire.REQUEST_MAGIC, wire.Request("get", key=KEY, auth="\x00\x01 \uffff")), wire.AUTH),
    "header nested too deep": (
        wire.PREFIX.pack(wire.REQUEST_MAGIC, len(_nested_tree(2500))) + _nested_tree(2500),
        wire.BAD_REQUEST),
    "header that is not JSON": (wire.PREFIX.pack(wire.REQUEST_MAGIC, 4) + b"\xff\xfe{[", wire.BAD_REQUEST),
    "not a weighthub frame": (b"GET / HTTP/1.1\r\n\r\n", wire.BAD_REQUEST),
}


def test_hostile_headers_get_a_refusal_and_no_task_exception(
        blob: tuple[LocalStore, bytes], servers: list[ChunkServer],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    server = start(blob[0])
    servers.append(server)
    for name, (raw, status) in HOSTILE.items():
        with connect_from("127.0.0.1", server.port) as sock:
            sock.sendall(raw)
            got = closed_by_server(sock, BOUND_S)  # answered, then closed cleanly
            assert got, f"{name}: the server closed the connection without an answer"
            resp = response_of(got)
            assert resp.status == status and server.address in resp.message, (name, resp)
    gc.collect()  # an unretrieved task exception is logged when its task is collected
    assert PeerClient(server.address, SECRET).get(KEY) == blob[1]  # and it still serves
    escaped = [r for r in caplog.records
               if r.levelno >= logging.ERROR or "never retrieved" in r.getMessage()]
    assert not escaped, [r.getMessage() for r in escaped]
