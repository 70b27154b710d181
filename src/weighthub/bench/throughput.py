"""Encode and decode+apply throughput of the segment codec, next to memcpy and XOR ceilings.

GB/s here is always dense parameter bytes (old model size) per second, 1e9 bytes. Each tensor is
one segment (what the publisher does for tensors up to its 32 MiB span). One thread runs every
tensor in turn; two threads each run one half of the tensors (balanced by bytes) in a pool: the
numba kernels and numpy's copy/XOR release the GIL. Every figure is the best of `reps` repeats,
with the median and worst kept as the spread (the machine is shared and noisy).

Ceilings, on the same buffers: memcpy = np.copyto(new → preallocated buffer); XOR =
np.bitwise_xor(old, new, out=preallocated). Scan = change detection alone
(codec.changed_positions), the part of encoding that reads every word.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..codec import EncodePolicy, Segment, UndoLog, apply_segment, changed_positions, encode_segment
from ..tensors import DType


@dataclass(frozen=True, slots=True)
class Pair:
    """One tensor's old and new bits."""

    old: np.ndarray
    new: np.ndarray
    dtype: DType


def _halves(pairs: Sequence[Pair]) -> list[list[int]]:
    """Indices of the pairs split into two groups of about equal bytes (largest first)."""
    groups: list[list[int]] = [[], []]
    load = [0, 0]
    for i in sorted(range(len(pairs)), key=lambda i: -pairs[i].new.nbytes):
        g = 0 if load[0] <= load[1] else 1
        groups[g].append(i)
        load[g] += pairs[i].new.nbytes
    return groups


def _timed(work: Callable[[int], object], n: int, threads: int, groups: list[list[int]],
           pool: ThreadPoolExecutor | None) -> float:
    """Seconds to run work(i) for every i < n, on one thread or on two halves."""
    t0 = time.perf_counter()
    if threads == 1 or pool is None:
        for i in range(n):
            work(i)
    else:
        def half(g: list[int]) -> None:
            for i in g:
                work(i)

        for f in [pool.submit(half, g) for g in groups]:
            f.result()
    return time.perf_counter() - t0


def _spread(nbytes: int, seconds: list[float]) -> dict[str, float]:
    rates = sorted(nbytes / s / 1e9 for s in seconds)
    return {"best": rates[-1], "median": statistics.median(rates), "worst": rates[0]}


def measure(pairs: Sequence[Pair], policies: dict[str, EncodePolicy], *, reps: int = 3,
            threads: Sequence[int] = (1, 2)) -> dict[str, dict[str, dict[str, float]]]:
    """Throughput of encode and decode+apply per policy, and the ceilings.

    Args:
        pairs: the tensors of one step.
        policies: name → encode policy (e.g. weighthub, weighthub_fast).
        reps: repeats per figure; the best is reported with the spread.
        threads: thread counts to measure.
    Returns:
        {name: {"encode_<t>t": spread, "apply_<t>t": spread}, "memcpy": {...}, "xor": {...},
        "scan": {...}}, spreads as {"best", "median", "worst"} GB/s.
    Raises:
        RuntimeError: decode+apply did not reproduce the new bits exactly.
    """
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    n = len(pairs)
    nbytes = sum(p.new.nbytes for p in pairs)
    groups = _halves(pairs)
    out: dict[str, dict[str, dict[str, float]]] = {}
    scratch = [np.empty_like(p.new) for p in pairs]
    if pairs:  # numba loads its cached kernels on the first call: keep that out of the timing
        changed_positions(pairs[0].old[:64], pairs[0].new[:64])
    try:
        with ThreadPoolExecutor(2) as pool:
            def run(key: str, work: Callable[[int], object], t: int,
                    reset: Callable[[], None] | None = None) -> dict[str, float]:
                secs = []
                for _ in range(reps):
                    if reset is not None:
                        reset()
                    secs.append(_timed(work, n, t, groups, pool))
                return _spread(nbytes, secs)

            for t in threads:
                out.setdefault("memcpy", {})[f"{t}t"] = run(
                    "memcpy", lambda i: np.copyto(scratch[i], pairs[i].new), t)
                out.setdefault("xor", {})[f"{t}t"] = run(
                    "xor", lambda i: np.bitwise_xor(pairs[i].old, pairs[i].new, out=scratch[i]), t)
                out.setdefault("scan", {})[f"{t}t"] = run(
                    "scan", lambda i: changed_positions(pairs[i].old, pairs[i].new), t)
            for name, policy in policies.items():
                out[name] = _measure_policy(pairs, policy, run, threads, scratch)
    finally:
        torch.set_num_threads(prev_threads)
    return out


def _measure_policy(pairs: Sequence[Pair], policy: EncodePolicy, run: Callable[..., dict[str, float]],
                    threads: Sequence[int], scratch: list[np.ndarray]) -> dict[str, dict[str, float]]:
    segs: list[Segment | None] = [None] * len(pairs)

    def encode(i: int) -> None:
        p = pairs[i]
        segs[i] = encode_segment(p.old, p.new, p.dtype, tensor=i, start=0, policy=policy)

    def apply(i: int) -> None:
        seg = segs[i]
        if seg is not None:
            apply_segment(seg, scratch[i], pairs[i].dtype, UndoLog(), f"bench tensor {i}")

    def reset() -> None:
        for dst, p in zip(scratch, pairs, strict=True):
            np.copyto(dst, p.old)

    for i in range(len(pairs)):  # warm-up: numba loads (or compiles) every kernel once
        encode(i)
    reset()
    for i in range(len(pairs)):
        apply(i)
    res: dict[str, dict[str, float]] = {}
    for t in threads:
        res[f"encode_{t}t"] = run("encode", encode, t)
        res[f"apply_{t}t"] = run("apply", apply, t, reset)
    bad = [i for i, (dst, p) in enumerate(zip(scratch, pairs, strict=True))
           if not np.array_equal(dst, p.new)]
    if bad:
        raise RuntimeError(f"decode+apply is not bit-exact on {len(bad)} tensor(s), first {bad[0]}")
    return res
