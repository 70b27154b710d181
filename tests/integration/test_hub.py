"""The hub (`weighthub serve hub`) as a real process on 127.0.0.1, driven through HubClient."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hub_helpers import HubProcess, raw_request, signed_request, write_secret

from silent_server import silent_server
from weighthub import cli
from weighthub.cluster.hubclient import HubClient
from weighthub.cluster.topology import Labels
from weighthub.errors import (
    AuthError,
    ModelMismatch,
    PeerUnavailable,
    UsageError,
    VersionError,
    VersionNotFound,
)
from weighthub.net.auth import sign
from weighthub.sources import ChunkId

# several real processes per test: outside the fast subset (-m "not slow")
pytestmark = pytest.mark.slow

KEY = "v000000000001/c0000.whc"
CHUNK = ChunkId(1, "v000000000001/manifest.json", 0, KEY, 1, "0" * 64)  # KEY, as a chunk of v1


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    write_secret(path)
    return path


@pytest.fixture
def secret(secret_file: Path) -> bytes:
    return secret_file.read_bytes().strip()


@pytest.fixture
def hub(tmp_path: Path, secret_file: Path) -> Iterator[HubProcess]:
    h = HubProcess.start(tmp_path / "hub.db", secret_file, lease_ttl=30.0, retain=2)
    yield h
    h.kill()


def client(hub: HubProcess, secret: bytes, labels: Labels | None = None) -> HubClient:
    return HubClient(hub.address, secret, labels=labels, timeout=5.0)


def announce(c: HubClient, v: int, *, root: str | None = None, model: str = "m") -> list[int]:
    return c.announce(v, manifest_key=f"v{v:012d}/manifest.json", store_url="file:///store",
                      model_id=model, root=root or f"root{v}", publisher="pub")


def test_sources_ranked_by_topology_then_load(hub: HubProcess, secret: bytes) -> None:
    here = Labels("eu", "eu-1a", "h1")
    admin = client(hub, secret)
    announce(admin, 1)
    holders = {  # id: (labels, load, versions)
        "host-busy": (here, 5, [1]), "host-idle": (here, 1, [1]),
        "zone": (Labels("eu", "eu-1a", "h2"), 0, [1]), "region": (Labels("eu", "eu-1b", "h1"), 0, [1]),
        "remote": (Labels("us", "eu-1a", "h1"), 0, [1]), "other-version": (here, 0, [7]),
    }
    for hid, (labels, load, versions) in holders.items():
        c = client(hub, secret, labels)
        c.register(hid, f"127.0.0.1:{1000 + len(hid)}", versions=versions, load=load)
    asker = client(hub, secret, here)
    asker.register("asker", "127.0.0.1:1", versions=[1])  # it holds v1 too, but never for itself
    ranked = asker.source_details(KEY, 1)
    assert [(s.id, s.tier) for s in ranked] == [
        ("host-idle", "host"), ("host-busy", "host"), ("zone", "zone"), ("region", "region"),
        ("remote", "remote"), ("store", "store")]
    assert ranked[-1].address == "file:///store"
    assert asker.sources(KEY, 1) == [s.address for s in ranked[:-1]]
    assert asker.peer_sources(CHUNK) == asker.sources(KEY, 1)
    # load is live: the idle one gets busy, the ranking follows on its next heartbeat
    c = client(hub, secret, here)
    c.register("host-idle", f"127.0.0.1:{1000 + len('host-idle')}", versions=[1], load=9)
    assert [s.id for s in asker.source_details(KEY, 1)][:2] == ["host-busy", "host-idle"]


def test_expired_lease_is_no_longer_a_source(tmp_path: Path, secret_file: Path, secret: bytes) -> None:
    hub = HubProcess.start(tmp_path / "hub.db", secret_file, lease_ttl=1.0)
    try:
        announce(client(hub, secret), 1)
        alive, silent = client(hub, secret), client(hub, secret)
        alive.register("alive", "127.0.0.1:2", versions=[1])
        silent.register("silent", "127.0.0.1:3", versions=[1])
        alive.start_heartbeat(interval=0.2)
        assert sorted(client(hub, secret).sources(KEY, 1)) == ["127.0.0.1:2", "127.0.0.1:3"]
        time.sleep(1.6)
        assert client(hub, secret).sources(KEY, 1) == ["127.0.0.1:2"]
        assert [h["id"] for h in alive.holders()] == ["alive"]
        silent.heartbeat()  # it comes back with its next heartbeat
        assert sorted(client(hub, secret).sources(KEY, 1)) == ["127.0.0.1:2", "127.0.0.1:3"]
        alive.stop()  # leaves the hub at once
        assert client(hub, secret).sources(KEY, 1) == ["127.0.0.1:3"]
    finally:
        hub.kill()


def test_hub_restart_keeps_versions_releases_and_plans(tmp_path: Path, secret_file: Path,
                                                       secret: bytes) -> None:
    db = tmp_path / "hub.db"
    hub = HubProcess.start(db, secret_file, lease_ttl=2.0, retain=2)
    try:
        c = client(hub, secret, Labels("eu", "a", "h"))
        assert announce(c, 1) == []
        assert announce(c, 2) == []
        assert announce(c, 3) == [1]  # retain 2: the third commit releases the first
        c.register("pub", "127.0.0.1:5", versions=[3])
        client(hub, secret, Labels("eu", "a", "h2")).register("r1", "127.0.0.1:6", subscribe=True)
        plan = c.plan(4, publisher="pub", degree=2)
        hub.kill()  # kill -9: no clean shutdown
        hub = HubProcess.start(db, secret_file, lease_ttl=2.0, retain=2)
        c = client(hub, secret)
        assert c.latest() == 3
        assert [(v["version"], v["released"]) for v in c.versions()] == [(1, True), (2, False), (3, False)]
        with pytest.raises(VersionNotFound, match="version 1 was released"):
            c.sources(KEY, 1)
        assert c.plan(4) == plan
        assert c.sources(KEY, 3) == ["127.0.0.1:5"]  # holders survive, with a lease from the restart
        assert announce(c, 3) == []  # a retried announce of the same commit is fine
        with pytest.raises(VersionError, match="already committed with root root3"):
            announce(c, 3, root="different")
        time.sleep(2.5)  # nobody heartbeat since the restart: the lease ran out
        assert c.sources(KEY, 3) == []
    finally:
        hub.kill()


def test_release_and_heartbeat_tell_holders_what_to_drop(hub: HubProcess, secret: bytes) -> None:
    c = client(hub, secret)
    announce(c, 1)
    announce(c, 2)
    with pytest.raises(VersionError, match="version 2 is the latest"):
        c.release(2)
    dropped: list[list[int]] = []
    got = threading.Event()
    holder = client(hub, secret)

    def on_release(versions: list[int]) -> None:
        dropped.append(versions)
        got.set()
    holder.on_release = on_release
    holder.register("h", "127.0.0.1:7", versions=[1, 2])
    holder.start_heartbeat(interval=0.1)
    try:
        assert c.release(1) == [1]
        assert c.release(1) == []  # idempotent
        assert got.wait(5)
        assert dropped[0] == [1]
    finally:
        holder.stop()
    assert c.holders() == []


def test_relay_plan_over_http(hub: HubProcess, secret: bytes) -> None:
    pub = client(hub, secret, Labels("eu", "a", "h0"))
    pub.register("pub", "127.0.0.1:10")
    for i, labels in enumerate([Labels("eu", "a", "h1"), Labels("eu", "a", "h1"), Labels("us", "b", "h9"),
                                Labels("us", "b", "h9"), Labels("us", "c", "h8")]):
        client(hub, secret, labels).register(f"r{i}", f"127.0.0.1:{20 + i}", subscribe=True)
    client(hub, secret).register("not-subscribed", "127.0.0.1:30")
    plan = pub.plan(5, publisher="pub", degree=2)
    tree = plan.tree
    assert set(tree.labels) == {"pub", "r0", "r1", "r2", "r3", "r4"}
    assert len(tree.crossings()) == 1  # one remote region, entered once
    assert plan.addresses["r2"] == "127.0.0.1:22"
    assert client(hub, secret).plan(5) == plan  # frozen: everyone reads the same tree
    with pytest.raises(VersionError, match="already being relayed by 'pub'"):
        client(hub, secret).plan(5, publisher="r0")
    (region_root,) = [c for _, c in tree.crossings()]
    replanned = client(hub, secret).report_failed(5, [region_root])
    assert region_root not in replanned.tree.labels and len(replanned.tree.crossings()) == 1
    with pytest.raises(UsageError, match="publisher 'pub' failed"):
        client(hub, secret).report_failed(5, ["pub"])
    with pytest.raises(VersionNotFound, match="no relay plan for version 6"):
        client(hub, secret).plan(6)
    with pytest.raises(UsageError, match="'ghost' is not a registered holder"):
        client(hub, secret).plan(6, publisher="ghost")


def test_requests_without_a_valid_token_are_refused(hub: HubProcess, secret: bytes) -> None:
    status, doc = raw_request(hub.address, "GET", "/v1/latest")
    assert (status, doc["error"]) == (401, "AuthError") and "no auth token" in doc["message"]
    with pytest.raises(AuthError, match="bad signature"):
        HubClient(hub.address, b"w" * 32).latest()
    token = sign(secret, "GET", "/v1/latest")
    assert raw_request(hub.address, "GET", "/v1/latest", token=token)[0] == 200
    status, doc = raw_request(hub.address, "GET", "/v1/latest", token=token)
    assert status == 401 and "replayed" in doc["message"]
    status, doc = raw_request(hub.address, "GET", "/v1/versions", token=token)  # signed for another path
    assert status == 401 and "bad signature" in doc["message"]
    stale = sign(secret, "GET", "/v1/latest", now=time.time() - 3600)
    assert "expired" in raw_request(hub.address, "GET", "/v1/latest", token=stale)[1]["message"]


def test_bad_requests_get_clear_errors(hub: HubProcess, secret: bytes) -> None:
    c = client(hub, secret)
    with pytest.raises(VersionNotFound, match="version 9 is not committed on this hub"):
        c.sources(KEY, 9)
    status, doc = signed_request(hub.address, secret, "POST", "/v1/versions", b"{not json")
    assert (status, doc["error"]) == (400, "UsageError") and "not JSON" in doc["message"]
    status, doc = signed_request(hub.address, secret, "POST", "/v1/versions", b"[1, 2]")
    assert status == 400 and "must be a JSON object" in doc["message"]
    big = json.dumps({"id": "x" * (2 << 20)}).encode()
    status, doc = signed_request(hub.address, secret, "PUT", "/v1/holders", big)
    assert (status, doc["error"]) == (413, "LimitError") and "over the hub's limit" in doc["message"]
    status, doc = signed_request(hub.address, secret, "GET", "/v1/nothing")
    assert status == 404 and "see weighthub.cluster.hub" in doc["message"]
    status, doc = signed_request(hub.address, secret, "GET", "/v1/sources?version=x&key=k")
    assert status == 400 and "'version' must be a non-negative integer" in doc["message"]
    body = json.dumps({"version": 1, "manifest_key": "k", "store_url": "u", "model_id": "m"}).encode()
    status, doc = signed_request(hub.address, secret, "POST", "/v1/versions", body)
    assert status == 400 and doc["message"] == "missing field 'root'"
    with pytest.raises(UsageError, match=r"field 'load' must be in 0\.\.1000000"):
        c.register("h", "127.0.0.1:1", load=-1)
    body = json.dumps({"id": "h", "address": "a:1", "labels": {"rack": "r1"}}).encode()
    status, doc = signed_request(hub.address, secret, "PUT", "/v1/holders", body)
    assert status == 400 and "unknown label(s) ['rack']; known: region, zone, host" in doc["message"]
    announce(c, 3)
    with pytest.raises(VersionError, match="older than the latest committed, 3"):
        announce(c, 2)
    with pytest.raises(ModelMismatch, match="this hub tracks 'm'"):
        announce(c, 4, model="other")


def test_unanswering_hub_raises_peer_unavailable_within_the_timeout() -> None:
    with silent_server() as address:
        c = HubClient(address, b"s" * 32, timeout=0.5)
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailable, match=f"hub {address} did not answer GET /v1/latest within 0.5s"):
            c.latest()
        assert time.monotonic() - t0 < 1.5
        # a HolderSource's ranking falls back to the store, and skips the dead hub for a while
        t0 = time.monotonic()
        assert c.peer_sources(CHUNK) == []
        assert c.peer_sources(CHUNK) == []
        assert time.monotonic() - t0 < 1.5
    closed = HubClient(address, b"s" * 32, timeout=0.5)  # nothing listens there any more
    with pytest.raises(PeerUnavailable, match="is `weighthub serve hub` running there"):
        closed.latest()


def test_cli_serve_hub_prints_its_address_and_exits_on_sigterm(tmp_path: Path, secret_file: Path,
                                                               secret: bytes) -> None:
    hub = HubProcess.start(tmp_path / "hub.db", secret_file, cli=True)
    try:
        assert client(hub, secret).latest() is None
        assert hub.stop() == 0
    finally:
        hub.kill()


def test_cli_serve_hub_refuses_a_missing_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["serve", "hub", "--db", str(tmp_path / "hub.db"), "--secret-file",
                     str(tmp_path / "nope")])
    assert code == 2
    assert "cannot read the weighthub secret file" in capsys.readouterr().err


def test_cli_serve_hub_refuses_a_corrupt_database(tmp_path: Path, secret_file: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "hub.db"
    db.write_bytes(b"this is not a database" * 100)
    assert cli.main(["serve", "hub", "--db", str(db), "--secret-file", str(secret_file)]) == 2
    assert f"hub database {db} cannot be opened" in capsys.readouterr().err


def test_manifest_digest_is_recorded_and_joins_see_only_holders_serving_the_version(
        hub: HubProcess, secret: bytes) -> None:
    admin = client(hub, secret)
    digest = "ab" * 32
    admin.announce(1, manifest_key="v000000000001/manifest.json", store_url="file:///store",
                   model_id="m", root="root1", publisher="pub", manifest_sha256=digest)
    record = admin.latest_record()
    assert record is not None and record["version"] == 1 and record["manifest_sha256"] == digest
    with pytest.raises(UsageError, match="SHA-256"):
        admin.announce(2, manifest_key="v000000000002/manifest.json", store_url="file:///store",
                       model_id="m", root="root2", manifest_sha256="not-a-digest")
    client(hub, secret).register("chunks-only", "127.0.0.1:40", versions=[1])
    client(hub, secret).register("dense", "127.0.0.1:41", versions=[1], dense=True, serving=[1])
    # v1's chunks (pushed to it) but not yet its bits: joiners of v1 must not be sent there
    syncing = client(hub, secret)
    syncing.register("syncing", "127.0.0.1:42", versions=[0, 1], dense=True, serving=[0])
    assert sorted(admin.sources(KEY, 1)) == ["127.0.0.1:40", "127.0.0.1:41", "127.0.0.1:42"]
    assert admin.sources("v000000000001/dense", 1, dense=True) == ["127.0.0.1:41"]
    syncing.set_serving([1])  # it committed v1: its next heartbeat says so
    syncing.heartbeat()
    assert sorted(admin.sources("v000000000001/dense", 1, dense=True)) == ["127.0.0.1:41", "127.0.0.1:42"]
    assert {h["id"]: (h["dense"], h["serving"]) for h in admin.holders()} == {
        "chunks-only": (False, []), "dense": (True, [1]), "syncing": (True, [1])}


def test_a_schema_1_database_is_upgraded_in_place(tmp_path: Path) -> None:
    import sqlite3

    from weighthub.cluster.hubstate import HubDB, VersionRecord

    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema', '1');
        CREATE TABLE versions (version INTEGER PRIMARY KEY, manifest_key TEXT NOT NULL,
            store_url TEXT NOT NULL, model_id TEXT NOT NULL, root TEXT NOT NULL, publisher TEXT,
            committed_at REAL NOT NULL, released_at REAL);
        INSERT INTO versions VALUES (3, 'v000000000003/manifest.json', 'file:///s', 'm', 'r3', 'p', 1.0,
            NULL);
        CREATE TABLE holders (id TEXT PRIMARY KEY, address TEXT NOT NULL, region TEXT NOT NULL,
            zone TEXT NOT NULL, host TEXT NOT NULL, versions TEXT NOT NULL, subscribed INTEGER NOT NULL);
        INSERT INTO holders VALUES ('h', '127.0.0.1:9', 'a', 'z', 'h1', '[3]', 1);
        CREATE TABLE plans (version INTEGER PRIMARY KEY, tree TEXT NOT NULL);
    """)
    old.close()
    db = HubDB(path)
    [v3] = db.load_versions()
    assert (v3.version, v3.root, v3.manifest_sha256) == (3, "r3", None)
    [h] = db.load_holders()
    assert h.id == "h" and h.subscribed and not h.dense  # unknown: not asked for dense reads
    db.commit_version(VersionRecord(4, "v000000000004/manifest.json", "file:///s", "m", "r4", "p", 2.0,
                                    manifest_sha256="cd" * 32), [], 2.0)
    db.close()
    assert HubDB(path).load_versions()[-1].manifest_sha256 == "cd" * 32
