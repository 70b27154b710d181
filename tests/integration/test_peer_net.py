"""The peer network with real processes on 127.0.0.1: auth, refusals, failover, relay, read leases.

Every node is its own process (net_helpers.Node: ChunkServer + PeerStore + Receiver), killed
with its process group at teardown. Bit-exactness is checked on xxh3 digests of every
tensor's integer view; "the store was not touched for chunks" by counting chunk GETs that reach
the store inside each node.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from net_helpers import Node, wait_answer

from weighthub import catalog
from weighthub.bench import transport as bench_transport
from weighthub.cluster.relay import RelayTee
from weighthub.errors import AuthError, PeerUnavailable
from weighthub.net import auth, wire
from weighthub.net.client import PeerClient, Timeouts
from weighthub.publish import Publisher
from weighthub.store import LocalStore
from weighthub.tensors import bits

# several real processes per test: outside the fast subset (-m "not slow")
pytestmark = pytest.mark.slow

SECRET = "peer-net-test-secret-5f1c9a7e"
KEY = SECRET.encode()
SPAN = 64 << 10  # small chunks: a version has many


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(512, 256, generator=g).to(torch.bfloat16),
        "layers.0.mlp.weight": torch.randn(256, 512, generator=g).to(torch.bfloat16),
        "layers.0.norm.weight": torch.randn(4096, generator=g),
    }


def step(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Next version: ~2% of the words move by one ulp (integer view), like an RL step."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        t = t.clone()
        view = t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).reshape(-1)
        idx = torch.randperm(view.numel(), generator=g)[: view.numel() // 50]
        view[idx] += 1
        out[name] = t
    return out


def digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: xxhash.xxh3_128_hexdigest(bits(t).tobytes()) for n, t in state.items()}


def publish_three(store: Any) -> list[dict[str, torch.Tensor]]:
    pub = Publisher(store, full_span_bytes=SPAN, delta_span_bytes=SPAN)
    states = [make_state()]
    states += [step(states[0], 1)]
    states += [step(states[1], 2)]
    for s in states:
        pub.publish(s)
    return states


def chunk_keys(store: LocalStore, v: int) -> list[str]:
    """The chunks of version v's primary representation (what a sync along the chain reads)."""
    return [c.key for c in catalog.primary_manifest(store, v).chunks]


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("store")
    return root, publish_three(LocalStore(root))


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    nodes: list[Node] = []

    def start(store: Path, *args: str) -> Node:
        node = Node(store, tmp_path / f"cache{len(nodes)}", SECRET, *args)
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        node.close()


@pytest.fixture(scope="module")
def holder(published: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A node that synced the latest version (2) from the store and serves versions 0-2."""
    node = Node(published[0], tmp_path_factory.mktemp("holder"), SECRET)
    try:
        synced = node.call(cmd="sync")
        assert synced["ok"], synced
        yield node
    finally:
        node.close()


def synced_ok(node: Node, **kw: Any) -> dict[str, Any]:
    ans = node.call(cmd="sync", **kw)
    assert ans["ok"], ans
    return ans


def raw_call(addr: str, req: wire.Request) -> wire.Response:
    """One request with exactly the token given (none, stale, replayed…)."""
    host, port = wire.parse_addr(addr)
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.settimeout(5)
        sock.sendall(wire.pack(wire.REQUEST_MAGIC, req))
        f = sock.makefile("rb")
        prefix = f.read(wire.PREFIX.size)
        resp = wire.decode_response(f.read(wire.header_length(prefix, wire.RESPONSE_MAGIC, addr)), addr)
        f.read(resp.size)
        return resp


# ------------------------------------------------------------------------------------------ tests

def test_transport_throughput_sanity(published: Any, spawn: Callable[..., Node]) -> None:
    """Not a timed assertion: the numbers are printed; the bytes must round-trip exactly."""
    holder = spawn(published[0])
    for r in bench_transport.measure(size=8 << 20, count=4, repeat=1, transports=("tcp-sock",)):
        print(f"bench {r.transport}: {r.gbps:.2f} GB/s")
    blob = bytes(range(256)) * ((16 << 20) // 256)  # <= 32 MiB: glibc reuses freed buffers
    LocalStore(holder.cache).put("v000000000099/big-0/c0.whc", blob)
    holder.call(cmd="serve", version=99)
    client = PeerClient(holder.addr, KEY)
    t0 = time.perf_counter()
    for _ in range(4):
        got = client.get("v000000000099/big-0/c0.whc")
        assert got == blob
    print(f"PeerClient.get from a node process: {4 * len(blob) / (time.perf_counter() - t0) / 1e9:.2f} GB/s")


def test_auth_refuses_missing_wrong_expired_and_replayed_tokens(holder: Node, published: Any) -> None:
    key = chunk_keys(LocalStore(published[0]), 0)[0]
    req = wire.Request("get", key=key)
    assert raw_call(holder.addr, req).status == wire.AUTH  # no token

    with pytest.raises(AuthError, match=f"{holder.addr}.*bad signature"):
        PeerClient(holder.addr, b"another-secret-of-32-bytes-xxxxx").get(key)

    # a token the checker cannot even read (a non-ASCII digit): refused, not a dropped connection
    resp = raw_call(holder.addr, wire.Request("get", key=key, auth="WH1 \u00b2 n s"))
    assert resp.status == wire.AUTH and "malformed" in resp.message, resp

    stale = auth.sign(KEY, *wire.auth_subject(req), now=time.time() - 3600)
    resp = raw_call(holder.addr, wire.Request("get", key=key, auth=stale))
    assert resp.status == wire.AUTH and "expired" in resp.message

    signed = wire.Request("get", key=key, auth=auth.sign(KEY, *wire.auth_subject(req)))
    assert raw_call(holder.addr, signed).status == "ok"
    resp = raw_call(holder.addr, signed)
    assert resp.status == wire.AUTH and "replayed" in resp.message

    # a token is bound to its request: the same token for another key is refused
    other = wire.Request("get", key=chunk_keys(LocalStore(published[0]), 1)[0],
                         auth=auth.sign(KEY, *wire.auth_subject(req)))
    assert raw_call(holder.addr, other).status == wire.AUTH


def test_server_refuses_versions_it_does_not_hold(holder: Node) -> None:
    client = PeerClient(holder.addr, KEY)
    with pytest.raises(PeerUnavailable, match=r"serving \[0, 1, 2\], asked for 42"):
        client.get("v000000000042/full-0/c0.whc")
    with pytest.raises(PeerUnavailable, match="serving version 2, asked for dense version 0"):
        client.dense_range(0, "embed.weight", 0, 16, lease="x")


def test_failover_from_corrupt_and_slow_peers(published: Any, holder: Node,
                                              spawn: Callable[..., Node]) -> None:
    store, states = published
    corrupt, slow = spawn(store, "--corrupt"), spawn(store, "--delay", "30")
    receiver = spawn(store, "--deadline", "1")
    for ans in [wait_answer(n.send(cmd="sync")) for n in (corrupt, slow)]:
        assert ans["ok"], ans
    receiver.call(cmd="sources", addrs=[corrupt.addr, slow.addr, holder.addr])
    t0 = time.perf_counter()
    ans = synced_ok(receiver)
    # one 1 s deadline per fetch thread, then the peer is skipped; without it each fetch from the
    # slow peer would take its 30 s (bounded by that, not by a guess at this machine's speed)
    assert time.perf_counter() - t0 < 30
    assert ans["version"] == 2 and ans["digests"] == digests(states[2])
    assert ans["store_chunk_gets"] == 0  # the good holder served every chunk
    assert ans["stats"]["peer_failures"] >= 2
    assert ans["stats"]["from_peers"] == sum(len(chunk_keys(LocalStore(store), v)) for v in (0, 1, 2))


def test_failover_when_a_peer_is_killed_mid_transfer(published: Any, holder: Node,
                                                     spawn: Callable[..., Node]) -> None:
    store, states = published
    doomed, receiver = spawn(store, "--delay", "2"), spawn(store, "--deadline", "20")
    synced_ok(doomed)
    receiver.call(cmd="sources", addrs=[doomed.addr, holder.addr])
    pending = receiver.send(cmd="sync")
    time.sleep(0.7)  # the receiver's fetches are waiting on the doomed peer's answers
    t0 = time.perf_counter()
    doomed.kill9()
    ans = wait_answer(pending, 30)
    assert ans["ok"], ans
    assert time.perf_counter() - t0 < 19  # the kill was noticed, not the 20 s deadline waited out
    assert ans["digests"] == digests(states[2])
    assert ans["stats"]["peer_failures"] >= 1 and ans["store_chunk_gets"] == 0


def test_relay_tree_delivers_every_chunk_to_every_node(tmp_path: Path,
                                                       spawn: Callable[..., Node]) -> None:
    """publisher -> A -> {B, C}: a chain and a fan-out of 2, cut-through while publishing."""
    root = tmp_path / "relay-store"
    root.mkdir()
    a, b, c = spawn(root), spawn(root), spawn(root)
    with socket.socket() as s:  # a child that is gone: reported, and stops nobody
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    tree = [wire.Hop(a.addr, [wire.Hop(b.addr), wire.Hop(c.addr), wire.Hop(dead)])]
    tee = RelayTee(LocalStore(root), lambda: tree, KEY, timeouts=Timeouts(2, 10, 30))
    try:
        states = publish_three(tee)
    finally:
        tee.close()
    store = LocalStore(root)
    keys = [k for v in (0, 1, 2) for k in chunk_keys(store, v)]
    assert dict(tee.failed) == {dead: tee.pushed} and tee.pushed >= len(keys)
    for node in (a, b, c):
        cache = LocalStore(node.cache)
        assert all(cache.get(k) == store.get(k) for k in keys), f"{node.addr} misses chunks"
        ans = synced_ok(node)
        assert ans["digests"] == digests(states[2])
        assert ans["store_chunk_gets"] == 0 and ans["stats"]["from_cache"] == len(keys)

    # a push whose bytes do not match the checksum the sender declared is not staged
    with pytest.raises(PeerUnavailable, match="not staged"):
        PeerClient(a.addr, KEY).push("v000000000009/x-0/c0.whc", b"payload", checksum="0" * 64)
    assert not (a.cache / "v000000000009").exists()


def test_read_leases_defer_the_holders_apply_for_a_bounded_time(published: Any,
                                                                 spawn: Callable[..., Node]) -> None:
    store, states = published
    node = spawn(store, "--lease-wait", "6")  # long enough for the steps below on a loaded CI box
    synced_ok(node, version=0)
    v0 = bits(states[0]["embed.weight"]).tobytes()
    client = PeerClient(node.addr, KEY)
    n = len(v0)
    assert client.dense_range(0, "embed.weight", 0, n // 2, lease="joiner") == v0[: n // 2]

    # the apply of v1 waits while the joiner's lease is open; the joiner still reads v0's bits
    pending = node.send(cmd="sync", version=1)
    time.sleep(1.0)
    assert pending.empty(), "the holder applied v1 while a reader held a lease on v0"
    assert client.dense_range(0, "embed.weight", n // 2, n, lease="joiner") == v0[n // 2:]
    with pytest.raises(PeerUnavailable, match="being replaced"):
        client.dense_range(0, "embed.weight", 0, 16, lease="latecomer")
    client.release("joiner")
    ans = wait_answer(pending, 20)
    assert ans["ok"] and ans["digests"] == digests(states[1])
    with pytest.raises(PeerUnavailable, match="serving version 1"):
        client.dense_range(0, "embed.weight", 0, 16, lease="joiner")
    v1 = bits(states[1]["embed.weight"]).tobytes()
    assert client.dense_range(1, "embed.weight", 0, n, lease="stuck") == v1

    # a reader that never releases delays the next apply by --lease-wait (6 s), not by its
    # lease's 30 s ttl: checked on the holder's own measure of the wait, which a loaded
    # machine does not stretch the way it stretches the whole sync
    ans = synced_ok(node, version=2)
    assert 6 <= ans["lease_wait_s"] < 20
    assert ans["digests"] == digests(states[2])
