"""Host loops of the linear tensor digest (numba, nogil, cached on disk); format/spec.md §4.

Each kernel adds the two lane sums (S0, S1) of some words to `out` (uint64[2]); the mixers and
the lane arithmetic are `digest.mix`, shared with the codec's apply kernels, which fold the words
they write into the same sums. Indices arrive as int64 and are converted explicitly: uint64 mixed
with a signed int would be promoted to float64.

Words are read-only, C-contiguous, aligned 1-D arrays of unsigned words of any width (1, 2, 4 or
8 bytes), whatever the caller holds (`digest.linear` shapes them so): numba compiles a kernel
once per argument type, so each compiles once per word width.
"""

from __future__ import annotations

import numpy as np

from ..kernel_cache import njit
from .mix import K0, K1, fold, fold_weyl

_ONE = np.uint64(1)
_ZERO = np.uint64(0)


@njit(cache=True, nogil=True, boundscheck=False)
def sum_run(words, first, out):
    """out += digest of the contiguous 1-D run `words`, element j at canonical index first + j."""
    s0 = s1 = _ZERO
    i1 = np.uint64(first) + _ONE
    k0 = i1 * K0  # the Weyl sequences advance by one add per element
    k1 = i1 * K1
    for j in range(words.shape[0]):
        s0, s1 = fold_weyl(s0, s1, k0, k1, np.uint64(words[j]))
        k0 += K0
        k1 += K1
    out[0] += s0
    out[1] += s1


@njit(cache=True, nogil=True, boundscheck=False)
def sum_block2(flat, rows, cols, mem_rs, mem_cs, first, row_stride, col_stride, out):
    """out += digest of a rows×cols block of words at flat[r·mem_rs + c·mem_cs] (strides ≥ 0,
    in elements): element (r, c) is at canonical index first + r·row_stride + c·col_stride.

    `flat` is the block's memory span as one contiguous run, so the kernel has a single array
    type per word width whatever the block's strides.
    """
    s0 = s1 = _ZERO
    # wrapping arithmetic: negative canonical strides work mod 2^64, and (i+1)·K advances by
    # stride·K
    rs = np.uint64(row_stride)
    cs = np.uint64(col_stride)
    step0 = cs * K0
    step1 = cs * K1
    f1 = np.uint64(first) + _ONE
    for r in range(rows):
        i1 = f1 + np.uint64(r) * rs
        k0 = i1 * K0
        k1 = i1 * K1
        # a row as its own array, indexed by loop counters: the compiler sees indexes ≥ 0 and
        # drops numba's negative-index wraparound (an 8M-element bf16 column block: 21 → 15 ms)
        row = flat[r * mem_rs:]
        if mem_cs == 1:  # rows contiguous in memory (column blocks): a unit-stride inner loop
            for c in range(cols):
                s0, s1 = fold_weyl(s0, s1, k0, k1, np.uint64(row[c]))
                k0 += step0
                k1 += step1
        else:
            for c in range(cols):
                s0, s1 = fold_weyl(s0, s1, k0, k1, np.uint64(row[c * mem_cs]))
                k0 += step0
                k1 += step1
    out[0] += s0
    out[1] += s1


@njit(cache=True, nogil=True, boundscheck=False)
def sum_change(index, old, new, first, out):
    """out += Σ_t mix(first + index[t], new[t]) − mix(first + index[t], old[t])."""
    n0 = n1 = o0 = o1 = _ZERO
    f1 = np.uint64(first) + _ONE
    for t in range(index.shape[0]):
        i1 = f1 + np.uint64(index[t])
        n0, n1 = fold(n0, n1, i1, np.uint64(new[t]))
        o0, o1 = fold(o0, o1, i1, np.uint64(old[t]))
    out[0] += n0 - o0
    out[1] += n1 - o1


@njit(cache=True, nogil=True, boundscheck=False)
def sum_at(words, pos, count, first, out):
    """out += Σ_{t<count} mix(first + pos[t], words[pos[t]]). Caller checks 0 ≤ pos < len(words)."""
    s0 = s1 = _ZERO
    f1 = np.uint64(first) + _ONE
    for t in range(count):
        p = pos[t]
        s0, s1 = fold(s0, s1, f1 + np.uint64(p), np.uint64(words[p]))
    out[0] += s0
    out[1] += s1
