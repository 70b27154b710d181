"""Node-level staging: receivers on one host fetch each chunk from the store once.

The main test runs three real receiver processes against a real SeaweedFS through a counting
wrapper, each with sources [StagingSource, StoreSource]: every chunk must be fetched from S3
exactly once across the three, and every process must end bit-exact. The rest checks the cache's
rules on local stores: manifests are never cached, the size bound evicts the oldest versions (by
ChunkId.version), a corrupt cached chunk is caught by the list's checksum (refetched and
replaced, or the error when no other source has it), and a stuck lock holder costs a refetch,
not a hang.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from deadlines import PROCESS_S
from safetensors.torch import load_file

from weighthub import catalog, cli
from weighthub.errors import ChecksumError, UsageError
from weighthub.format import chunk_checksum
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.sources import ChunkId, SourceList, StoreSource
from weighthub.sources.staging import StagingSource, default_stage_dir
from weighthub.store import LocalStore, MemoryStore
from weighthub.targets import StateDictTarget

MiB = 1 << 20

# Three receiver processes. A launcher imports weighthub once (torch dominates the start-up
# cost) and forks them before any torch work, so they start together and cheaply; each syncs
# through its own [StagingSource, StoreSource(Counting(S3Store))] and writes what it holds to a
# JSON file, with the number of chunks its store source served.
WORKER = r"""
import json, os, signal, sys, traceback
import xxhash
from weighthub.receive import Receiver
from weighthub.sources import SourceList, StoreSource
from weighthub.sources.staging import StagingSource
from weighthub.store.s3 import S3Store
from weighthub.targets import StateDictTarget
from weighthub.tensors import bits

cfg = json.loads(sys.argv[1])

class Counting:
    def __init__(self, inner):
        self.inner, self.url = inner, inner.url
    def get(self, key, **kw):
        data = self.inner.get(key, **kw)
        if key.endswith(".whc"):
            with open(cfg["log"], "a") as f:  # O_APPEND: one whole line per write
                f.write(f"{os.getpid()} {key}\n")
        return data
    def __getattr__(self, name):
        return getattr(self.inner, name)

def receive(i):
    s3 = S3Store(cfg["bucket"], cfg["prefix"], endpoint_url=cfg["endpoint"],
                 access_key_id=cfg["access_key"], secret_access_key=cfg["secret_key"],
                 connect_timeout=2, read_timeout=10)
    store = Counting(s3)
    fetched = StoreSource(store)
    sources = SourceList([StagingSource(cfg["stage_dir"]), fetched])
    target = StateDictTarget({})
    r = Receiver(store, target, workers=4, sources=sources).sync(cfg["version"])
    h = xxhash.xxh3_128()
    for name in sorted(target.state):
        h.update(bits(target.state[name]).tobytes())
    with open(f"{cfg['out']}.{i}.json", "w") as f:
        json.dump({"pid": os.getpid(), "version": r.version, "root": target.held().root,
                   "bits": h.hexdigest(), "fetched": sources.served[fetched.name]}, f)

pids = []
for i in range(cfg["processes"]):
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            receive(i)
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    pids.append(pid)
failed = [pid for pid in pids if os.waitpid(pid, 0)[1] != 0]
sys.exit(f"receivers {failed} failed" if failed else 0)
"""


def make_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(1024, 1024, generator=g).bfloat16(),
            "b.weight": torch.randn(768, 1024, generator=g).bfloat16()}


def step(state: dict[str, torch.Tensor], seed: int, frac: float = 0.03) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in state.items():
        w = t.clone().view(torch.int16)
        hit = torch.rand(w.shape, generator=g) < frac
        out[n] = torch.where(hit, w + 1, w).view(torch.bfloat16)
    return out


def bits_digest(state: dict[str, torch.Tensor]) -> str:
    h = xxhash.xxh3_128()
    for name in sorted(state):
        h.update(state[name].contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def test_three_processes_fetch_each_chunk_once(seaweedfs: Any, s3_prefix: str,
                                               tmp_path: Path) -> None:
    store = seaweedfs.store(s3_prefix)
    pub = Publisher(store, delta_span_bytes=1 * MiB, full_span_bytes=1 * MiB)
    v0 = make_state(0)
    v1 = step(v0, 1)
    pub.publish(v0)
    pub.publish(v1)
    route = catalog.plan(store, None, 1)
    chunk_keys = sorted(ref.key for rep in route
                        for ref in catalog.read_manifest(store, rep.key).chunks)
    assert len(chunk_keys) >= 6

    log = tmp_path / "fetches.log"
    cfg = {"bucket": seaweedfs.bucket, "prefix": s3_prefix, "endpoint": seaweedfs.endpoint,
           "access_key": seaweedfs.access_key, "secret_key": seaweedfs.secret_key,
           "stage_dir": str(tmp_path / "stage"), "log": str(log), "version": 1}
    cfg["out"], cfg["processes"] = str(tmp_path / "result"), 3
    launcher = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(cfg)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        out, err = launcher.communicate(timeout=PROCESS_S)
    finally:
        if launcher.poll() is None:  # a hang: take the launcher and its receivers down
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=10)
    assert launcher.returncode == 0, (out + err)[-3000:]
    results = [json.loads((tmp_path / f"result.{i}.json").read_text()) for i in range(3)]
    assert len({r["pid"] for r in results}) == 3

    fetched = [line.split()[1] for line in log.read_text().splitlines()]
    assert sorted(fetched) == chunk_keys, "each chunk must come from S3 exactly once"
    assert sum(r["fetched"] for r in results) == len(chunk_keys)
    expected = bits_digest(v1)
    for r in results:
        assert r["version"] == 1 and r["bits"] == expected
        assert r["root"] == catalog.primary_manifest(store, 1).root


class CountingStore:
    def __init__(self, inner) -> None:
        self.inner, self.url, self.gets = inner, inner.url, []

    def get(self, key, **kw):
        self.gets.append(key)
        return self.inner.get(key, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def staged(store, stage: Path, **options: Any) -> SourceList:
    """A receiver's sources on a host with a staging cache: the cache, then the store."""
    return SourceList([StagingSource(stage, **options), StoreSource(store)])


def chunk(v: int, i: int, data: bytes) -> ChunkId:
    key = f"{catalog.version_dir(v)}/full-x/c{i:06d}.whc"
    return ChunkId(v, catalog.rep_key(v, None, primary=True), i, key, len(data), chunk_checksum(data))


def test_manifests_are_never_cached(tmp_path: Path) -> None:
    inner = CountingStore(LocalStore(tmp_path / "store"))
    Publisher(inner).publish(make_state(1))
    target = StateDictTarget({})
    Receiver(inner, target, sources=staged(inner, tmp_path / "stage")).sync()
    first = list(inner.gets)
    assert any(k.endswith(".whc") for k in first)
    inner.gets.clear()
    # a second receiver on the host: manifests from the store again, every chunk from the cache
    Receiver(inner, StateDictTarget({}), sources=staged(inner, tmp_path / "stage")).sync()
    assert inner.gets and all(k.endswith(".json") for k in inner.gets)
    assert not list((tmp_path / "stage").rglob("*.json"))


def test_cache_is_bounded_oldest_versions_go_first(tmp_path: Path) -> None:
    inner = MemoryStore("staging-evict")
    sources = staged(inner, tmp_path / "stage", max_bytes=3 * 1000)
    for v in range(4):
        for i in range(2):
            ref = chunk(v, i, bytes([v]) * 1000 + bytes([i]))
            inner.put(ref.key, bytes([v]) * 1000 + bytes([i]))
            assert sources.fetch(ref) == bytes([v]) * 1000 + bytes([i])
    kept = sorted(p.name for p in (tmp_path / "stage").iterdir() if p.name.isdigit())
    assert kept == ["3"]  # only the newest fits: older versions evicted
    assert sources.served == {sources.sources[1].name: 8}
    # an evicted chunk is simply fetched again
    ref = chunk(0, 0, bytes([0]) * 1000 + bytes([0]))
    assert sources.fetch(ref) == bytes([0]) * 1001
    assert sources.served[sources.sources[1].name] == 9


def test_eviction_orders_versions_by_number_not_by_name(tmp_path: Path) -> None:
    inner = MemoryStore("staging-evict-order")
    sources = staged(inner, tmp_path / "stage", max_bytes=2 * 1000)
    for v in (9, 10):  # '10' < '9' as names: the version, not the name, decides
        ref = chunk(v, 0, bytes([v]) * 1000)
        inner.put(ref.key, bytes([v]) * 1000)
        sources.fetch(ref)
    ref = chunk(11, 0, bytes([11]) * 1000)
    inner.put(ref.key, bytes([11]) * 1000)
    sources.fetch(ref)
    assert sorted(p.name for p in (tmp_path / "stage").iterdir() if p.name.isdigit()) == ["10", "11"]


def test_corrupt_cached_chunk_is_caught_by_the_checksum(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    inner = LocalStore(tmp_path / "store")
    state = make_state(2)
    Publisher(inner).publish(state)
    stage = tmp_path / "stage"
    Receiver(inner, StateDictTarget({}), sources=staged(inner, stage)).sync()
    cached = next(stage.rglob("*.whc"))
    good = cached.read_bytes()
    data = bytearray(good)
    data[len(data) // 2] ^= 0xFF
    cached.write_bytes(bytes(data))
    # alone, the cache cannot hand over a good copy: the receiver refuses it, nothing applied
    target = StateDictTarget({})
    with pytest.raises(ChecksumError, match="corrupt"):
        Receiver(inner, target, sources=SourceList([StagingSource(stage)])).sync()
    assert target.state == {} and target.held() is None
    # with the store behind it: the bad copy is refused, refetched, and the cache repaired
    target = StateDictTarget({})
    with caplog.at_level("WARNING", logger="weighthub"):
        Receiver(inner, target, sources=staged(inner, stage)).sync()
    assert "corrupt" in caplog.text and f"staging {stage}" in caplog.text
    assert bits_digest(target.state) == bits_digest(state)
    assert cached.read_bytes() == good


def test_stuck_lock_holder_costs_a_refetch_not_a_hang(tmp_path: Path) -> None:
    inner = MemoryStore("staging-lock")
    ref = chunk(1, 0, b"chunk")
    inner.put(ref.key, b"chunk")
    sources = staged(inner, tmp_path / "stage", lock_timeout=0.3)
    fd = os.open(tmp_path / "stage" / ".locks" / ref.checksum, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another "process" is fetching it and never finishes
        t0 = time.monotonic()
        assert sources.fetch(ref) == b"chunk"
        assert 0.25 < time.monotonic() - t0 < 5
        assert not (tmp_path / "stage" / "1").exists()  # not written without the lock
    finally:
        os.close(fd)
    assert sources.fetch(ref) == b"chunk"
    assert (tmp_path / "stage" / "1" / f"{ref.checksum}.whc").read_bytes() == b"chunk"
    assert sources.served == {sources.sources[1].name: 2}
    assert sources.fetch(ref) == b"chunk"  # now from the cache
    assert sources.served[sources.sources[0].name] == 1


def test_a_waiter_reads_what_the_lock_holder_fetched(tmp_path: Path) -> None:
    """The first to miss fetches; another that misses meanwhile waits, then reads the file."""
    inner = MemoryStore("staging-wait")
    ref = chunk(1, 0, b"chunk")
    inner.put(ref.key, b"chunk")
    first = StagingSource(tmp_path / "stage")
    second = staged(inner, tmp_path / "stage")
    with first.claim(ref, timeout=5) as cached:  # this "process" missed and is fetching
        assert cached is None
        got: list[bytes] = []
        waiter = threading.Thread(target=lambda: got.append(second.fetch(ref, timeout=5)))
        waiter.start()
        time.sleep(0.3)
        assert waiter.is_alive() and not got  # blocked on the lock, not fetching for itself
        first.keep(ref, b"chunk")
    waiter.join(5)
    assert got == [b"chunk"] and second.served == {second.sources[0].name: 1}


def test_a_chunk_id_with_a_bad_checksum_names_no_file(tmp_path: Path) -> None:
    source = StagingSource(tmp_path / "stage")
    bad = ChunkId(1, "v000000000001/manifest.json", 0, "v000000000001/x/c0.whc", 5, "../../etc")
    with pytest.raises(UsageError, match="cannot name a staging file"):
        source.get_chunk(bad, timeout=1)


def test_cli_pull_with_a_stage_dir_reads_chunks_from_the_host_cache(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    state = make_state(3)
    Publisher(store).publish(state)
    stage = tmp_path / "stage"
    pull = ["pull", str(tmp_path / "store"), "--stage-dir", str(stage), "--json"]
    assert cli.main([*pull[:2], str(tmp_path / "a.safetensors"), *pull[2:]]) == cli.EXIT_OK
    keys = [c.key for c in catalog.primary_manifest(store, 0).chunks]
    assert len(list(stage.rglob("*.whc"))) == len(keys)
    for key in keys:  # the store keeps its manifests only: chunks can now come from the cache alone
        (tmp_path / "store" / key).unlink()
    assert cli.main([*pull[:2], str(tmp_path / "b.safetensors"), *pull[2:]]) == cli.EXIT_OK
    assert bits_digest(load_file(tmp_path / "b.safetensors")) == bits_digest(state)


def test_default_stage_dir_is_per_store() -> None:
    a, b = default_stage_dir("s3://bucket/a"), default_stage_dir("s3://bucket/b")
    assert a != b and a.name.startswith("weighthub-")
    assert a == default_stage_dir("s3://bucket/a")
