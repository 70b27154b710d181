"""An adaptive binary range coder in numba (LZMA-style carry-less range coder with 12-bit
probabilities), the entropy coder of the `ctx` segment coding (format/spec.md §2, "Context
coding"; the streams themselves are in codec.ctx_kernels).

Why a binary adaptive coder rather than rANS with frequency tables: no table to transmit or
validate (a segment's tables would cost more than the learning does on the many small tensors of
a model), and a hostile stream cannot describe an invalid model; every decision is bounded-cost.
(codec.ans keeps those properties with adaptive multi-symbol models under rANS, several times
faster per symbol; it is the default now, and this coder stays readable and writable for
receivers older than it.)
Probabilities are clamped to [P_MIN, P_TOTAL − P_MIN], so a decision costs at least
log2(P_TOTAL / (P_TOTAL − P_MIN)) bits: that lower bound is what lets a reader refuse a declared
count that its stream bytes cannot hold, before allocating anything for it.

All integer arithmetic is int64 (the range is < 2^32, `low` < 2^40) except value words, which are
uint64 with explicit np.uint64 constants (numba promotes int64 with uint64 to float64).
Decoders never touch memory past an end (see the state notes below).
"""

from __future__ import annotations

import numpy as np

from ..kernel_cache import njit
from .kernels import BAD_CODE, STREAM_OVERRUN, TRAILING_BYTES, bit_length

PROB_BITS = 12
P_TOTAL = 1 << PROB_BITS
P_MIN = 16  # the probability clamp (see module docstring)
_P_MAX = P_TOTAL - P_MIN
_TOP = 1 << 24
_MASK32 = 0xFFFFFFFF
RANGE_START = _MASK32  # the encoder's initial range (its state: low, rng, cache, csize, g)
COUNT_LIMIT = 63  # observations a context counts before its rate stops slowing

INT_TREE = 128  # bit-length tree of a coded integer: lengths 0..64 valid

# Adaptation rate by observations so far: 1 + floor(log2(c + 1)), at most 6. A young context
# moves fast (after one observation it gives the seen bit ¾, as a Krichevsky–Trofimov estimate
# would), an old one averages over ~64 observations.
_RATE = np.minimum(1 + np.floor(np.log2(np.arange(COUNT_LIMIT + 1) + 1)), 6).astype(np.int64)

_U1 = np.uint64(1)
_ZERO = np.uint64(0)


# --- the range coder ------------------------------------------------------------------------
# Coder state is carried in local variables through small inlined functions (an int64 state
# array would be reloaded after every byte written: numba cannot prove it does not alias `out`).
# Encoder: (low, rng, cache, csize, g): g counts bytes produced; writes past `out` are dropped
# and the caller sees g > len(out) (too small: grow and encode again).
# Decoder: (rng, code, i): i counts bytes consumed; past the end it reads zeros and i keeps
# counting, so a truncated stream shows as i > len(buf) (checked in every loop that a stream
# could otherwise keep going, and at the end).


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _shift_low(low, cache, csize, g, out):
    if low < 0xFF000000 or low > _MASK32:
        carry = low >> 32
        temp = cache
        cap = out.shape[0]
        while True:
            if g < cap:
                out[g] = np.uint8((temp + carry) & 0xFF)
            g += 1
            temp = 0xFF
            csize -= 1
            if csize == 0:
                break
        cache = (low >> 24) & 0xFF
    csize += 1
    low = (low & 0x00FFFFFF) << 8
    return low, cache, csize, g


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _adapt(prob, cnt, i, bit):
    # branch-free: the bit is as unpredictable as the data it codes
    p = np.int64(prob[i])
    c = cnt[i]
    shift = _RATE[c]
    p += ((P_TOTAL - p) >> shift) * (1 - bit) - (p >> shift) * bit
    prob[i] = max(P_MIN, min(p, _P_MAX))
    cnt[i] = min(c + 1, COUNT_LIMIT)


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def enc_bit(low, rng, cache, csize, g, out, prob, cnt, i, bit):
    bound = (rng >> PROB_BITS) * np.int64(prob[i])
    low += bound * bit
    rng = bound + bit * (rng - 2 * bound)  # bit 0: bound; bit 1: rng − bound
    _adapt(prob, cnt, i, bit)
    while rng < _TOP:
        rng <<= 8
        low, cache, csize, g = _shift_low(low, cache, csize, g, out)
    return low, rng, cache, csize, g


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def enc_direct(low, rng, cache, csize, g, out, v, nbits):
    """The low `nbits` bits of v (uint64), most significant first, at probability ½."""
    for b in range(nbits - 1, -1, -1):
        rng >>= 1
        if (v >> np.uint64(b)) & _U1:
            low += rng
        while rng < _TOP:
            rng <<= 8
            low, cache, csize, g = _shift_low(low, cache, csize, g, out)
    return low, rng, cache, csize, g


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def enc_tree(low, rng, cache, csize, g, out, prob, cnt, base, sym, levels):
    """sym (< 2^levels) MSB first through a binary tree of adaptive nodes prob[base + 1 ..]."""
    node = 1
    for b in range(levels - 1, -1, -1):
        bit = (sym >> b) & 1
        low, rng, cache, csize, g = enc_bit(low, rng, cache, csize, g, out, prob, cnt,
                                             base + node, bit)
        node = 2 * node + bit
    return low, rng, cache, csize, g


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def bit_length_u64(v):
    """The bit length of an unsigned integer value (any integer type, < 2^64)."""
    return bit_length(np.uint64(v))


@njit(cache=True, nogil=True, boundscheck=False)
def enc_int(low, rng, cache, csize, g, out, iprob, icnt, slot, v):
    """An unsigned integer (uint64): its bit length through the slot's tree, then the bits
    below the leading one at probability ½. (Not inlined: table entries and escapes are rare.)"""
    n = bit_length_u64(v)
    low, rng, cache, csize, g = enc_tree(low, rng, cache, csize, g, out, iprob, icnt,
                                          slot * INT_TREE, n, 7)
    if n > 1:
        low, rng, cache, csize, g = enc_direct(low, rng, cache, csize, g, out, v, n - 1)
    return low, rng, cache, csize, g


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def enc_flush(low, cache, csize, g, out):
    for _ in range(5):
        low, cache, csize, g = _shift_low(low, cache, csize, g, out)
    return g


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _byte(buf, i):
    return np.int64(buf[i]) if i < buf.shape[0] else 0


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def dec_init(buf):
    """(rng, code, i, status): status BAD_CODE for a first byte ≠ 0, overrun below 5 bytes."""
    code = 0
    for i in range(1, 5):
        code = (code << 8) | _byte(buf, i)
    status = 0
    if buf.shape[0] < 5:
        status = STREAM_OVERRUN
    elif buf[0] != 0 or code == _MASK32:  # an encoder's first byte is 0, its code < range
        status = BAD_CODE
    return _MASK32, code, 5, status


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def dec_bit(rng, code, i, buf, prob, cnt, k):
    bound = (rng >> PROB_BITS) * np.int64(prob[k])
    bit = np.int64(code >= bound)
    code -= bound * bit
    rng = bound + bit * (rng - 2 * bound)  # bit 0: bound; bit 1: rng − bound
    _adapt(prob, cnt, k, bit)
    while rng < _TOP:
        rng <<= 8
        code = ((code << 8) | _byte(buf, i)) & _MASK32
        i += 1
    return bit, rng, code, i


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def dec_direct(rng, code, i, buf, nbits):
    v = _ZERO
    for _ in range(nbits):
        rng >>= 1
        bit = _ZERO
        if code >= rng:
            code -= rng
            bit = _U1
        v = (v << _U1) | bit
        while rng < _TOP:
            rng <<= 8
            code = ((code << 8) | _byte(buf, i)) & _MASK32
            i += 1
    return v, rng, code, i


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def dec_tree(rng, code, i, buf, prob, cnt, base, levels):
    node = 1
    for _ in range(levels):
        bit, rng, code, i = dec_bit(rng, code, i, buf, prob, cnt, base + node)
        node = 2 * node + bit
    return node - (1 << levels), rng, code, i


@njit(cache=True, nogil=True, boundscheck=False)
def dec_int(rng, code, i, buf, iprob, icnt, slot):
    """A coded integer (uint64) and ok: False for a bit length over 64."""
    n, rng, code, i = dec_tree(rng, code, i, buf, iprob, icnt, slot * INT_TREE, 7)
    if n > 64:
        return _ZERO, False, rng, code, i
    if n <= 1:
        return np.uint64(n), True, rng, code, i
    v, rng, code, i = dec_direct(rng, code, i, buf, n - 1)
    return (_U1 << np.uint64(n - 1)) | v, True, rng, code, i


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def dec_finish(code, i, buf):
    """Status of a stream after its last symbol: every byte read, and the code back at 0."""
    if i > buf.shape[0]:
        return STREAM_OVERRUN
    if i < buf.shape[0]:
        return TRAILING_BYTES
    if code != 0:
        return BAD_CODE
    return 0
