"""The hub from the command line: `weighthub publish --hub`, and nodes following a hub that knows
no version yet.

Real processes on 127.0.0.1: `weighthub serve hub` (the console command, or the same hub via
`python -m weighthub.cluster.hub`), `weighthub publish --hub` and `weighthub serve node`. The failure
modes (a bad secret file, a hub with another secret, a hub past this store, a hub that never
answers) run `weighthub.cli.main` in-process: they need no torch start-up per case.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest
from hub_helpers import HubProcess, write_secret
from node_helpers import NodeProcess, child_env, make_state, read_bits, same_bits, step
from safetensors.torch import save_file

from silent_server import silent_server
from weighthub import catalog, cli
from weighthub.cluster.hubclient import HubClient
from weighthub.cluster.publisher import NetPublisher, NetPublishResult
from weighthub.publish import Publisher, PublishResult
from weighthub.sources import ChunkId
from weighthub.store import LocalStore

# several real processes per test: outside the fast subset (-m "not slow")
pytestmark = pytest.mark.slow

SYNC_S = 60.0  # generous: 2 loaded cores, several processes starting at once
CLI_S = 120.0  # one `weighthub publish` process: a cold torch import on a loaded machine


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    write_secret(tmp_path / "secret")
    return tmp_path / "secret"


@pytest.fixture
def secret(secret_file: Path) -> bytes:
    return secret_file.read_bytes().strip()


@pytest.fixture
def hub(tmp_path: Path, secret_file: Path) -> Iterator[HubProcess]:
    h = HubProcess.start(tmp_path / "hub.db", secret_file)
    yield h
    h.kill()


@pytest.fixture
def ckpts(tmp_path: Path) -> list[Path]:
    """Three checkpoints, each an RL-like step from the one before."""
    states = [make_state(0, tensors=3, numel=1 << 16)]
    states.append(step(states[0], 1))
    states.append(step(states[1], 2))
    paths = []
    for i, s in enumerate(states):
        paths.append(tmp_path / f"ckpt{i}.safetensors")
        save_file(s, paths[-1])
    return paths


def publish(store: Path, ckpt: Path, *extra: object) -> int:
    return cli.main(["publish", str(store), str(ckpt), *map(str, extra)])


def wait_stderr(node: NodeProcess, text: str, timeout: float) -> None:
    """Until a line of the node's stderr contains `text`; TimeoutError after `timeout`."""
    end = time.monotonic() + timeout
    while not any(text in line for line in node.stderr):
        if time.monotonic() > end:
            raise TimeoutError(f"node {node.id}: no {text!r} on stderr within {timeout:g}s "
                               f"(exit {node.proc.poll()}): {''.join(node.stderr[-15:])}")
        time.sleep(0.05)


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weighthub: error: "), err
    return lines[0]


def test_cli_publish_announces_the_commit_to_a_cli_hub(tmp_path: Path, secret_file: Path, secret: bytes,
                                                      ckpts: list[Path]) -> None:
    store = tmp_path / "store"
    hub = HubProcess.start(tmp_path / "hub.db", secret_file, cli=True)  # `weighthub serve hub`
    try:
        p = subprocess.run([sys.executable, "-m", "weighthub.cli", "publish", str(store), str(ckpts[0]),
                            "--hub", hub.address, "--secret-file", str(secret_file), "--json"],
                           capture_output=True, text=True, timeout=CLI_S, env=child_env())
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        assert doc["version"] == 0 and doc["hub"] == {"address": hub.address, "announced": True}
        assert publish(store, ckpts[1], "--hub", hub.address, "--secret-file", secret_file) == 0

        client = HubClient(hub.address, secret, timeout=5.0)
        assert [r["version"] for r in client.versions()] == [0, 1]
        record = client.latest_record()
        assert record is not None
        local = LocalStore(store)
        raw = local.get(record["manifest_key"])
        # what nodes check a relayed manifest by, and where they fetch what no holder has
        assert record["version"] == 1 and record["manifest_key"] == catalog.rep_key(1, None, primary=True)
        assert record["manifest_sha256"] == hashlib.sha256(raw).hexdigest()
        assert record["root"] == catalog.primary_manifest(local, 1).root
        assert record["store_url"] == local.url
        # announce only: the one-shot publisher registered no holder (it would be gone at once)
        assert client.holders() == []
        assert hub.stop() == 0
    finally:
        hub.kill()


def test_a_hub_that_never_answers_keeps_the_commit_and_exits_4(
        tmp_path: Path, secret_file: Path, ckpts: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    with silent_server() as address:
        code = publish(store, ckpts[0], "--hub", address, "--secret-file", secret_file,
                       "--hub-timeout", "0.5", "--json")
    out, err = capsys.readouterr()
    assert code == cli.EXIT_NOT_ANNOUNCED == 4
    assert catalog.list_versions(LocalStore(store)) == [0]  # the commit stands
    doc = json.loads(out)  # stdout still reports the commit, for scripts
    assert doc["version"] == 0 and doc["hub"]["announced"] is False
    assert "PeerUnavailable" in doc["hub"]["error"]
    line = one_line(err)
    assert f"version 0 is committed in {LocalStore(store).url}" in line
    assert f"hub {address} did not take the announcement" in line and "the commit stands" in line


def test_bad_secrets_and_hubs_are_refused_before_anything_is_committed(
        tmp_path: Path, hub: HubProcess, secret: bytes, ckpts: list[Path],
        capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    missing = tmp_path / "missing-secret"
    assert publish(store, ckpts[0], "--hub", hub.address, "--secret-file", missing) == cli.EXIT_USAGE
    assert f"cannot read the weighthub secret file {missing}" in one_line(capsys.readouterr().err)

    short = tmp_path / "short-secret"
    short.write_text("abc\n")
    assert publish(store, ckpts[0], "--hub", hub.address, "--secret-file", short) == cli.EXIT_USAGE
    assert f"secret file {short} has 3 bytes" in one_line(capsys.readouterr().err)

    assert publish(store, ckpts[0], "--secret-file", short) == cli.EXIT_USAGE
    assert "pass it with --hub" in one_line(capsys.readouterr().err)

    other = tmp_path / "other-secret"
    write_secret(other)
    assert publish(store, ckpts[0], "--hub", hub.address, "--secret-file", other) == cli.EXIT_FAILED
    line = one_line(capsys.readouterr().err)
    assert "AuthError" in line and "bad signature" in line and "nothing was committed" in line

    # a hub that already tracks a later version follows another store: its announce would fail
    HubClient(hub.address, secret).announce(5, manifest_key="v000000000005/manifest.json",
                                            store_url="file:///elsewhere", model_id="m", root="r5")
    good = tmp_path / "secret"
    assert publish(store, ckpts[0], "--hub", hub.address, "--secret-file", good) == cli.EXIT_FAILED
    line = one_line(capsys.readouterr().err)
    assert f"hub {hub.address} already has version 5" in line and "nothing was committed" in line
    assert not store.exists() or catalog.list_versions(LocalStore(store)) == []


def test_sources_of_a_version_the_hub_does_not_know_is_the_store_quietly(
        hub: HubProcess, secret: bytes, caplog: pytest.LogCaptureFixture) -> None:
    client = HubClient(hub.address, secret, timeout=5.0)
    with caplog.at_level(logging.DEBUG, logger="weighthub"):
        chunk = ChunkId(3, catalog.rep_key(3, None, primary=True), 0,
                        "v000000000003/full-x/c000000.whc", 1, "0" * 64)
        assert client.peer_sources(chunk) == []
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_node_following_a_hub_that_knows_no_version_warns_nothing(
        tmp_path: Path, secret_file: Path, hub: HubProcess, ckpts: list[Path]) -> None:
    # Versions published without --hub: the node reads them from the store. That is a normal
    # state (a hub started before anything was announced), so nothing is printed on stderr.
    store = tmp_path / "store"
    node = NodeProcess.start(store, tmp_path / "n1" / "model.safetensors", secret_file,
                             hub=hub.address, node_id="n1", labels="region=a,zone=z1,host=h1")
    try:
        node.listening()
        assert publish(store, ckpts[0]) == 0
        assert node.synced(0, SYNC_S)["how"] == "store"
        assert publish(store, ckpts[1]) == 0
        assert node.synced(1, SYNC_S)["how"] == "delta"
        # once the hub knows a version, the node follows the hub's announcements
        assert publish(store, ckpts[2], "--hub", hub.address, "--secret-file", secret_file) == 0
        node.synced(2, SYNC_S)
        assert same_bits(read_bits(node.out), read_bits(ckpts[2]))
    finally:
        node.stop()
    # stderr ends with the stop line; every line before it was read by then (one pipe, in order)
    wait_stderr(node, "weighthub node stopped", 30.0)
    assert node.stderr[:-1] == [], "".join(node.stderr)


def test_a_node_whose_hub_missed_an_announcement_follows_the_store(
        tmp_path: Path, secret_file: Path, hub: HubProcess, ckpts: list[Path]) -> None:
    # A version committed while the hub was down or restarting (here: published without --hub)
    # leaves the hub naming the version before. The node reads the store's listing once the hub
    # has said the same version for --store-check seconds, rather than wait for the next publish.
    store = tmp_path / "store"
    node = NodeProcess.start(store, tmp_path / "n1" / "model.safetensors", secret_file,
                             hub=hub.address, node_id="n1", extra=("--store-check", "1"))
    try:
        node.listening()
        assert publish(store, ckpts[0], "--hub", hub.address, "--secret-file", secret_file) == 0
        node.synced(0, SYNC_S)
        assert publish(store, ckpts[1]) == 0  # the hub never hears of version 1
        assert node.synced(1, SYNC_S)["how"] == "delta"
        assert same_bits(read_bits(node.out), read_bits(ckpts[1]))
        wait_stderr(node, "the hub missed its announcement", SYNC_S)
    finally:
        node.stop()


def test_a_net_publisher_announces_again_when_its_hub_comes_back(
        tmp_path: Path, secret_file: Path, secret: bytes) -> None:
    states = [make_state(0, tensors=3, numel=1 << 16)]
    states.append(step(states[0], 1))
    store = LocalStore(tmp_path / "store")
    hub = HubProcess.start(tmp_path / "hub.db", secret_file, lease_ttl=3.0)  # a beat a second
    net = NetPublisher(store, secret, hub=HubClient(hub.address, secret, timeout=2.0)).start()
    try:
        assert net.publish(states[0]).announced
        port = int(hub.address.rpartition(":")[2])
        hub.kill()
        r = net.publish(states[1])
        assert (r.version, r.announced) == (1, False)  # committed all the same
        hub = HubProcess.start(tmp_path / "hub.db", secret_file, lease_ttl=3.0, port=port)
        client = HubClient(hub.address, secret, timeout=5.0)
        deadline = time.monotonic() + SYNC_S
        while client.latest() != 1:  # the publisher's next heartbeat re-announces version 1
            assert time.monotonic() < deadline, f"the hub still names {client.latest()}"
            time.sleep(0.1)
        record = client.latest_record()
        assert record is not None and record["publisher"] == net.id
        raw = store.get(catalog.rep_key(1, None, primary=True))
        assert record["manifest_sha256"] == hashlib.sha256(raw).hexdigest()
    finally:
        net.close()
        hub.kill()


def test_net_publisher_result_is_a_publish_result(tmp_path: Path, secret: bytes) -> None:
    states = [make_state(0, tensors=3, numel=1 << 16)]
    states.append(step(states[0], 1))
    plain = Publisher(LocalStore(tmp_path / "plain"))
    net = NetPublisher(LocalStore(tmp_path / "net"), secret, hub=None).start()
    try:
        for s in states:
            expected = plain.publish(s)
            r = net.publish(s)
            assert isinstance(r, NetPublishResult) and isinstance(r, PublishResult)
            assert (r.planned, r.pushed, r.dead, r.announced) == (0, 0, (), False)  # no hub, no relay
            # the same publish: every size and count field equal; the properties computed alike
            for f in ("version", "base", "dense_bytes", "payload_bytes", "changed", "numel", "chunks"):
                assert getattr(r, f) == getattr(expected, f), f
            assert r.changed_fraction == expected.changed_fraction
            assert {f.name for f in fields(PublishResult)} <= {f.name for f in fields(r)}
        assert r.version == 1 and r.base == 0 and 0 < r.changed_fraction < 0.1
    finally:
        net.close()


def test_a_net_publisher_restarting_adopts_the_store_and_publishes_a_delta(
        tmp_path: Path, secret: bytes) -> None:
    """It reads the store's head back through its own store wrapper (with per-call timeouts)."""
    states = [make_state(0, tensors=3, numel=1 << 16)]
    states.append(step(states[0], 1))
    store = LocalStore(tmp_path / "store")
    Publisher(store).publish(states[0])
    net = NetPublisher(store, secret, hub=None).start()
    try:
        r = net.publish(states[1])
        assert (r.version, r.base) == (1, 0) and 0 < r.changed_fraction < 0.1
    finally:
        net.close()


def test_serve_hub_without_aiohttp_names_the_net_extra(tmp_path: Path, secret_file: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    import weighthub.cluster

    monkeypatch.setitem(sys.modules, "aiohttp", None)  # importing it now fails
    monkeypatch.delitem(sys.modules, "weighthub.cluster.hub", raising=False)
    monkeypatch.delattr(weighthub.cluster, "hub", raising=False)
    code = cli.main(["serve", "hub", "--db", str(tmp_path / "hub.db"), "--secret-file", str(secret_file)])
    assert code == cli.EXIT_USAGE
    assert "pip install 'weighthub[net]'" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "hub.db").exists()
