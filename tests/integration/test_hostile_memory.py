"""A pull facing a hostile store keeps its memory bounded by what the manifests allow (issue #17,
item 1: "peak memory of a pull facing any hostile store stays below largest legitimate chunk ×
workers + a stated constant, measured in a test with a memory cap").

The hostile store: every chunk of version 1 is a decompression bomb (a valid frame declaring 1
GiB, its manifest entry rewritten to match) or an object far larger than its manifest entry (a
sparse 2 GiB file), and version 2's manifest is a sparse 2 GiB file. `weighthub pull` (its
`main`, for v1 and then the latest) runs in a child process whose address space is capped at
what it had + the bound + HEADROOM (a runaway allocation fails there instead of eating the
machine) and whose resident-memory growth during the pull is measured (sampled, and the kernel's
high-water mark). The pull must fail with a weighthub error (exit 2 or 3, one line), the target
must be bit-identical, and the growth must stay below BOUND = workers × the largest legitimate
chunk (its frame plus the body its coverage admits, `chunk_body_bound`) + CONSTANT.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from weighthub import catalog
from weighthub.cli import main as cli
from weighthub.codec import Op, Positions, Segment, Values
from weighthub.format import chunk_checksum, encode_chunk, encode_manifest
from weighthub.publish import Publisher
from weighthub.receive.stage import chunk_body_bound
from weighthub.store import LocalStore
from weighthub.tensors import bits, dtype_named

MiB = 1 << 20
WORKERS = 4  # `weighthub pull`'s fetch workers (Receiver's default)
CONSTANT = 64 * MiB  # interpreter, threads, error paths: what a pull costs beyond its chunks
HEADROOM = 512 * MiB  # address space (not memory) thread stacks and malloc arenas reserve
BOMB = 1 << 30
HUGE = 2 << 30

_CHILD = """
import gc, json, os, resource, sys, threading, time
import weighthub.cli, weighthub.receive, weighthub.format.chunk, weighthub.codec.kernels
import weighthub.targets.safetensors_file, weighthub.sources.staging
def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) << 10 for l in f if l.startswith(field + ":"))
cap, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
gc.collect()
resource.setrlimit(resource.RLIMIT_AS, (status("VmSize") + cap,) * 2)
for version in sys.argv[4:]:
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the kernel's resident high-water mark (VmHWM) to now
    start = status("VmRSS")
    peak, done = [start], threading.Event()
    def sample(peak, done):  # a second opinion on the high-water mark
        while not done.is_set():
            peak[0] = max(peak[0], status("VmRSS"))
            time.sleep(0.002)
    threading.Thread(target=sample, args=(peak, done), daemon=True).start()
    argv = ["pull", store, out] + (["--version", version] if version != "latest" else [])
    try:
        rc = weighthub.cli.main(argv)
    except SystemExit as exc:
        rc = exc.code
    except BaseException as exc:
        rc = repr(exc)
    done.set()
    print(json.dumps({"version": version, "rc": rc,
                      "growth": max(peak[0], status("VmHWM")) - start}), flush=True)
    print("--", file=sys.stderr, flush=True)  # one block of error lines per pull
"""


def make_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"layers.{i}.weight": torch.randn(512, 512, generator=g).to(torch.bfloat16)
            for i in range(4)}  # 2 MiB dense


def step(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {n: t.clone() for n, t in state.items()}
    for t in out.values():
        b = bits(t)
        b[::7] ^= b.dtype.type(1)
    return out


def bomb_frame() -> bytes:
    n = BOMB // 2
    return encode_chunk([Segment(0, 0, n, Op.DENSE, Positions.ALL, Values.RAW, n,
                                 np.zeros(0, np.uint8), np.zeros(BOMB, np.uint8))])


def sparse(path: Path, size: int) -> None:
    with open(path, "r+b" if path.exists() else "wb") as f:
        f.truncate(size)


def digest_tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def largest_legitimate_chunk(store: LocalStore) -> int:
    """Frame + admitted body of the biggest chunk any representation of v1 names."""
    most = 0
    for name in store.children(catalog.version_dir(1)):
        if name.endswith(".json"):
            m = catalog.read_manifest(store, f"{catalog.version_dir(1)}/{name}")
            widths = [dtype_named(t.dtype).width for t in m.tensors]
            most = max([most] + [c.size + chunk_body_bound(c, m, widths) for c in m.chunks])
    return most


def make_hostile(store: LocalStore, bomb: bytes) -> None:
    """Every chunk of every representation of v1: a bomb (even) or oversized (odd); v2: a
    manifest.json of 2 GiB."""
    for name in store.children(catalog.version_dir(1)):
        if not name.endswith(".json"):
            continue
        key = f"{catalog.version_dir(1)}/{name}"
        m = catalog.read_manifest(store, key)
        chunks = list(m.chunks)
        for i, ref in enumerate(m.chunks):
            if i % 2 == 0:
                store.put(ref.key, bomb)
                chunks[i] = msgspec.structs.replace(ref, size=len(bomb),
                                                    checksum=chunk_checksum(bomb))
            else:
                sparse(store.root / ref.key, HUGE)
        store.put(key, encode_manifest(msgspec.structs.replace(m, chunks=chunks)))
    path = store.root / catalog.rep_key(2, None, primary=True)
    path.parent.mkdir(parents=True)
    sparse(path, HUGE)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> tuple[LocalStore, Path, int]:
    root = tmp_path_factory.mktemp("hostile")
    store = LocalStore(root / "store")
    pub = Publisher(store, delta_span_bytes=256 << 10, full_span_bytes=256 << 10)
    state = make_state()
    pub.publish(state)
    pub.publish(step(state))
    bound = WORKERS * largest_legitimate_chunk(store) + CONSTANT
    out = root / "out"
    out.mkdir()
    assert cli(["pull", str(store.root), str(out / "model.safetensors"), "--version", "0"]) == 0
    make_hostile(store, bomb_frame())
    return store, out, bound


@pytest.mark.slow
def test_pull_from_hostile_store_is_memory_bounded(hostile: tuple[LocalStore, Path, int]) -> None:
    """v1 (every chunk hostile), then the latest (a manifest of 2 GiB), in one child."""
    store, out, bound = hostile
    before = digest_tree(out)
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OPENBLAS_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(bound + HEADROOM), str(store.root),
                           str(out / "model.safetensors"), "1", "latest"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    errors = proc.stderr.split("--\n")[:-1]
    assert [r["version"] for r in results] == ["1", "latest"] and len(errors) == 2, proc.stderr
    for r, err in zip(results, errors, strict=True):
        print(f"\npull {r['version']}: peak growth {r['growth'] / MiB:.1f} MiB, bound "
              f"{bound / MiB:.1f} MiB; {err.strip()[:160]}")
        assert r["rc"] in (2, 3), (r, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert "LimitError" in err, err
        assert r["growth"] < bound, r
    assert digest_tree(out) == before
