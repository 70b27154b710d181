"""`weighthub serve node` end to end: real hub and node processes on loopback, a NetPublisher here.

Nodes follow versions through the hub's relay tree, a newcomer joins from holders (not the
store), and a holder defers its apply while a reader holds a read lease. Bits are compared as
integer views of the nodes' safetensors files against the publisher's states.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from deadlines import PROCESS_S
from hub_helpers import HubProcess, write_secret
from node_helpers import NodeProcess, make_state, read_bits, same_bits, step

from weighthub import cli
from weighthub.cluster.hubclient import HubClient
from weighthub.cluster.publisher import NetPublisher
from weighthub.cluster.topology import Labels
from weighthub.net.client import PeerClient
from weighthub.store import LocalStore
from weighthub.tensors import bits

# several real processes per test: outside the fast subset (-m "not slow")
pytestmark = pytest.mark.slow

SYNC_S = PROCESS_S  # several processes start at once on 2 loaded cores
NO_POLL_S = 600.0  # a poll interval no sync in a test waits for: only a relayed manifest wakes


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    write_secret(tmp_path / "secret")
    return tmp_path / "secret"


@pytest.fixture
def hub(tmp_path: Path, secret_file: Path) -> Iterator[HubProcess]:
    h = HubProcess.start(tmp_path / "hub.db", secret_file, lease_ttl=5.0, fanout=2)
    yield h
    h.kill()


@pytest.fixture
def nodes() -> Iterator[list[NodeProcess]]:
    started: list[NodeProcess] = []
    yield started
    for n in started:
        n.kill9()


def publisher(store: Path, secret_file: Path, hub: str | None) -> NetPublisher:
    secret = secret_file.read_bytes().strip()
    client = HubClient(hub, secret, labels=Labels("a", "z1", "h0")) if hub else None
    return NetPublisher(LocalStore(store), secret, hub=client, publisher_id="trainer",
                        delta_span_bytes=256 << 10).start()


def test_nodes_follow_through_the_relay_tree_and_a_newcomer_joins_from_holders(
        tmp_path: Path, secret_file: Path, hub: HubProcess, nodes: list[NodeProcess]) -> None:
    # The nodes never poll within the test: each version reaches them as the manifest relayed
    # down the tree (checked against the hub's digest), which is also all they read of it.
    store = tmp_path / "store"
    for i in range(3):
        nodes.append(NodeProcess.start(store, tmp_path / f"n{i}" / "model.safetensors", secret_file,
                                       hub=hub.address, node_id=f"n{i}", poll=NO_POLL_S,
                                       labels=f"region=a,zone=z1,host=h{i + 1}"))
    for n in nodes:
        n.listening()
    pub = publisher(store, secret_file, hub.address)
    try:
        states = [make_state(0)]
        pub.publish(states[0])
        for n in nodes:
            n.synced(0, SYNC_S)
        states.append(step(states[0], 1))
        r1 = pub.publish(states[1])
        assert r1.planned == 3 and r1.pushed > 0 and not r1.dead and r1.announced
        for n in nodes:
            e = n.synced(1, SYNC_S)
            # every chunk arrived through the relay tree before the commit: none from the store
            assert e["how"] == "delta" and e["stats"]["from_cache"] == r1.chunks, e
            assert e["stats"]["from_backing"] == 0 and e["stats"]["manifests_relayed"] >= 1, e
            assert same_bits(read_bits(n.out), states[1])

        newcomer = NodeProcess.start(store, tmp_path / "n9" / "model.safetensors", secret_file,
                                     hub=hub.address, node_id="n9", labels="region=a,zone=z1,host=h9",
                                     poll=NO_POLL_S)
        nodes.append(newcomer)
        e = newcomer.synced(1, SYNC_S + 30)
        # the dense bits came striped from several holders; not one chunk from the store (the
        # publisher holds chunks only: it registered without dense reads, so it is not asked)
        assert e["how"] == "join" and len(e["by_holder"]) >= 2, e
        assert pub.address not in e["by_holder"] and e["excluded"] == [], e
        assert e["stats"]["from_backing"] == 0, e
        assert same_bits(read_bits(newcomer.out), states[1])

        states.append(step(states[1], 2))
        r2 = pub.publish(states[2])
        assert r2.planned == 4  # the newcomer is in the tree now
        for n in nodes:
            e = n.synced(2, SYNC_S)
            assert e["stats"]["from_backing"] == 0 and e["stats"]["manifests_relayed"] >= 1, e
            assert same_bits(read_bits(n.out), states[2])
    finally:
        pub.close()


def test_a_holder_defers_its_apply_while_a_reader_holds_a_read_lease(
        tmp_path: Path, secret_file: Path, hub: HubProcess, nodes: list[NodeProcess]) -> None:
    store = tmp_path / "store"
    holder = NodeProcess.start(store, tmp_path / "h" / "model.safetensors", secret_file,
                               hub=hub.address, node_id="holder", labels="region=a,zone=z1,host=h1")
    nodes.append(holder)
    holder.listening()
    pub = publisher(store, secret_file, hub.address)
    try:
        s0 = make_state(0)
        pub.publish(s0)
        holder.synced(0, SYNC_S)
        reader = PeerClient(holder.address, secret_file.read_bytes().strip())
        name = "layer0.weight"
        want = bits(s0[name]).tobytes()[:4096]
        assert reader.dense_range(0, name, 0, 4096, lease="reader-1") == want

        pub.publish(step(s0, 1))
        time.sleep(3.0)  # the holder has staged v1 by now; its apply waits for the lease
        assert not any(e.get("event") == "synced" and e["version"] == 1 for e in holder.events)
        assert reader.dense_range(0, name, 0, 4096, lease="reader-1") == want  # still v0's bits
        released = time.monotonic()
        reader.release("reader-1")
        holder.synced(1, SYNC_S)
        assert time.monotonic() - released < SYNC_S
    finally:
        pub.close()


def test_bench_net_runs_at_a_tiny_size() -> None:
    from weighthub.bench import net

    doc = net.run_net_bench((2,), size_mib=1, shaped=False, reps=1, progress=lambda _m: None)
    modes = {(r["mode"], r["receivers"]) for r in doc["loopback"]}
    assert modes == {("relay", 2), ("store", 2)}
    relay = next(r for r in doc["loopback"] if r["mode"] == "relay")
    assert relay["from_backing"] == 0 and relay["from_cache"] == 2 * relay["chunks"]
    assert doc["join_holders"]["how"] == "join" and doc["relay_killed"]["killed"]
    assert "relay" in net.format_table(doc)


def test_serve_node_refuses_bad_labels(tmp_path: Path, secret_file: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["serve", "node", str(tmp_path / "store"), str(tmp_path / "out.safetensors"),
                     "--secret-file", str(secret_file), "--labels", "region=a,colour=blue"])
    assert code == 2
    assert "unknown label" in capsys.readouterr().err
