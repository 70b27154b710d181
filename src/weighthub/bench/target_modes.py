"""What a safetensors target's update modes cost: in-place (journaled) vs atomic (copy+rename).

    python -m weighthub.bench.target_modes [--mb 256] [--changed 0.01] [--reps 3] [--dir D]

Publishes a synthetic bf16 checkpoint of about MB megabytes (version 0) and a delta changing
`changed` of its words (version 1) to a local store, materializes version 0 into one file per
mode, then times pulls 0 → 1 → 0 (a forward delta, then the same delta undone) in each mode,
`reps` times, and prints one JSON document: per mode the best and median pause (apply +
verify + commit: in-place journals the old words of each step, writes in place and fsyncs;
atomic copies the file, writes the copy, fsyncs and renames it over the file) and whole-sync
seconds. Measured, never asserted. Files live under --dir (default: a temporary directory,
removed afterwards), so point it at the disk that matters.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..publish import Publisher
from ..receive import Receiver
from ..store import LocalStore
from ..targets.safetensors_file import MODES, SafetensorsTarget

_COLS = 4096  # bf16 matrices of 4096 columns: 8 MiB per 1024 rows


def synthetic(mb: int, changed: float, seed: int = 0) -> tuple[dict[str, torch.Tensor],
                                                                  dict[str, torch.Tensor]]:
    """Two states of about `mb` MB: random bf16 matrices, and a copy with `changed` of their
    words moved by one ulp (the size of an RL step's change)."""
    g = torch.Generator().manual_seed(seed)
    rows = max(1, mb * (1 << 20) // (2 * _COLS) // 8)
    a = {f"layers.{i}.weight": torch.randn(rows, _COLS, generator=g).bfloat16() for i in range(8)}
    rng = np.random.default_rng(seed)
    b = {}
    for name, t in a.items():
        t = t.clone()
        words = t.view(torch.int16).numpy().reshape(-1)
        idx = rng.choice(words.size, max(1, int(changed * words.size)), replace=False)
        words[idx] += np.int16(1)
        b[name] = t
    return a, b


def measure(root: Path, mb: int, changed: float, reps: int) -> dict[str, Any]:
    store = LocalStore(root / "store")
    v0, v1 = synthetic(mb, changed)
    pub = Publisher(store)
    pub.publish(v0)
    pub.publish(v1)
    out: dict[str, Any] = {"mb": mb, "changed": changed, "reps": reps, "modes": {}}
    for mode in MODES:
        path = root / f"{mode}.safetensors"
        rx = Receiver(store, SafetensorsTarget(path, mode=mode))
        rx.sync(0)
        pauses, totals = [], []
        for _ in range(reps):
            for v in (1, 0):
                r = rx.sync(v)
                pauses.append(r.pause_seconds)
                totals.append(r.seconds)
        size = path.stat().st_size
        out["modes"][mode] = {
            "file_bytes": size,
            "pause_best_s": min(pauses), "pause_median_s": statistics.median(pauses),
            "sync_best_s": min(totals), "sync_median_s": statistics.median(totals),
        }
        path.unlink()
    inplace, atomic = out["modes"]["in-place"], out["modes"]["atomic"]
    out["atomic_over_in_place_pause"] = atomic["pause_median_s"] / max(inplace["pause_median_s"], 1e-9)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m weighthub.bench.target_modes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256, help="checkpoint size in MB (default 256)")
    ap.add_argument("--changed", type=float, default=0.01, help="fraction of words changed")
    ap.add_argument("--reps", type=int, default=3, help="round trips per mode (default 3)")
    ap.add_argument("--dir", default=None, help="where the store and files go (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.mb < 1 or not 0 < args.changed <= 1 or args.reps < 1:
        ap.error("--mb and --reps must be ≥ 1, --changed in (0, 1]")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="weighthub-target-modes-") as d:
        doc = measure(Path(d), args.mb, args.changed, args.reps)
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
