"""Compiled kernels of the context-coded segment coding `ctx` (format/spec.md §2, "Context
coding"): the two streams, coded with codec.rangecoder.

Positions: the changed elements' ranks within their old-exponent group (as `groups`), coded per
group as Golomb gaps whose unary part is modelled adaptively per group; the group table (keys,
counts, Golomb parameters) is range-coded at the stream's head. Values: in group-major order,
each as its bit length (an adaptive tree per group: the magnitude of a change depends most on
the old exponent) and the bits below its leading one, the top eight modelled per (group, length).
Each group's models start from the previous group's (neighbouring exponents behave alike).
The receiver knows every old word, so the old exponent is free context on both streams: this is
what lets the payload approach the context entropy bound (bench/bounds.py) where byte varints
and zstd's order-0 Huffman cannot.
"""

from __future__ import annotations

import numpy as np

from ..kernel_cache import njit
from .kernels import BAD_CODE, POSITION_OUT_OF_RANGE, STREAM_OVERRUN, group_order
from .rangecoder import (
    INT_TREE,
    P_TOTAL,
    RANGE_START,
    bit_length_u64,
    dec_bit,
    dec_direct,
    dec_finish,
    dec_init,
    dec_int,
    dec_tree,
    enc_bit,
    enc_direct,
    enc_flush,
    enc_int,
    enc_tree,
)

MANTISSA_MODELLED = 8  # bits below a value's leading one coded with a model (the rest direct)
# Value contexts of one segment (groups × contexts per group) a reader allocates at most: all
# 256 groups of a 16- or 32-bit float fit; a 64-bit float segment with more than 284 exponent
# groups does not, and its writer codes it otherwise.
MAX_VALUE_CONTEXTS = 1 << 22
UNARY_CONTEXTS = 8  # Golomb quotient bits 0..6 get their own model, the rest share the 8th
# Int-model slots of the position stream's table.
SLOT_NGROUPS, SLOT_KEY, SLOT_COUNT, SLOT_M = 0, 1, 2, 3
INT_SLOTS = 4
CARRY_COUNT = 4  # see _carry

_U1 = np.uint64(1)
_ZERO = np.uint64(0)


# --- the ctx streams --------------------------------------------------------------------------


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _zigzag_u(o, n, mask, sign_shift):
    d = (n - o) & mask
    return ((d << _U1) & mask) ^ (mask if (d >> np.uint64(sign_shift)) & _U1 else _ZERO)


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _carry(prob, cnt, base, width):
    """A group's contexts start as the previous group's ended (neighbouring exponents code
    alike), with their counts capped so that they still adapt fast to this group."""
    if base > 0:
        for j in range(width):
            prob[base + j] = prob[base - width + j]
            cnt[base + j] = min(cnt[base - width + j], CARRY_COUNT)


@njit(cache=True, nogil=True, boundscheck=False)
def value_layout(vbits):
    """(levels, offsets, contexts per group) of the value models for words of vbits bits: a
    bit-length tree of 2^levels contexts (lengths 0..vbits), then for each length n in 2..vbits
    a tree over the min(n − 1, MANTISSA_MODELLED) bits below the leading one, at offsets[n]."""
    levels = bit_length_u64(np.uint64(vbits))
    offsets = np.zeros(vbits + 2, np.int64)
    o = 1 << levels
    for n in range(vbits + 2):
        offsets[n] = o
        if 2 <= n <= vbits:
            o += 1 << min(n - 1, MANTISSA_MODELLED)
    return levels, offsets, o


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _enc_value(low, rng, cache, csize, g, out, prob, cnt, vb, offsets, levels, z):
    """z (uint64): its bit length n through the group's length tree, then the (up to)
    MANTISSA_MODELLED bits below its leading one through n's tree, then the rest direct."""
    n = bit_length_u64(z)
    low, rng, cache, csize, g = enc_tree(low, rng, cache, csize, g, out, prob, cnt, vb, n, levels)
    if n >= 2:
        nm = min(n - 1, MANTISSA_MODELLED)
        rest = n - 1 - nm
        top = np.int64((z >> np.uint64(rest)) & np.uint64((1 << nm) - 1))
        low, rng, cache, csize, g = enc_tree(low, rng, cache, csize, g, out, prob, cnt,
                                             vb + offsets[n], top, nm)
        if rest > 0:
            low, rng, cache, csize, g = enc_direct(low, rng, cache, csize, g, out, z, rest)
    return low, rng, cache, csize, g


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _dec_value(rng, code, i, buf, prob, cnt, vb, offsets, levels, vbits):
    """A value coded by _enc_value, and ok: False for a bit length above vbits."""
    n, rng, code, i = dec_tree(rng, code, i, buf, prob, cnt, vb, levels)
    if n > vbits:
        return _ZERO, False, rng, code, i
    if n <= 1:
        return np.uint64(n), True, rng, code, i
    nm = min(n - 1, MANTISSA_MODELLED)
    rest = n - 1 - nm
    top, rng, code, i = dec_tree(rng, code, i, buf, prob, cnt, vb + offsets[n], nm)
    z = (_U1 << np.uint64(n - 1)) | (np.uint64(top) << np.uint64(rest))
    if rest > 0:
        tail, rng, code, i = dec_direct(rng, code, i, buf, rest)
        z |= tail
    return z, True, rng, code, i


@njit(cache=True, nogil=True, boundscheck=False)
def golomb_parameter(total_gap, count):
    """A Golomb parameter for gaps of mean total_gap / count (geometric source: the smallest m
    with (1 − p)^m ≤ ½, p = 1 / (mean + 1)); any m ≥ 1 decodes, this one codes near-optimally."""
    mean = total_gap / count
    if mean < 0.5:
        return 1
    p = 1.0 / (mean + 1.0)
    m = int(np.ceil(-np.log(2.0 - p) / np.log(1.0 - p)))
    return max(m, 1)


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _truncated_binary(m):
    """(k, u) of a Golomb parameter m: remainders below u take k − 1 bits, the rest k."""
    k = 0
    while (1 << k) < m:
        k += 1
    return k, (1 << k) - m


@njit(cache=True, nogil=True, boundscheck=False)
def ctx_encode(keys, ranks, oldv, newv, count, size, xor, mask, sign_shift, pos_out, val_out):
    """Encode both ctx streams of `count` changes. Returns (pos_len, val_len); a length above
    its buffer's size means the buffer was too small (grow it and call again).

    keys/ranks: each change's old-exponent group key (< size) and rank in the group, in position
    order (kernels.group_ranks); oldv/newv their old and new words; xor: values are old ^ new,
    else the zigzag of the wrap-around difference.
    """
    start, order, ngroups = group_order(keys, count, size)

    # positions: the table, then per group its Golomb-coded rank gaps
    low, rng, cache, csize, g = 0, RANGE_START, 0, 1, 0
    out = pos_out
    iprob = np.full(INT_SLOTS * INT_TREE, P_TOTAL // 2, np.int16)
    icnt = np.zeros(INT_SLOTS * INT_TREE, np.uint8)
    uprob = np.full(ngroups * UNARY_CONTEXTS, P_TOTAL // 2, np.int16)
    ucnt = np.zeros(ngroups * UNARY_CONTEXTS, np.uint8)
    gm = np.empty(size, np.int64)
    low, rng, cache, csize, g = enc_int(low, rng, cache, csize, g, out, iprob, icnt,
                                         SLOT_NGROUPS, np.uint64(ngroups))
    prev = -1
    for e in range(size):
        a, b = start[e], start[e + 1]
        if a == b:
            continue
        gm[e] = golomb_parameter(ranks[order[b - 1]] + 1 - (b - a), b - a)  # Σ gaps, count
        low, rng, cache, csize, g = enc_int(low, rng, cache, csize, g, out, iprob, icnt,
                                             SLOT_KEY, np.uint64(e - prev - 1))
        low, rng, cache, csize, g = enc_int(low, rng, cache, csize, g, out, iprob, icnt,
                                             SLOT_COUNT, np.uint64(b - a - 1))
        low, rng, cache, csize, g = enc_int(low, rng, cache, csize, g, out, iprob, icnt,
                                             SLOT_M, np.uint64(gm[e] - 1))
        prev = e
    grp = 0
    for e in range(size):
        a, b = start[e], start[e + 1]
        if a == b:
            continue
        m = gm[e]
        k, u = _truncated_binary(m)
        ub = grp * UNARY_CONTEXTS
        _carry(uprob, ucnt, ub, UNARY_CONTEXTS)
        r_prev = -1
        for t in range(a, b):
            r = ranks[order[t]]
            gap = r - r_prev - 1
            r_prev = r
            q = gap // m
            rem = gap - q * m
            for j in range(q):
                low, rng, cache, csize, g = enc_bit(low, rng, cache, csize, g, out, uprob, ucnt,
                                                     ub + min(j, UNARY_CONTEXTS - 1), 1)
            low, rng, cache, csize, g = enc_bit(low, rng, cache, csize, g, out, uprob, ucnt,
                                                 ub + min(q, UNARY_CONTEXTS - 1), 0)
            if rem < u:
                low, rng, cache, csize, g = enc_direct(low, rng, cache, csize, g, out, np.uint64(rem), k - 1)
            else:
                low, rng, cache, csize, g = enc_direct(low, rng, cache, csize, g, out, np.uint64(rem + u),
                                                     k)
        grp += 1
    pos_len = enc_flush(low, cache, csize, g, out)

    # values, group-major: per group a bit-length model and mantissa models (_enc_value)
    low, rng, cache, csize, g = 0, RANGE_START, 0, 1, 0
    out = val_out
    levels, offsets, block = value_layout(sign_shift + 1)
    vprob = np.full(ngroups * block, P_TOTAL // 2, np.int16)
    vcnt = np.zeros(ngroups * block, np.uint8)
    grp = 0
    for e in range(size):
        a, b = start[e], start[e + 1]
        if a == b:
            continue
        vb = grp * block
        _carry(vprob, vcnt, vb, block)
        for t in range(a, b):
            i = order[t]
            o = np.uint64(oldv[i])
            n = np.uint64(newv[i])
            z = o ^ n if xor else _zigzag_u(o, n, mask, sign_shift)
            low, rng, cache, csize, g = _enc_value(low, rng, cache, csize, g, out, vprob, vcnt, vb,
                                                   offsets, levels, z)
        grp += 1
    return pos_len, enc_flush(low, cache, csize, g, out)


@njit(cache=True, nogil=True, boundscheck=False)
def ctx_decode_ranks(n, size, vbits, pos_buf, val_buf, count, gkey, gstart, ranks, zs):
    """Decode both ctx streams of a segment over n elements, without the base words: the group
    table and, group-major, each change's rank within its group and its value.

    All of it but the placement (`place.ctx_place`) needs no base, so a receiver whose base words
    live on a device decodes here and places there. gkey (≥ size slots) gets the groups' keys,
    gstart (≥ size + 1) their starts in ranks/zs (count slots each). Returns the number of
    groups or a negative status. Every loop is bounded by the stream's length (a truncated
    stream reads as zeros and stops at the first check) or by the range.
    """
    plen = pos_buf.shape[0]
    rng, code, i, status = dec_init(pos_buf)
    if status < 0:
        return status
    iprob = np.full(INT_SLOTS * INT_TREE, P_TOTAL // 2, np.int16)
    icnt = np.zeros(INT_SLOTS * INT_TREE, np.uint8)
    ng, ok, rng, code, i = dec_int(rng, code, i, pos_buf, iprob, icnt, SLOT_NGROUPS)
    if not ok or ng > np.uint64(size) or (ng == _ZERO) != (count == 0):
        return STREAM_OVERRUN if i > plen else BAD_CODE
    ngroups = np.int64(ng)
    if ngroups * value_layout(vbits)[2] > MAX_VALUE_CONTEXTS:
        return BAD_CODE
    gm = np.empty(ngroups, np.int64)
    gstart[0] = 0
    prev = np.int64(-1)
    for grp in range(ngroups):
        dk, ok1, rng, code, i = dec_int(rng, code, i, pos_buf, iprob, icnt, SLOT_KEY)
        c, ok2, rng, code, i = dec_int(rng, code, i, pos_buf, iprob, icnt, SLOT_COUNT)
        m, ok3, rng, code, i = dec_int(rng, code, i, pos_buf, iprob, icnt, SLOT_M)
        if i > plen:
            return STREAM_OVERRUN
        if not (ok1 and ok2 and ok3) or dk >= np.uint64(size) or c >= np.uint64(count) \
                or m >= np.uint64(n):
            return BAD_CODE
        key = prev + 1 + np.int64(dk)
        if key >= size:
            return BAD_CODE
        gkey[grp] = key
        prev = key
        gstart[grp + 1] = gstart[grp] + np.int64(c) + 1
        if gstart[grp + 1] > count:
            return BAD_CODE
        gm[grp] = np.int64(m) + 1
    if gstart[ngroups] != count:
        return BAD_CODE

    # rank gaps, group-major
    uprob = np.full(ngroups * UNARY_CONTEXTS, P_TOTAL // 2, np.int16)
    ucnt = np.zeros(ngroups * UNARY_CONTEXTS, np.uint8)
    for grp in range(ngroups):
        m = gm[grp]
        k, u = _truncated_binary(m)
        ub = grp * UNARY_CONTEXTS
        _carry(uprob, ucnt, ub, UNARY_CONTEXTS)
        r = -1
        for t in range(gstart[grp], gstart[grp + 1]):
            q = 0
            while True:
                bit, rng, code, i = dec_bit(rng, code, i, pos_buf, uprob, ucnt,
                                             ub + min(q, UNARY_CONTEXTS - 1))
                if bit == 0:
                    break
                q += 1
                if i > plen:
                    return STREAM_OVERRUN
                if q * m >= n:  # a gap past any range
                    return BAD_CODE
            rem = np.int64(0)
            if k > 0:
                head, rng, code, i = dec_direct(rng, code, i, pos_buf, k - 1)
                rem = np.int64(head)
                if rem >= u:
                    low_bit, rng, code, i = dec_direct(rng, code, i, pos_buf, 1)
                    rem = ((rem << 1) | np.int64(low_bit)) - u
            if i > plen:
                return STREAM_OVERRUN
            r += 1 + q * m + rem
            if r >= n:
                return POSITION_OUT_OF_RANGE
            ranks[t] = r  # the group rank of change t (group-major)
    status = dec_finish(code, i, pos_buf)
    if status < 0:
        return status

    # values, group-major
    vlen = val_buf.shape[0]
    rng, code, i, status = dec_init(val_buf)
    if status < 0:
        return status
    levels, offsets, block = value_layout(vbits)
    vprob = np.full(ngroups * block, P_TOTAL // 2, np.int16)
    vcnt = np.zeros(ngroups * block, np.uint8)
    for grp in range(ngroups):
        vb = grp * block
        _carry(vprob, vcnt, vb, block)
        for t in range(gstart[grp], gstart[grp + 1]):
            z, ok, rng, code, i = _dec_value(rng, code, i, val_buf, vprob, vcnt, vb, offsets, levels,
                                             vbits)
            if i > vlen:
                return STREAM_OVERRUN
            if not ok:
                return BAD_CODE
            zs[t] = z
    status = dec_finish(code, i, val_buf)
    if status < 0:
        return status
    return ngroups
