"""The S3 store against a real SeaweedFS: the shared conformance suite, big objects, and faults.

Faults: wrong credentials, a missing bucket, an endpoint nothing listens on, a server that
accepts and never answers, a chunk PUT failing midway through a publish, the server killed
during a pull, and chunk bytes tampered with in the bucket. Each must end in a clear weighthub
error within its timeout, with no version committed by a failed publish and the receiver's
target bit-identical to before a failed pull.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from silent_server import silent_server as serve_silently
from weighthub import catalog
from weighthub.errors import (
    ChecksumError,
    ObjectExists,
    ObjectNotFound,
    StoreRefused,
    StoreTimeout,
    StoreUnavailable,
    UsageError,
)
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import Store, open_store
from weighthub.store.s3 import S3Store, parse_s3_url
from weighthub.targets import StateDictTarget
from weighthub.testing import StoreTimeoutTests

MiB = 1 << 20


class TestS3StoreConformance(StoreTimeoutTests):
    """The shipped kit against SeaweedFS; stalled: a server that accepts and never answers,
    with the store's own bounds far longer than the per-call timeouts the kit passes."""

    @pytest.fixture(autouse=True)
    def _server(self, seaweedfs: Any, s3_prefix: str, silent_server: str) -> None:
        self.seaweedfs, self.prefix, self.silent = seaweedfs, s3_prefix, silent_server
        self.made = 0

    def make_store(self) -> Store:
        self.made += 1
        return self.seaweedfs.store(f"{self.prefix}/s{self.made}")

    def stalled_store(self) -> tuple[Store, str]:
        return S3Store("bucket", "p", endpoint_url=self.silent, access_key_id="a",
                       secret_access_key="b", connect_timeout=30, read_timeout=30,
                       attempts=4), "k"


# -- helpers ---------------------------------------------------------------------------------
def make_state(seed: int = 0, rows: int = 1024) -> dict[str, torch.Tensor]:
    """~2M random bf16 elements (4 MiB dense) over three tensors."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(rows, 1024, generator=g).bfloat16(),
        "layers.0.mlp.weight": torch.randn(rows, 896, generator=g).bfloat16(),
        "layers.0.norm.weight": torch.randn(1024, generator=g).bfloat16(),
    }


def step(state: dict[str, torch.Tensor], seed: int, frac: float = 0.02) -> dict[str, torch.Tensor]:
    """An RL-like step: a fraction of the words move by ±1 ulp (integer view)."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for name, t in state.items():
        w = t.clone().view(torch.int16)
        hit = torch.rand(w.shape, generator=g) < frac
        delta = torch.where(torch.rand(w.shape, generator=g) < 0.5, 1, -1).to(torch.int16)
        out[name] = torch.where(hit, w + delta, w).view(torch.bfloat16)
    return out


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


def snapshot(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in state.items()}


class Wrapped:
    """A Store proxy that runs `hook(op, key)` before each call (fault injection, counting)."""

    def __init__(self, inner: Store, hook) -> None:
        self.inner, self.hook, self.url = inner, hook, inner.url

    def get(self, key, **kw):
        self.hook("get", key)
        return self.inner.get(key, **kw)

    def get_range(self, key, start, stop, **kw):
        self.hook("get_range", key)
        return self.inner.get_range(key, start, stop, **kw)

    def size(self, key, **kw):
        self.hook("size", key)
        return self.inner.size(key, **kw)

    def put(self, key, data, *, create_only=False, **kw):
        self.hook("put", key)
        return self.inner.put(key, data, create_only=create_only, **kw)

    def delete(self, key, **kw):
        self.hook("delete", key)
        return self.inner.delete(key, **kw)

    def children(self, prefix, **kw):
        self.hook("children", prefix)
        return self.inner.children(prefix, **kw)


# -- the store -------------------------------------------------------------------------------
def test_server_starts_quickly(seaweedfs: Any) -> None:
    print(f"SeaweedFS start: {seaweedfs.start_seconds:.2f}s")  # shown with -s / in reports
    assert seaweedfs.start_seconds < 20


def test_server_leaves_nothing_in_the_temp_dir(tmp_path: Any, monkeypatch: Any) -> None:
    """weed's glog writes log files into the system temp dir ($TMPDIR) by default, a set per
    start, never removed; the launcher turns them off and logs to its own directory."""
    from weighthub.bench.seaweed import SeaweedServer

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # weed inherits it
    with SeaweedServer.start(bucket="quiet", timeout=30.0) as s3:
        s3.store("p").put("k", b"x")
        assert s3.store("p").get("k") == b"x"
        assert (s3.dir / "weed.log").stat().st_size > 0  # its log went to its own directory
    assert sorted(p.name for p in temp.iterdir()) == []


def test_large_objects_multipart_and_parallel_ranges(seaweedfs: Any, s3_prefix: str) -> None:
    store = seaweedfs.store(s3_prefix, part_size=5 * MiB, multipart_threshold=5 * MiB)
    data = os.urandom(12 * MiB + 3)
    store.put("v1/big.whc", data)
    head = seaweedfs.client().head_object(Bucket=seaweedfs.bucket, Key=f"{s3_prefix}/v1/big.whc")
    assert head["ETag"].strip('"').endswith("-3")  # three parts: a real multipart upload
    assert store.get("v1/big.whc") == data  # first part + two parallel ranged GETs
    assert store.size("v1/big.whc") == len(data)
    assert store.get_range("v1/big.whc", 5 * MiB - 7, 10 * MiB + 9) == data[5 * MiB - 7: 10 * MiB + 9]
    small = store.get_range("v1/big.whc", len(data) - 2, len(data) + 100)
    assert small == data[-2:]
    store.put("v1/big.whc", b"small now")  # replace a multipart object with a plain one
    assert store.get("v1/big.whc") == b"small now"
    store.close()


def test_create_only_is_if_none_match(seaweedfs: Any, s3_prefix: str) -> None:
    store = seaweedfs.store(s3_prefix)
    store.put("v0/manifest.json", b"one", create_only=True)
    with pytest.raises(ObjectExists) as info:
        store.put("v0/manifest.json", b"two", create_only=True)
    assert "PreconditionFailed" in str(info.value.__cause__)  # the server's 412, mapped once
    assert store.get("v0/manifest.json") == b"one"


def test_urls_and_environment(seaweedfs: Any, s3_prefix: str,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_s3_url("s3://my-bucket/a/b/") == ("my-bucket", "a/b")
    assert parse_s3_url("s3://my-bucket") == ("my-bucket", "")
    for bad in ("s3://", "s3://ab/x", "s3://Upper/x", "s3://b_b_b/x", "s3://bucket/a/../b"):
        with pytest.raises(UsageError):
            open_store(bad)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.secret_key)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweedfs.endpoint)
    store = open_store(f"s3://{seaweedfs.bucket}/{s3_prefix}/")
    assert isinstance(store, S3Store) and store.url == f"s3://{seaweedfs.bucket}/{s3_prefix}"
    store.put("k", b"from the environment")
    assert seaweedfs.store(s3_prefix).get("k") == b"from the environment"
    with pytest.raises(UsageError, match="only to s3://"):
        open_store("memory://x", endpoint_url="http://127.0.0.1:1")


def test_publish_pull_bit_exact(seaweedfs: Any, s3_prefix: str) -> None:
    store = seaweedfs.store(s3_prefix)
    pub = Publisher(store, delta_span_bytes=1 * MiB, full_span_bytes=2 * MiB)
    states = [make_state(1)]
    for i in range(1, 3):
        states.append(step(states[-1], i))
    target = StateDictTarget({})
    receiver = Receiver(store, target)
    for v, s in enumerate(states):
        assert pub.publish(s).version == v
        assert receiver.sync().version == v
        assert same_bits(target.state, s)
    fresh = StateDictTarget({})
    Receiver(seaweedfs.store(s3_prefix), fresh).sync()  # a newcomer from the full version
    assert same_bits(fresh.state, states[-1])


# -- faults ----------------------------------------------------------------------------------
def test_wrong_credentials(seaweedfs: Any, s3_prefix: str) -> None:
    for kwargs in ({"secret_access_key": "wrong"}, {"access_key_id": "nobody"}):
        store = S3Store(seaweedfs.bucket, s3_prefix, endpoint_url=seaweedfs.endpoint,
                        access_key_id=kwargs.get("access_key_id", seaweedfs.access_key),
                        secret_access_key=kwargs.get("secret_access_key", seaweedfs.secret_key))
        for call in (lambda s=store: s.get("k"), lambda s=store: s.put("k", b"x"),
                     lambda s=store: s.children(""), lambda s=store: s.size("k")):
            t0 = time.monotonic()
            with pytest.raises(StoreRefused, match="refused the credentials") as info:
                call()
            assert seaweedfs.endpoint in str(info.value)
            assert time.monotonic() - t0 < 2  # a 403 is final: never retried


def test_missing_bucket(seaweedfs: Any) -> None:
    store = S3Store("no-such-bucket-here", "p", endpoint_url=seaweedfs.endpoint,
                    access_key_id=seaweedfs.access_key, secret_access_key=seaweedfs.secret_key)
    for call in (lambda: store.get("k"), lambda: store.size("k"), lambda: store.children(""),
                 lambda: store.get_range("k", 0, 4)):
        with pytest.raises(StoreRefused, match=r"bucket 'no-such-bucket-here' does not exist.*create it"):
            call()
    # a PUT may auto-create buckets for admin identities (SeaweedFS); it must never be silently lost
    try:
        store.put("k", b"x")
    except StoreUnavailable as exc:
        assert "no-such-bucket-here" in str(exc)
    else:
        assert store.get("k") == b"x"


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_endpoint_nothing_listens() -> None:
    store = S3Store("bucket", "p", endpoint_url=f"http://127.0.0.1:{_closed_port()}",
                    access_key_id="a", secret_access_key="b", connect_timeout=1,
                    read_timeout=1, attempts=3)
    for call in (lambda: store.get("k"), lambda: store.put("k", b"x"), lambda: store.children("")):
        t0 = time.monotonic()
        with pytest.raises(StoreTimeout, match=r"did not answer.*gave up after 3 attempts"):
            call()
        assert time.monotonic() - t0 < 5


@pytest.fixture
def silent_server() -> Iterator[str]:
    """An S3 endpoint that accepts connections and never answers."""
    with serve_silently() as addr:
        yield f"http://{addr}"


def test_endpoint_that_never_answers(silent_server: str) -> None:
    store = S3Store("bucket", "p", endpoint_url=silent_server, access_key_id="a",
                    secret_access_key="b", connect_timeout=1, read_timeout=0.5, attempts=2,
                    max_backoff=0.2)
    for call in (lambda: store.get("k"), lambda: store.put("m", b"x", create_only=True),
                 lambda: store.children("")):
        t0 = time.monotonic()
        with pytest.raises(StoreTimeout, match="did not answer in time"):
            call()
        elapsed = time.monotonic() - t0
        # attempts × (an upload first waits 1 s for `100 Continue`, then the read timeout)
        # + backoff, with slack for a loaded machine
        assert elapsed < 2 * (1 + 0.5) + 1.5, elapsed


def test_per_call_timeout_bounds_every_operation(silent_server: str) -> None:
    """A call's `timeout` is a deadline over its attempts and parts, whatever the store's own
    (much longer) per-attempt timeouts and retries are."""
    store = S3Store("bucket", "p", endpoint_url=silent_server, access_key_id="a",
                    secret_access_key="b", connect_timeout=30, read_timeout=30, attempts=4)
    for call in (lambda: store.get("k", timeout=1.0), lambda: store.size("k", timeout=1.0),
                 lambda: store.get_range("k", 0, 9, timeout=1.0),
                 lambda: store.put("m", b"x", create_only=True, timeout=1.0),
                 lambda: store.children("", timeout=1.0), lambda: store.delete("a/b", timeout=1.0)):
        t0 = time.monotonic()
        with pytest.raises(StoreTimeout):
            call()
        assert time.monotonic() - t0 < 1.0 + 3, time.monotonic() - t0
    default = S3Store("bucket", "p", endpoint_url=silent_server, access_key_id="a",
                      secret_access_key="b", connect_timeout=30, read_timeout=30, timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout):
        default.get("k")  # the store's own deadline, when the call gives none
    assert time.monotonic() - t0 < 1.0 + 3


def test_put_fails_midway_through_publish(seaweedfs: Any, s3_prefix: str) -> None:
    s3 = seaweedfs.store(s3_prefix)
    fail = {"after": None}  # fail the Nth chunk put of the next publish, once
    puts = [0]

    def hook(op: str, key: str) -> None:
        if op == "put" and key.endswith(".whc") and fail["after"] is not None:
            puts[0] += 1
            if puts[0] == fail["after"]:
                fail["after"] = None
                raise StoreUnavailable(f"injected: connection reset while writing {key}")

    store = Wrapped(s3, hook)
    pub = Publisher(store, delta_span_bytes=1 * MiB, full_span_bytes=2 * MiB)
    v0, v1, v2 = make_state(2), None, None
    pub.publish(v0)
    target = StateDictTarget({})
    receiver = Receiver(s3, target)
    receiver.sync()
    v1 = step(v0, 1)
    fail["after"] = 3
    with pytest.raises(StoreUnavailable, match="injected"):
        pub.publish(v1)
    assert catalog.list_versions(s3) == [0]  # chunks may be there; no manifest, no version
    assert receiver.sync().version == 0 and same_bits(target.state, v0)
    v2 = step(v1, 2)
    r = pub.publish(v2)  # diffed against the last committed version: covers both steps
    assert (r.version, r.base) == (1, 0)
    assert receiver.sync().version == 1
    assert same_bits(target.state, v2)


def test_server_killed_during_pull(private_seaweedfs: Any) -> None:
    server = private_seaweedfs
    try:
        s3 = server.store("kill", connect_timeout=1, read_timeout=2, attempts=2, max_backoff=0.2)
        pub = Publisher(s3, delta_span_bytes=1 * MiB, full_span_bytes=2 * MiB)
        v0 = make_state(3)
        pub.publish(v0)
        target = StateDictTarget({})
        Receiver(s3, target).sync()
        before = snapshot(target.state)
        v1 = step(v0, 1, frac=0.05)
        assert len(catalog.primary_manifest(s3, pub.publish(v1).version).chunks) > 3

        def hook(op: str, key: str) -> None:
            if op == "get" and key.endswith(".whc") and server.proc.poll() is None:
                server.kill()  # the first chunk request of the pull kills the server

        receiver = Receiver(Wrapped(s3, hook), target)
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match=r"did not answer|dropped the connection"):
            receiver.sync(1)
        assert time.monotonic() - t0 < 15
        assert receiver.version == 0
        assert same_bits(target.state, before)  # nothing applied: bit-identical to v0
    finally:
        server.stop()
    assert not server.dir.exists()


def test_tampered_chunks_are_refused(seaweedfs: Any, s3_prefix: str) -> None:
    store = seaweedfs.store(s3_prefix)
    pub = Publisher(store, delta_span_bytes=1 * MiB, full_span_bytes=2 * MiB)
    v0 = make_state(4)
    pub.publish(v0)
    target = StateDictTarget({})
    receiver = Receiver(store, target)
    receiver.sync()
    pub.publish(step(v0, 1))
    ref = catalog.primary_manifest(store, 1).chunks[1]
    client, name = seaweedfs.client(), f"{s3_prefix}/{ref.key}"
    good = client.get_object(Bucket=seaweedfs.bucket, Key=name)["Body"].read()
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0x01
    for bad in (bytes(flipped), good[:-1]):
        client.put_object(Bucket=seaweedfs.bucket, Key=name, Body=bad)
        with pytest.raises(ChecksumError, match=ref.key):
            receiver.sync(1)
        assert receiver.version == 0 and same_bits(target.state, v0)
    client.delete_object(Bucket=seaweedfs.bucket, Key=name)
    with pytest.raises(ObjectNotFound, match="chunks are missing"):
        receiver.sync(1)
    client.put_object(Bucket=seaweedfs.bucket, Key=name, Body=good)
    assert receiver.sync(1).version == 1
