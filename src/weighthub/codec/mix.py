"""The per-element mixers of the linear tensor digest (format/spec.md §4), shared by the digest
kernels and the apply kernels, which fold each rewritten word into the digest as they write it.

    mix0(i, w) = fmix64(((i + 1) · K0) ^ w)                  murmur3's 64-bit finalizer
    mix1(i, w) = mix13((i + 1) · K1 ^ rotl64(w, 32))           Stafford's variant 13 (splitmix64)

Callers pass k = (i + 1) · K (a Weyl sequence: one add per element along a contiguous run).
All arithmetic is uint64 (wrapping).
"""

from __future__ import annotations

import numpy as np
from numba import njit

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
    """k = (i + 1) · K0."""
    x = k ^ w
    x ^= x >> _S33
    x *= _M0A
    x ^= x >> _S33
    x *= _M0B
    x ^= x >> _S33
    return x


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def mix1(k, w):
    """k = (i + 1) · K1."""
    x = k ^ ((w << _S32) | (w >> _S32))
    x ^= x >> _S30
    x *= _M1A
    x ^= x >> _S27
    x *= _M1B
    x ^= x >> _S31
    return x
