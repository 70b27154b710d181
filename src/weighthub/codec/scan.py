"""The change scan: every changed element of a range with its old and new words (spec §2's
positions, before any coding). It reads every word of both states, so it is the part of an
encode that a device backend replaces (codec/device.py); what it finds is small. Where the
changes will be context-coded, `scan_ranked` also ranks them in the same pass (codec/ranks.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..digest.linear import as_words
from ..errors import UsageError
from ..tensors import DType, readonly
from . import kernels as K
from . import ranks as R

# Ranges this short are scanned element by element: 3.7 µs at 4096 bf16 elements, against 5.7
# for the block scan with its set-up (its outputs sized for a chunk).
_ELEMENTWISE_SCAN = 4096


@dataclass(frozen=True, slots=True)
class Changes:
    """Changed positions of a range with their old and new words, in increasing position order."""

    pos: np.ndarray  # int64
    old: np.ndarray  # dtype of the bit arrays
    new: np.ndarray


def _words(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if old.shape != new.shape or old.dtype != new.dtype or old.ndim != 1:
        raise UsageError(f"changed_positions: {old.dtype}{old.shape} vs {new.dtype}{new.shape}")
    return readonly(as_words(old)), readonly(as_words(new))  # one type per word width


def scan_range(old: np.ndarray, new: np.ndarray, limit: int) -> Changes | None:
    """Every changed element of two equal-length bit arrays, or None if more than `limit`."""
    old, new = _words(old, new)
    n = old.shape[0]
    if n <= _ELEMENTWISE_SCAN:  # norms, biases: the set-up of the block scan costs more
        pos, ov, nv = np.empty(n, np.int64), np.empty(n, old.dtype), np.empty(n, old.dtype)
        k = K.scan_tail(old, new, 0, n, pos, ov, nv, 0)
        return None if k > limit else Changes(pos[:k], ov[:k], nv[:k])
    full = n - n % K.BLOCK
    slack = K.SCAN_CHUNK * K.BLOCK + K.BLOCK
    cap = n // 32 + slack  # ~3% changed fits without growing
    pos, ov, nv = np.empty(cap, np.int64), np.empty(cap, old.dtype), np.empty(cap, old.dtype)
    where, masks = np.empty(K.SCAN_CHUNK, np.uint64), np.empty(K.SCAN_CHUNK, np.uint64)
    k = w = 0
    while True:
        k, w = K.scan_blocks(old, new, w, k, pos, ov, nv, where, masks)
        if k > limit:
            return None
        if w == full and pos.size - k >= n - full:
            break
        room = _scan_room(k, w, n, pos.size, slack)
        pos, ov, nv = (_grown(x, k, room) for x in (pos, ov, nv))
    k = K.scan_tail(old, new, full, n, pos, ov, nv, k)
    if k > limit:
        return None
    return Changes(pos[:k], ov[:k], nv[:k])


def ranked_scan_applies(n: int, dtype: DType) -> bool:
    """Does scan_ranked take a range of n elements of `dtype`?"""
    return dtype.is_float and bool(R.blocks_apply.py_func(n, np.uint64(dtype.exponent_mask)))


def scan_ranked(old: np.ndarray, new: np.ndarray, dtype: DType, limit: int
                ) -> tuple[Changes, np.ndarray, np.ndarray] | None:
    """scan_range's changes with their old-exponent keys (uint64) and ranks (int64), as
    ctx.group_ranks gives them, from one pass over the words (ranks.scan_ranks_blocks): for
    a range that ranked_scan_applies to. None if more than `limit` changed."""
    old, new = _words(old, new)
    n = old.shape[0]
    shift, gmask = dtype.exponent_shift, np.uint64(dtype.exponent_mask)
    kbase = int(R.window_start(old, shift, gmask))
    neg, other = np.zeros(R.TOP + 1, np.int32), np.zeros(int(gmask) + 1, np.int64)
    kb = np.empty(R.BLOCK, np.uint8)
    slack = 2 * R.BLOCK
    outs = _ranked_outputs(n // 32 + slack, old.dtype)
    k = w = 0
    while True:
        k, w = R.scan_ranks_blocks(old, new, w, k, shift, gmask, kbase, neg, other, kb, *outs)
        if k > limit:
            return None
        if w == n:
            break
        room = _scan_room(k, w, n, outs[0].size, slack)
        outs = tuple(_grown(x, k, room) for x in outs)
    pos, ov, nv, keys, ranks = (x[:k] for x in outs)
    return Changes(pos, ov, nv), keys, ranks


def _ranked_outputs(size: int, words: np.dtype) -> tuple[np.ndarray, ...]:
    return (np.empty(size, np.int64), np.empty(size, words), np.empty(size, words),
            np.empty(size, np.uint64), np.empty(size, np.int64))


def _scan_room(found: int, scanned: int, n: int, size: int, slack: int) -> int:
    """Output slots for a scan out of room after `found` changes in its first `scanned` of n
    elements: the rest at the rate seen so far, a quarter more, and a chunk's slack; at least
    double (changes bunched at the end cannot make it grow more than logarithmically often).
    Doubling alone grew a tensor with 6.7% changed twice, and each growth copied and first
    touched its unwritten part too: 41 ms of a 0.24 s SmolLM2 encode (one thread) at 6.7%
    changed, where this takes 10 of 0.19 s."""
    expected = found * (n - scanned) // max(1, scanned)
    return max(found + expected + expected // 4 + slack, 2 * size + slack)


def _grown(x: np.ndarray, used: int, size: int) -> np.ndarray:
    """A larger array holding x[:used] (the rest left unwritten, so untouched until used)."""
    out = np.empty(size, x.dtype)
    out[:used] = x[:used]
    return out


def changed_positions(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Sorted int64 positions where two equal-length bit arrays differ."""
    changes = scan_range(old, new, old.shape[0])
    if changes is None:  # cannot happen: the limit is every element
        raise UsageError("changed_positions: scan gave up below its own length")
    return changes.pos
