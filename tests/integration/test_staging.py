"""Node-level staging: receivers on one host fetch each chunk from the store once.

The main test runs three real receiver processes against a real SeaweedFS through a counting
wrapper: every chunk must be fetched from S3 exactly once across the three, and every process
must end bit-exact. The rest checks the cache's rules on local stores: manifests are never
cached, the size bound evicts the oldest versions, a corrupt cached chunk is caught by the
receiver's checksum, and a stuck lock holder costs a refetch, not a hang.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from deadlines import PROCESS_S

from weighthub import catalog
from weighthub.errors import ChecksumError
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import LocalStore, MemoryStore
from weighthub.store.staging import StagingStore, default_stage_dir
from weighthub.targets import StateDictTarget

MiB = 1 << 20

# Three receiver processes. A launcher imports weighthub once (torch dominates the start-up
# cost) and forks them before any torch work, so they start together and cheaply; each syncs
# through its own StagingStore(Counting(S3Store)) and writes what it holds to a JSON file.
WORKER = r"""
import json, os, signal, sys, traceback
import xxhash
from weighthub.receive import Receiver
from weighthub.store.s3 import S3Store
from weighthub.store.staging import StagingStore
from weighthub.targets import StateDictTarget
from weighthub.tensors import bits

cfg = json.loads(sys.argv[1])

class Counting:
    def __init__(self, inner):
        self.inner, self.url = inner, inner.url
    def get(self, key):
        data = self.inner.get(key)
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
    store = StagingStore(Counting(s3), cfg["stage_dir"])
    target = StateDictTarget({})
    r = Receiver(store, target, workers=4).sync(cfg["version"])
    h = xxhash.xxh3_128()
    for name in sorted(target.state):
        h.update(bits(target.state[name]).tobytes())
    with open(f"{cfg['out']}.{i}.json", "w") as f:
        json.dump({"pid": os.getpid(), "version": r.version, "root": target.held().root,
                   "bits": h.hexdigest(), "fetched": store.fetched}, f)

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

    def get(self, key):
        self.gets.append(key)
        return self.inner.get(key)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_manifests_are_never_cached(tmp_path: Path) -> None:
    inner = CountingStore(LocalStore(tmp_path / "store"))
    staged = StagingStore(inner, tmp_path / "stage")
    Publisher(inner).publish(make_state(1))
    target = StateDictTarget({})
    Receiver(staged, target).sync()
    first = list(inner.gets)
    assert any(k.endswith(".whc") for k in first)
    inner.gets.clear()
    Receiver(staged, StateDictTarget({})).sync()  # a second receiver on the host
    assert inner.gets and all(k.endswith(".json") for k in inner.gets)  # manifests again
    assert not list((tmp_path / "stage").rglob("*.json"))
    assert staged.url == inner.url


def test_cache_is_bounded_oldest_versions_go_first(tmp_path: Path) -> None:
    inner = MemoryStore("staging-evict")
    staged = StagingStore(inner, tmp_path / "stage", max_bytes=3 * 1000)
    for v in range(4):
        for i in range(2):
            key = f"{catalog.version_dir(v)}/full-x/c{i:06d}.whc"
            inner.put(key, bytes([v]) * 1000)
            assert staged.get(key) == bytes([v]) * 1000
    kept = sorted(p.name for p in (tmp_path / "stage").iterdir() if p.name.startswith("v"))
    assert kept == [catalog.version_dir(3)]  # only the newest fits: older versions evicted
    # an evicted chunk is simply fetched again
    assert staged.get(f"{catalog.version_dir(0)}/full-x/c000000.whc") == bytes([0]) * 1000


def test_corrupt_cached_chunk_is_caught_by_the_receiver(tmp_path: Path) -> None:
    inner = LocalStore(tmp_path / "store")
    Publisher(inner).publish(make_state(2))
    stage = tmp_path / "stage"
    Receiver(StagingStore(inner, stage), StateDictTarget({})).sync()
    cached = next(stage.rglob("*.whc"))
    data = bytearray(cached.read_bytes())
    data[len(data) // 2] ^= 0xFF
    cached.write_bytes(bytes(data))
    target = StateDictTarget({})
    with pytest.raises(ChecksumError, match="corrupt"):
        Receiver(StagingStore(inner, stage), target).sync()
    assert target.state == {} and target.held() is None


def test_stuck_lock_holder_costs_a_refetch_not_a_hang(tmp_path: Path) -> None:
    inner = MemoryStore("staging-lock")
    inner.put("v1/x/c0.whc", b"chunk")
    staged = StagingStore(inner, tmp_path / "stage", lock_timeout=0.3)
    name = hashlib.sha256(b"v1/x/c0.whc").hexdigest()[:32]
    fd = os.open(tmp_path / "stage" / ".locks" / name, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another "process" is fetching it and never finishes
        t0 = time.monotonic()
        assert staged.get("v1/x/c0.whc") == b"chunk"
        assert 0.25 < time.monotonic() - t0 < 5
        assert not (tmp_path / "stage" / "v1").exists()  # not written without the lock
    finally:
        os.close(fd)
    assert staged.get("v1/x/c0.whc") == b"chunk"
    assert (tmp_path / "stage" / "v1" / "x" / "c0.whc").read_bytes() == b"chunk"


def test_default_stage_dir_is_per_store() -> None:
    a, b = default_stage_dir("s3://bucket/a"), default_stage_dir("s3://bucket/b")
    assert a != b and a.name.startswith("weighthub-")
    assert a == default_stage_dir("s3://bucket/a")
