"""Compiled loops of the linear tensor digest (numba, nogil, cached on disk). See format/spec.md §4.

The digest of a tensor is a pair of sums over its elements, mod 2^64:

    S0 = Σ_i mix0(i, w_i)        S1 = Σ_i mix1(i, w_i)

where i is the element's canonical flat index and w_i its bit pattern zero-extended to 64 bits:

    mix0(i, w) = fmix64(((i + 1) · K0) ^ w)                  murmur3's 64-bit finalizer
    mix1(i, w) = mix13((i + 1) · K1 ^ rotl64(w, 32))           Stafford's variant 13 (splitmix64)

Sums compose: the digest of a tensor is the sum of the digests of any tiling of it, whoever
holds the pieces, and an update changes it by Σ mix(i, new) − mix(i, old) over the changed
elements only. The index enters each lane through a Weyl sequence, (i+1)·K, so a contiguous
run costs one add per element for it; the word enters the low half of lane 0 and the high half
of lane 1, and two unrelated finalizers make equal sums on both lanes by accident ~2^-128.

All arithmetic is uint64 (wrapping). Never mix uint64 with signed ints here: numpy/numba
promote that to float64. Indices arrive as int64 and are converted explicitly.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .kernels import BAD_VARINT, POSITION_OUT_OF_RANGE, STREAM_OVERRUN, TRAILING_BYTES
from .mix import K0, K1
from .mix import mix0 as _mix0
from .mix import mix1 as _mix1

_ONE = np.uint64(1)


@njit(cache=True, nogil=True, boundscheck=False)
def sum_run(words, first, out):
    """out += digest of the contiguous 1-D run `words`, element j at canonical index first + j."""
    s0 = np.uint64(0)
    s1 = np.uint64(0)
    i1 = np.uint64(first) + _ONE
    k0 = i1 * K0  # the Weyl sequences advance by one add per element
    k1 = i1 * K1
    for j in range(words.shape[0]):
        w = np.uint64(words[j])
        s0 += _mix0(k0, w)
        s1 += _mix1(k1, w)
        k0 += K0
        k1 += K1
    out[0] += s0
    out[1] += s1


@njit(cache=True, nogil=True, boundscheck=False)
def sum_block2(words, first, row_stride, col_stride, out):
    """out += digest of a 2-D block (any memory strides): element (r, c) at first + r·rs + c·cs."""
    s0 = np.uint64(0)
    s1 = np.uint64(0)
    # wrapping arithmetic: negative strides work mod 2^64, and (i+1)·K advances by stride·K
    rs = np.uint64(row_stride)
    cs = np.uint64(col_stride)
    step0 = cs * K0
    step1 = cs * K1
    f1 = np.uint64(first) + _ONE
    for r in range(words.shape[0]):
        i1 = f1 + np.uint64(r) * rs
        k0 = i1 * K0
        k1 = i1 * K1
        for c in range(words.shape[1]):
            w = np.uint64(words[r, c])
            s0 += _mix0(k0, w)
            s1 += _mix1(k1, w)
            k0 += step0
            k1 += step1
    out[0] += s0
    out[1] += s1


@njit(cache=True, nogil=True, boundscheck=False)
def sum_change(index, old, new, first, out):
    """out += Σ_t mix(first + index[t], new[t]) − mix(first + index[t], old[t])."""
    s0 = np.uint64(0)
    s1 = np.uint64(0)
    f1 = np.uint64(first) + _ONE
    for t in range(index.shape[0]):
        i1 = f1 + np.uint64(index[t])
        k0 = i1 * K0
        k1 = i1 * K1
        n = np.uint64(new[t])
        o = np.uint64(old[t])
        s0 += _mix0(k0, n) - _mix0(k0, o)
        s1 += _mix1(k1, n) - _mix1(k1, o)
    out[0] += s0
    out[1] += s1


@njit(cache=True, nogil=True, boundscheck=False)
def sum_at(words, pos, count, first, out):
    """out += Σ_{t<count} mix(first + pos[t], words[pos[t]]). Caller checks 0 ≤ pos < len(words)."""
    s0 = np.uint64(0)
    s1 = np.uint64(0)
    f1 = np.uint64(first) + _ONE
    for t in range(count):
        p = pos[t]
        i1 = f1 + np.uint64(p)
        w = np.uint64(words[p])
        s0 += _mix0(i1 * K0, w)
        s1 += _mix1(i1 * K1, w)
    out[0] += s0
    out[1] += s1


@njit(cache=True, nogil=True, boundscheck=False)
def sum_at_gaps(words, gaps, count, first, out):
    """sum_at over the positions of a gap-coded stream (format/spec.md §2, `gaps`).

    Returns count, or a negative status (as the apply kernels: a varint overrun or too long, a
    position past the end, bytes left over) with `out` untouched.
    """
    n = words.shape[0]
    gend = gaps.shape[0]
    gi = 0
    p = np.int64(-1)
    s0 = np.uint64(0)
    s1 = np.uint64(0)
    f1 = np.uint64(first) + _ONE
    for _ in range(count):
        if gi < gend and gaps[gi] < 0x80:  # one-byte fast path, as in the apply kernels
            g = np.uint64(gaps[gi])
            gi += 1
        else:
            g = np.uint64(0)
            shift = 0
            while True:
                if gi >= gend:
                    return STREAM_OVERRUN
                c = np.uint64(gaps[gi])
                gi += 1
                g |= (c & np.uint64(0x7F)) << np.uint64(shift)
                if c < np.uint64(0x80):
                    break
                shift += 7
                if shift > 63:
                    return BAD_VARINT
        if g >= np.uint64(n - 1 - p):
            return POSITION_OUT_OF_RANGE
        p = p + 1 + np.int64(g)
        i1 = f1 + np.uint64(p)
        w = np.uint64(words[p])
        s0 += _mix0(i1 * K0, w)
        s1 += _mix1(i1 * K1, w)
    if gi != gend:
        return TRAILING_BYTES
    out[0] += s0
    out[1] += s1
    return count
