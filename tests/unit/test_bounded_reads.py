"""Hostile stores cost bounded memory and time: every read takes the size the manifest (or a
limit) gives it and refuses more before allocating it (issue #17, items 1 and 2).

A hostile store here controls its manifests too: a tampered chunk comes with a manifest entry
whose size and checksum match it, so only the bounds derived from the manifest's coverage and
the format's limits stand between it and the receiver's memory. After every refusal the target
holds exactly its previous bits (compared through integer views).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from weighthub import catalog
from weighthub.codec import Op, Positions, Segment, Values
from weighthub.errors import LimitError, StoreRefused
from weighthub.format import chunk_checksum, decode_manifest, encode_chunk, encode_manifest
from weighthub.format.manifest import MAX_MANIFEST_BYTES
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import LocalStore, MemoryStore, Store
from weighthub.targets import StateDictTarget
from weighthub.tensors import bits

MiB = 1 << 20
BOMB_BYTES = 128 * MiB  # what the bomb frame declares (and, unbounded, allocates)
PEAK_BOUND = 16 * MiB  # traced Python allocations a refused pull of this tiny model may make


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(128, 64, generator=g).to(torch.bfloat16),  # 8192 words
            "b": torch.randn(2048, generator=g)}


def moved(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {n: t.clone() for n, t in state.items()}
    for t in out.values():
        b = bits(t)
        b[::50] ^= b.dtype.type(1)
    return out


def snapshot(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {n: bits(t).copy() for n, t in state.items()}


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """A valid frame (checksum and all) of a dense segment declaring BOMB_BYTES: ~50 KB."""
    n = BOMB_BYTES // 2
    seg = Segment(0, 0, n, Op.DENSE, Positions.ALL, Values.RAW, n, np.zeros(0, np.uint8),
                  np.zeros(BOMB_BYTES, np.uint8))
    return encode_chunk([seg])


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    yield LocalStore(tmp_path / "store") if request.param == "local" \
        else MemoryStore(f"bounded-{request.node.name}")


def publish(store: Store, n: int) -> list[dict[str, torch.Tensor]]:
    pub = Publisher(store, delta_span_bytes=4096, full_span_bytes=4096)
    states = [make_state()]
    pub.publish(states[0])
    for _ in range(1, n):
        states.append(moved(states[-1]))
        pub.publish(states[-1])
    return states


def forge(store: Store, manifest_key: str, index: int, frame: bytes) -> str:
    """Put `frame` in place of chunk `index` and make the manifest vouch for it (a hostile
    store rewrites both). Returns the chunk's key."""
    m = decode_manifest(store.get(manifest_key), where=manifest_key)
    ref = m.chunks[index]
    store.put(ref.key, frame)
    chunks = list(m.chunks)
    chunks[index] = msgspec.structs.replace(ref, size=len(frame), checksum=chunk_checksum(frame))
    store.put(manifest_key, encode_manifest(msgspec.structs.replace(m, chunks=chunks)))
    return ref.key


def traced_peak(call: Callable[[], object]) -> tuple[int, BaseException | None]:
    """Peak of traced allocations while `call` runs, and what it raised."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        call()
        caught = None
    except Exception as exc:  # the test inspects it
        caught = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, caught


# -- item 1: decompression capped by the chunk's coverage ------------------------------------------
@pytest.mark.parametrize("rep", ["full", "delta"])
def test_decompression_bomb_refused_before_allocating(store: Store, bomb: bytes, rep: str) -> None:
    """A frame declaring 128 MiB for a chunk covering 4 KiB: refused before decompressing."""
    publish(store, 2)
    target = StateDictTarget({})
    rx = Receiver(store, target, workers=2)
    if rep == "delta":  # the held v0 takes v1's primary, a delta; a fresh target v0's full
        rx.sync(0)
    want = 1 if rep == "delta" else 0
    before = snapshot(target.state)
    key = forge(store, catalog.rep_key(want, None, primary=True), 0, bomb)
    peak, caught = traced_peak(lambda: rx.sync(want))
    assert isinstance(caught, LimitError), caught
    assert key in str(caught) and f"body of {BOMB_BYTES} bytes exceeds" in str(caught)
    assert peak < PEAK_BOUND, f"{peak} bytes allocated for a refused bomb"
    assert same(snapshot(target.state), before)


# -- item 1: objects larger than their manifest entry or limit are refused unread ---------------
def test_oversized_chunk_object_refused_unread(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    publish(store, 1)
    m = catalog.primary_manifest(store, 0)
    path = store.root / m.chunks[0].key
    with open(path, "r+b") as f:  # a sparse 1 GiB file: the store returns "many GB"
        f.truncate(1 << 30)
    target = StateDictTarget({})
    peak, caught = traced_peak(lambda: Receiver(store, target, workers=4).sync())
    assert isinstance(caught, LimitError), caught
    assert m.chunks[0].key in str(caught) and f"{1 << 30} bytes" in str(caught)
    assert peak < PEAK_BOUND
    assert target.state == {}


def test_oversized_manifest_refused_unread(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    publish(store, 1)
    with open(store.root / catalog.rep_key(0, None, primary=True), "r+b") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)
    peak, caught = traced_peak(lambda: Receiver(store, StateDictTarget({})).sync())
    assert isinstance(caught, LimitError), caught
    assert "manifest.json" in str(caught)
    assert peak < PEAK_BOUND


# -- item 2: non-regular files in a local store ---------------------------------------------------
@pytest.fixture(params=["fifo", "zero", "null"])
def planted(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[Path], None]:
    def plant(path: Path) -> None:
        path.unlink(missing_ok=True)
        if request.param == "fifo":
            os.mkfifo(path)
        else:
            path.symlink_to(f"/dev/{request.param}")
    return plant


def test_local_store_refuses_non_regular_objects(tmp_path: Path,
                                                 planted: Callable[[Path], None]) -> None:
    store = LocalStore(tmp_path / "store")
    store.put("v/x", b"1")
    planted(store.root / "v/x")
    for call in (lambda: store.size("v/x"), lambda: store.get("v/x"),
                 lambda: store.get_range("v/x", 0, 10), lambda: store.get("v/x", max_bytes=10)):
        with pytest.raises(StoreRefused, match="not a regular file"):
            call()


def test_non_regular_manifest_or_chunk_refused_fast(tmp_path: Path,
                                                    planted: Callable[[Path], None]) -> None:
    """A pull facing a FIFO or a device for a manifest or a chunk ends in StoreRefused (a FIFO
    would block forever, /dev/zero grow memory until killed); the target is untouched."""
    store = LocalStore(tmp_path / "store")
    publish(store, 1)
    m = catalog.primary_manifest(store, 0)
    for key in (m.chunks[-1].key, catalog.rep_key(0, None, primary=True)):
        planted(store.root / key)
        target = StateDictTarget({})
        with pytest.raises(StoreRefused, match="not a regular file"):
            Receiver(store, target).sync()
        assert target.state == {}


# -- item 2: the host staging cache (a directory other users may write: /dev/shm) -----------------
_STAGING_CHILD = """
import hashlib, os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # /dev/zero read whole: MemoryError
from weighthub.sources import ChunkId, SourceList, StoreSource
from weighthub.sources.staging import StagingSource
from weighthub.store import MemoryStore
kind, stage_dir = sys.argv[1], sys.argv[2]
data = os.urandom(4096)
store = MemoryStore("s")
store.put("v1/c0.whc", data)
ref = ChunkId(1, "v000000000001/manifest.json", 0, "v1/c0.whc", len(data),
              hashlib.sha256(data).hexdigest())
staging = StagingSource(stage_dir)
path = staging._path(ref)
path.parent.mkdir(parents=True)
if kind == "fifo":
    os.mkfifo(path)
elif kind == "big":
    path.write_bytes(b"x" * 8192)
else:
    path.symlink_to("/dev/" + kind)
assert SourceList([staging, StoreSource(store)]).fetch(ref, timeout=10.0) == data
assert not path.is_symlink() and path.read_bytes() == data  # replaced by the verified copy
print("fetched")
"""


@pytest.mark.parametrize("kind", ["fifo", "zero", "big"])
def test_staging_cache_entry_that_is_not_the_chunk_is_a_miss(tmp_path: Path, kind: str) -> None:
    """A FIFO (blocks a reader forever), /dev/zero (endless) or an oversized file planted
    where the staging cache keeps a chunk: a miss, the chunk comes from the store and replaces
    it. In a child process: the unbounded read it guards against hangs or eats memory."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _STAGING_CHILD, kind, str(tmp_path / "stage")],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0 and "fetched" in proc.stdout, proc.stderr[-2000:]
