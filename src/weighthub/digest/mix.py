"""The per-element mixers of the linear tensor digest (format/spec.md §4), as numba functions
inlined into every kernel that digests words: the digest loops here (`digest.kernels`) and the
codec's apply kernels, which fold each word they rewrite into the digest as they write it.

    mix0(i, w) = fmix64(((i + 1) · K0) ^ w)                  murmur3's 64-bit finalizer
    mix1(i, w) = mix13((i + 1) · K1 ^ rotl64(w, 32))           Stafford's variant 13 (splitmix64)

The digest of a tensor is the pair of lane sums S0 = Σ_i mix0(i, w_i), S1 = Σ_i mix1(i, w_i).
The index enters each lane through a Weyl sequence, k = (i + 1) · K: along a contiguous run it
advances by one add per element (`fold_weyl`); at scattered positions it is one multiply
(`fold`). All arithmetic is uint64 (wrapping). Never mix uint64 with signed ints here:
numpy/numba promote that to float64.
"""

from __future__ import annotations

import numpy as np

from ..kernel_cache import njit

K0 = np.uint64(0x9E3779B97F4A7C15)  # golden ratio · 2^64 (odd)
K1 = np.uint64(0xD1B54A32D192ED03)  # an odd constant from the R2 sequence, unrelated to K0
_M0A = np.uint64(0xFF51AFD7ED558CCD)  # murmur3 fmix64
_M0B = np.uint64(0xC4CEB9FE1A85EC53)
_M1A = np.uint64(0xBF58476D1CE4E5B9)  # Stafford mix13 (splitmix64's finalizer)
_M1B = np.uint64(0x94D049BB133111EB)
_S27 = np.uint64(27)
_S30 = np.uint64(30)
_S31 = np.uint64(31)
_S32 = np.uint64(32)
_S33 = np.uint64(33)


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def mix0(k, w):
    """Lane 0 of the word w (uint64) at the Weyl value k = (i + 1) · K0."""
    x = k ^ w
    x ^= x >> _S33
    x *= _M0A
    x ^= x >> _S33
    x *= _M0B
    x ^= x >> _S33
    return x


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def mix1(k, w):
    """Lane 1 of the word w (uint64) at the Weyl value k = (i + 1) · K1."""
    x = k ^ ((w << _S32) | (w >> _S32))
    x ^= x >> _S30
    x *= _M1A
    x ^= x >> _S27
    x *= _M1B
    x ^= x >> _S31
    return x


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def fold(s0, s1, i1, w):
    """(s0, s1) plus both lanes of word w at canonical index i1 − 1 (i1 = i + 1, uint64)."""
    return s0 + mix0(i1 * K0, w), s1 + mix1(i1 * K1, w)


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def fold_weyl(s0, s1, k0, k1, w):
    """(s0, s1) plus both lanes of word w at the Weyl values k0 = (i + 1) · K0, k1 = (i + 1) · K1."""
    return s0 + mix0(k0, w), s1 + mix1(k1, w)
