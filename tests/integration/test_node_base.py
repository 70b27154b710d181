"""A node never trusts its own output blindly, and the hub offers only holders that can serve.

    modified base   bytes of a node's output changed outside weighthub (a plain write, or one
                    whose size and mtime were restored with os.utime) are found before the next
                    apply: the node reports "base_modified", re-materializes, and is bit-exact
                    (integer views) at every later version, with deltas applied again after
    scheduled full  a change no stat can see (an in-memory target) is found by the full digest
                    check the node runs every N versions
    never silent    an exception outside weighthub's tree in the follow loop is reported
                    (event "error") and following goes on
    serving         a holder that lists a version's chunks (pushed to it) but has not committed
                    it is not offered to joiners as a dense source of that version until it can
                    serve it
"""

from __future__ import annotations

import os
import queue
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from deadlines import PROCESS_S
from hub_helpers import HubProcess, write_secret
from node_helpers import NodeProcess, make_state, read_bits, same_bits, step

from weighthub.cluster.hubclient import HubClient
from weighthub.cluster.node import Node, NodeConfig
from weighthub.cluster.publisher import NetPublisher
from weighthub.cluster.topology import Labels
from weighthub.errors import UsageError
from weighthub.net.client import PeerClient
from weighthub.publish import Publisher
from weighthub.store import LocalStore, MemoryStore
from weighthub.targets import StateDictTarget
from weighthub.tensors import bits

SYNC_S = PROCESS_S


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    write_secret(tmp_path / "secret")
    return tmp_path / "secret"


@pytest.fixture
def nodes() -> Iterator[list[NodeProcess]]:
    started: list[NodeProcess] = []
    yield started
    for n in started:
        n.kill9()


def flip_one_byte(out: Path, *, keep_mtime: bool) -> None:
    """XOR one byte of tensor data in a safetensors file (not its header), as an outside edit."""
    st = out.stat()
    with out.open("r+b") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + header_len + 4097)
        b = f.read(1)
        f.seek(8 + header_len + 4097)
        f.write(bytes([b[0] ^ 0x01]))
    if keep_mtime:  # same size, same mtime: only the inode's ctime tells
        os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert out.stat().st_mtime_ns == st.st_mtime_ns and out.stat().st_size == st.st_size


def base_modified(n: NodeProcess) -> list[dict[str, Any]]:
    return [e for e in n.events if e.get("event") == "base_modified"]


@pytest.mark.slow
def test_a_node_finds_its_modified_output_rematerializes_and_stays_bit_exact(
        tmp_path: Path, secret_file: Path, nodes: list[NodeProcess]) -> None:
    store = tmp_path / "store"
    pub = Publisher(LocalStore(store))
    node = NodeProcess.start(store, tmp_path / "n" / "model.safetensors", secret_file, hub=None,
                             node_id="n", poll=0.2)
    nodes.append(node)
    states = [make_state(0)]
    pub.publish(states[0])
    node.synced(0, SYNC_S)
    for v, keep_mtime in ((1, False), (2, True)):
        flip_one_byte(node.out, keep_mtime=keep_mtime)
        node.wait_for(lambda e, k=v: len(base_modified(node)) >= k, SYNC_S, f"base_modified #{v}")
        states.append(step(states[-1], v))
        pub.publish(states[v])
        node.synced(v, SYNC_S)
        # the node may have re-materialized the held version first or the new one at once;
        # either way it ends at v with v's bits
        node.wait_for(lambda e, k=v: e.get("event") == "synced" and e["version"] == k
                      and len(base_modified(node)) >= k, SYNC_S, "a sync after the report")
        assert same_bits(read_bits(node.out), states[v])
    first, second = base_modified(node)
    # the first edit moved the mtime (the sidecar's own check refused the file), the second
    # only the ctime: both were seen by a stat and confirmed before anything was applied
    assert (first["version"], first["check"], second["version"], second["check"]) == \
        (0, "stat", 1, "stat"), (first, second)
    assert "error" not in {e["event"] for e in node.events}, node.events
    states.append(step(states[-1], 3))
    pub.publish(states[3])
    e = node.synced(3, SYNC_S)
    assert e["how"] == "delta", e  # deltas apply again on the re-materialized base
    assert same_bits(read_bits(node.out), states[3])


class Events:
    """An in-process node's events, waited on with a bound."""

    def __init__(self) -> None:
        self.q: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        self.q.put(event)

    def wait(self, kind: str, version: int | None, timeout: float = 60.0) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while True:
            for e in self.seen:
                if e["event"] == kind and e.get("version") == version:
                    return e
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {kind} {version} within {timeout}s: {self.seen}")
            try:
                self.seen.append(self.q.get(timeout=left))
            except queue.Empty:
                continue


def test_the_scheduled_full_check_finds_a_change_no_stat_can_see() -> None:
    store, cache = MemoryStore(), MemoryStore("cache")
    pub = Publisher(store, full_span_bytes=64 << 10)
    s0 = make_state(0, tensors=2, numel=1 << 14)
    pub.publish(s0)
    state: dict[str, Any] = {}
    events = Events()
    # no cheap check can see inside process memory: only the full check every version does
    config = NodeConfig("mem", poll_s=0.05, full_check_versions=1, full_check_s=3600.0)
    node = Node(store, StateDictTarget(state), b"s" * 32, config, hub=None, cache=cache,
                on_event=events).start()
    try:
        events.wait("synced", 0)
        bits(state["layer1.weight"]).reshape(-1)[77] ^= 1
        s1 = step(s0, 1)
        pub.publish(s1)
        e = events.wait("base_modified", 0)
        assert e["check"] == "full", e
        events.wait("synced", 1)
        assert same_bits(state, s1)
        s2 = step(s1, 2)
        pub.publish(s2)
        assert events.wait("synced", 2)["how"] == "delta"
        assert same_bits(state, s2)
        assert not [x for x in events.seen if x["event"] == "error"], events.seen
    finally:
        node.stop()


@pytest.mark.slow
def test_the_hub_offers_a_holder_to_joiners_only_once_it_serves_the_version(
        tmp_path: Path, secret_file: Path, nodes: list[NodeProcess]) -> None:
    # A holder whose apply of v1 waits behind a reader's lease has v1's chunks (pushed down the
    # relay tree) and lists v1, but serves only v0's dense bits: a joiner must not be sent there.
    hub = HubProcess.start(tmp_path / "hub.db", secret_file, lease_ttl=5.0)
    secret = secret_file.read_bytes().strip()
    pub = None
    try:
        holder = NodeProcess.start(tmp_path / "store", tmp_path / "h" / "model.safetensors",
                                   secret_file, hub=hub.address, node_id="holder", poll=600.0,
                                   labels="region=a,zone=z1,host=h1")
        nodes.append(holder)
        holder.listening()
        pub = NetPublisher(LocalStore(tmp_path / "store"), secret, publisher_id="trainer",
                           hub=HubClient(hub.address, secret, labels=Labels("a", "z1", "h0"))).start()
        s0 = make_state(0, tensors=2)
        pub.publish(s0)
        holder.synced(0, SYNC_S)
        asker = HubClient(hub.address, secret)
        dense = "v000000000001/dense"

        def offered(v: int) -> list[str]:
            return asker.sources(f"v{v:012d}/dense", v, dense=True)

        end = time.monotonic() + SYNC_S
        while offered(0) != [holder.address]:  # the holder's report after its commit
            assert time.monotonic() < end, asker.holders()
            time.sleep(0.1)
        reader = PeerClient(holder.address, secret)
        reader.dense_range(0, "layer0.weight", 0, 64, lease="reader")
        pub.publish(step(s0, 1))
        end = time.monotonic() + SYNC_S
        while 1 not in next(h for h in asker.holders() if h["id"] == "holder")["versions"]:
            assert time.monotonic() < end, asker.holders()
            time.sleep(0.1)
        assert holder.address in asker.sources(dense, 1)  # its chunks of v1 are offered
        assert offered(1) == []  # its dense bits of v1 are not: it still holds v0
        reader.release("reader")
        holder.synced(1, SYNC_S)
        end = time.monotonic() + SYNC_S
        while offered(1) != [holder.address]:
            assert time.monotonic() < end, asker.holders()
            time.sleep(0.1)
        got = reader.dense_range(1, "layer0.weight", 0, 64, lease="joiner")
        assert np.frombuffer(got, np.uint8).size == 64
    finally:
        if pub is not None:
            pub.close()
        hub.kill()


class _FailsOnce(StateDictTarget):
    """A target whose held() fails once with an exception outside weighthub's tree."""

    def __init__(self) -> None:
        super().__init__({})
        self.fail = False

    def held(self) -> Any:
        if self.fail:
            self.fail = False
            raise RuntimeError("a driver hiccup")
        return super().held()


def test_an_unexpected_failure_is_reported_and_the_node_keeps_following() -> None:
    # before: the follow thread died with the exception, and the node silently followed nothing
    store = MemoryStore()
    pub = Publisher(store, full_span_bytes=64 << 10)
    s0 = make_state(0, tensors=1, numel=1 << 12)
    pub.publish(s0)
    target, events = _FailsOnce(), Events()
    node = Node(store, target, b"s" * 32, NodeConfig("odd", poll_s=0.05), hub=None,
                cache=MemoryStore("cache"), on_event=events).start()
    try:
        events.wait("synced", 0)
        target.fail = True
        e = events.wait("error", None)
        assert "RuntimeError: a driver hiccup" in e["error"], e
        s1 = step(s0, 1)
        pub.publish(s1)
        events.wait("synced", 1)
        assert same_bits(target.state, s1)
    finally:
        node.stop()


class _RecordsNice(StateDictTarget):
    """Notes the nice value of the thread that commits each version."""

    def __init__(self) -> None:
        super().__init__({})
        self.nice: list[int] = []

    def commit(self, held: Any) -> None:
        import threading
        self.nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        super().commit(held)


def test_a_niced_node_applies_at_its_nice_value_and_serves_at_the_process_priority() -> None:
    import threading

    store = MemoryStore()
    Publisher(store, full_span_bytes=64 << 10).publish(make_state(0, tensors=1, numel=1 << 12))
    target, events = _RecordsNice(), Events()
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    node = Node(store, target, b"s" * 32, NodeConfig("low", poll_s=0.05, nice=max(here, 12)),
                hub=None, cache=MemoryStore("cache"), on_event=events).start()
    try:
        events.wait("synced", 0)
        assert target.nice == [max(here, 12)]
        others = {t.name: os.getpriority(os.PRIO_PROCESS, t.native_id)
                  for t in threading.enumerate() if t.native_id is not None
                  and t is not threading.current_thread() and t.name != "node-follow"}
        assert others and all(n == here for n in others.values()), others  # the chunk server's
    finally:
        node.stop()
    with pytest.raises(UsageError, match=r"--nice must be in 0\.\.19"):
        NodeConfig("bad", nice=20)


def test_a_node_refuses_a_store_check_period_out_of_range() -> None:
    for bad in (-1.0, 1e6):
        with pytest.raises(UsageError, match=r"--store-check must be in \[0, 86400\] seconds"):
            NodeConfig("bad", store_check_s=bad)


class _HidesNewest:
    """The store as a node sees it, its newest version hidden until `show` (published meanwhile)."""

    def __init__(self, store: MemoryStore, hidden: str) -> None:
        self.inner, self.hidden, self.show = store, hidden, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def children(self, prefix: str, **kw: Any) -> list[str]:
        names = self.inner.children(prefix, **kw)
        return names if self.show or prefix else [n for n in names if n != self.hidden]


@pytest.mark.parametrize("pushed", [True, False])
def test_a_ray_node_daemon_applies_a_pushed_delta_after_the_engines_staging(pushed: bool) -> None:
    """integrations.ray.daemons: a delta whose manifest and chunks were pushed to the daemon
    whole waits `apply_delay_s` before the daemon's own apply (the host's engines stage from
    those chunks meanwhile); one it must fetch itself does not wait; stopping ends the wait."""
    import threading

    from weighthub import catalog
    from weighthub.format import chunk_checksum
    from weighthub.integrations.ray.daemons import _EnginesFirst

    store = MemoryStore()
    pub = Publisher(store, full_span_bytes=64 << 10, delta_span_bytes=64 << 10)
    v0 = make_state(0, tensors=2, numel=1 << 12)
    v1 = step(v0, 1)
    pub.publish(v0)
    pub.publish(v1)
    view, cache = _HidesNewest(store, catalog.version_dir(1)), MemoryStore("cache")
    events, target = Events(), StateDictTarget({})
    node = _EnginesFirst(view, target, b"s" * 32, NodeConfig("d", poll_s=0.05),
                         hub=None, cache=cache, on_event=events, apply_delay_s=30.0)
    waits: list[float] = []
    real_wait = node._stopping.wait
    node._stopping.wait = lambda s: waits.append(s) or real_wait(s)  # type: ignore[method-assign]
    node.start()
    try:
        events.wait("synced", 0)
        if pushed:  # what the relay tree pushes: the chunks, then the manifest the hub vouched for
            key = catalog.rep_key(1, None, primary=True)
            raw = store.get(key)
            for ref in catalog.primary_manifest(store, 1).chunks:
                cache.put(ref.key, store.get(ref.key))
            cache.put(key, raw)
            node.digests[1] = chunk_checksum(raw)
        view.show = True
        if not pushed:
            events.wait("synced", 1)
            assert waits == [] and same_bits(target.state, v1)
            return
        deadline = time.monotonic() + 30
        while not waits and time.monotonic() < deadline:
            time.sleep(0.01)
        assert waits == [30.0]  # waiting for the engines' staging, still at version 0
        held = node.target.held()
        assert held is not None and held.version == 0
    finally:
        t0 = time.monotonic()
        stopper = threading.Thread(target=node.stop)
        stopper.start()
        stopper.join(20)
        assert not stopper.is_alive() and time.monotonic() - t0 < 20  # the wait ends at stop
