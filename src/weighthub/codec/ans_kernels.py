"""Compiled kernels of the `ans` segment coding (format/spec.md §2, "ANS coding"): the two
streams, coded with codec.ans.

The information is `ctx`'s: changes grouped by their old exponent, ranks within the group as
gaps, values group-major. Positions: the group table as coded integers, then per group each
rank gap as a Rice code: its quotient a symbol (Q_ALPHABET − 1 or more escape to a coded
integer), its remainder a raw field. Values: each entry's bit length a symbol, the bits below
its leading one two chunks of up to CHUNK_BITS as symbols, the rest raw. Contexts carry over
from group to group (model_enter): neighbouring exponents code alike.
"""

from __future__ import annotations

import numpy as np

from ..kernel_cache import njit
from .ans import (
    HEAD_BYTES,
    RAW_MAX,
    WEIGHT,
    code_ops,
    dec_finish,
    dec_init,
    dec_symbol,
    get_raw,
    model_enter,
    model_rebuild,
    models,
    next_rebuild,
    observe,
    put_raw,
    symbol_op,
)
from .ctx_kernels import golomb_parameter
from .kernels import BAD_CODE, POSITION_OUT_OF_RANGE, STREAM_OVERRUN, group_starts
from .rangecoder import bit_length_u64

# A value entry z: its head symbol is z itself when z < SMALL (at most SMALL_BITS bits: ±1..±4
# ulp differences, ~96% of the entries of fine-tuning steps, decode in one symbol), else
# SMALL + its bit length − SMALL_BITS − 1. Then the bits below a long entry's leading one: a
# chunk of CHUNK_BITS in context of the length, one of up to CHUNK_BITS in context of the length
# and the first chunk (so 8 modelled bits, as ctx models), the rest raw.
SMALL_BITS = 3
SMALL = 1 << SMALL_BITS
CHUNK_BITS = 4
CHUNK_ALPHABET = 1 << CHUNK_BITS  # (a shorter second chunk uses its first symbols only)
Q_ALPHABET = 8  # Rice quotients 0..6 are symbols; 7 escapes to a coded integer q − 7
INT_ALPHABET = 65  # a coded integer's bit length, 0..64
SLOT_NGROUPS, SLOT_KEY, SLOT_COUNT, SLOT_RICE, SLOT_ESCAPE = 0, 1, 2, 3, 4
INT_SLOTS = 5

_U1 = np.uint64(1)


@njit(cache=True, nogil=True, boundscheck=False)
def head_alphabet(vbits):
    """Head symbols of vbits-bit entries: the SMALL small entries, then lengths SMALL_BITS + 1 ..
    vbits."""
    return SMALL + vbits - SMALL_BITS


@njit(cache=True, nogil=True, boundscheck=False)
def chunk_contexts(vbits):
    """Chunk contexts of vbits-bit entries: the first chunk's of length n at row n, the
    second's at row vbits + 1 + n·CHUNK_ALPHABET + first chunk (rows of short lengths unused)."""
    return (vbits + 1) * (CHUNK_ALPHABET + 1)


@njit(cache=True, nogil=True, boundscheck=False)
def _put_int(ops, n, icum, icnt, slot, v):
    """A coded integer v ≥ 0: its bit length as a symbol of the slot's context, then the bits
    below its leading one raw."""
    nb = bit_length_u64(np.uint64(v))
    if icnt[slot, INT_ALPHABET + 2] != 0:
        model_enter(icum, icnt, slot, INT_ALPHABET, 0)
    ops[np.uint64(n)] = symbol_op(icum, slot, nb)
    n += 1
    if observe(icnt, slot, INT_ALPHABET, nb):
        model_rebuild(icum, icnt, slot, INT_ALPHABET)
    if nb >= 2:
        n = put_raw(ops, n, v, nb - 1)
    return n


@njit(cache=True, nogil=True, boundscheck=False)
def _get_int(xa, xb, i, buf, icum, icnt, slot):
    if icnt[slot, INT_ALPHABET + 2] != 0:
        model_enter(icum, icnt, slot, INT_ALPHABET, 0)
    nb, xa, xb, i = dec_symbol(xa, xb, i, buf, icum, slot)
    if observe(icnt, slot, INT_ALPHABET, nb):
        model_rebuild(icum, icnt, slot, INT_ALPHABET)
    if nb <= 1:
        return np.uint64(nb), xa, xb, i
    v, xa, xb, i = get_raw(xa, xb, i, buf, nb - 1)
    return (_U1 << np.uint64(nb - 1)) | v, xa, xb, i


@njit(cache=True, nogil=True, boundscheck=False)
def rice_parameter(total_gap, count):
    """The Rice exponent k (remainders of k bits) a writer chooses for a group of `count` gaps
    summing to total_gap: the largest k with 2^k at most the Golomb parameter of their mean.
    Any k decodes; with the quotient modelled adaptively this one codes as small as the Golomb
    code (measured on the MiniLM and SmolLM2 trajectories) and needs no division."""
    return max(0, bit_length_u64(np.uint64(golomb_parameter(total_gap, count))) - 1)


@njit(cache=True, nogil=True, boundscheck=False)
def _zigzag_u(o, n, mask, sign_shift):
    d = (n - o) & mask
    return ((d << _U1) & mask) ^ (mask if (d >> np.uint64(sign_shift)) & _U1 else np.uint64(0))


@njit(cache=True, nogil=True, boundscheck=False)
def _group_major(keys, ranks, oldv, newv, count, size, xor, mask, sign_shift):
    """The changes group-major, as the coders read them: (start, gaps, zs, ngroups), where
    group e's changes are [start[e], start[e + 1]) of gaps (rank gaps r − r_prev − 1) and zs
    (value entries). One pass in position order, writing each group's run in order: the coders
    then read sequentially instead of gathering (measured 2x on the forward passes)."""
    start, ngroups = group_starts(keys, count, size)
    fill = start[:size].copy()
    last = np.full(size, -1, np.int64)
    gaps = np.empty(count, np.int64)
    zs = np.empty(count, np.uint64)
    for t in range(count):
        e = keys[t]
        j = np.uint64(fill[e])
        fill[e] = j + _U1
        gaps[j] = ranks[t] - last[e] - 1
        last[e] = ranks[t]
        o = np.uint64(oldv[t])
        w = np.uint64(newv[t])
        zs[j] = o ^ w if xor else _zigzag_u(o, w, mask, sign_shift)
    return start, gaps, zs, ngroups


@njit(cache=True, nogil=True, boundscheck=False)
def ans_encode(keys, ranks, oldv, newv, count, size, xor, mask, sign_shift):
    """Both ans streams of `count` changes: (positions uint8[], values uint8[]).

    keys/ranks: each change's old-exponent group key (< size) and rank in the group, in position
    order (kernels.group_ranks); oldv/newv their old and new words; xor: values are old ^ new,
    else the zigzag of the wrap-around difference.
    """
    start, gaps, zs, ngroups = _group_major(keys, ranks, oldv, newv, count, size, xor, mask,
                                            sign_shift)
    vbits = sign_shift + 1
    icum, icnt = models(INT_SLOTS, INT_ALPHABET)

    # positions: the table, then per group its Golomb-coded rank gaps
    ops = np.empty(16 * (ngroups + 1) + 3 * count, np.uint32)
    n = _put_int(ops, 0, icum, icnt, SLOT_NGROUPS, ngroups)
    gk = np.empty(size, np.int64)
    gsum = np.empty(size, np.int64)
    prev = -1
    for e in range(size):
        a, b = start[e], start[e + 1]
        if a == b:
            continue
        total = 0
        for t in range(a, b):
            total += gaps[np.uint64(t)]
        gsum[e] = total
        gk[e] = rice_parameter(total, b - a)
        n = _put_int(ops, n, icum, icnt, SLOT_KEY, e - prev - 1)
        n = _put_int(ops, n, icum, icnt, SLOT_COUNT, b - a - 1)
        n = _put_int(ops, n, icum, icnt, SLOT_RICE, gk[e])
        prev = e
    qcum, qcnt = models(1, Q_ALPHABET)
    grp = 0
    for e in range(size):
        a, b = start[e], start[e + 1]
        if a == b:
            continue
        k = gk[e]
        low = (1 << k) - 1
        # room for the group's ops, grown here rather than in the loop (an array reassigned
        # inside the loop cost ~10 ns a change): a change takes its quotient and remainder
        # pieces, and an escape (a gap of at least 15·2^k) at most 5 more
        need = n + (b - a) * (2 + (k + RAW_MAX - 1) // RAW_MAX) \
            + 5 * ((gsum[e] >> k) // (Q_ALPHABET - 1) + 1)
        if need > ops.shape[0]:
            ops = np.concatenate((ops, np.empty(need - ops.shape[0], np.uint32)))
        model_enter(qcum, qcnt, 0, Q_ALPHABET, grp)
        due = a  # the change whose count rebuilds the table (a count in a local: next_rebuild)
        for t in range(a, b):
            gap = gaps[np.uint64(t)]
            q = gap >> k
            qs = min(q, Q_ALPHABET - 1)
            ops[np.uint64(n)] = symbol_op(qcum, 0, qs)
            n += 1
            qcnt[0, np.uint64(qs)] += WEIGHT
            if t == due:
                due = a + next_rebuild(t - a + 1) - 1
                model_rebuild(qcum, qcnt, 0, Q_ALPHABET)
            if q >= Q_ALPHABET - 1:
                n = _put_int(ops, n, icum, icnt, SLOT_ESCAPE, q - (Q_ALPHABET - 1))
            if k > RAW_MAX:
                n = put_raw(ops, n, gap & low, k)
            else:  # one raw op, none for k = 0 (written anyway, not counted)
                ops[np.uint64(n)] = np.uint32((gap & low) | ((k - 1) << 28))
                n += k > 0
        grp += 1
    pos_out = np.empty(HEAD_BYTES + 2 * n, np.uint8)
    pos_len = code_ops(ops, n, pos_out)

    # values, group-major: the head symbol, then for long values the chunks below the leading 1
    ha = head_alphabet(vbits)
    hcum, hcnt = models(1, ha)
    ccum, ccnt = models(chunk_contexts(vbits), CHUNK_ALPHABET)
    ops = np.empty(count * (3 + (vbits + 15) // 16) + 1, np.uint32)
    n = 0
    grp = 0
    for e in range(size):
        a, b = start[e], start[e + 1]
        if a == b:
            continue
        model_enter(hcum, hcnt, 0, ha, grp)
        due = a
        for t in range(a, b):
            z = zs[np.uint64(t)]
            nb = bit_length_u64(z)
            h = np.int64(z) if nb <= SMALL_BITS else SMALL + nb - SMALL_BITS - 1
            ops[np.uint64(n)] = symbol_op(hcum, 0, h)
            n += 1
            hcnt[0, h] += WEIGHT
            if t == due:
                due = a + next_rebuild(t - a + 1) - 1
                model_rebuild(hcum, hcnt, 0, ha)
            if nb > SMALL_BITS:
                t1 = min(nb - 1, CHUNK_BITS)
                rest = nb - 1 - t1
                c1 = np.int64(z >> np.uint64(rest)) & ((1 << t1) - 1)
                if ccnt[nb, CHUNK_ALPHABET + 2] != grp:
                    model_enter(ccum, ccnt, nb, CHUNK_ALPHABET, grp)
                ops[np.uint64(n)] = symbol_op(ccum, nb, c1)
                n += 1
                if observe(ccnt, nb, CHUNK_ALPHABET, c1):
                    model_rebuild(ccum, ccnt, nb, CHUNK_ALPHABET)
                if rest > 0:
                    t2 = min(rest, CHUNK_BITS)
                    rest -= t2
                    c2 = np.int64(z >> np.uint64(rest)) & ((1 << t2) - 1)
                    row = vbits + 1 + nb * CHUNK_ALPHABET + c1
                    if ccnt[row, CHUNK_ALPHABET + 2] != grp:
                        model_enter(ccum, ccnt, row, CHUNK_ALPHABET, grp)
                    ops[np.uint64(n)] = symbol_op(ccum, row, c2)
                    n += 1
                    if observe(ccnt, row, CHUNK_ALPHABET, c2):
                        model_rebuild(ccum, ccnt, row, CHUNK_ALPHABET)
                    n = put_raw(ops, n, z, rest)
        grp += 1
    val_out = np.empty(HEAD_BYTES + 2 * n, np.uint8)
    val_len = code_ops(ops, n, val_out)
    return pos_out[:pos_len], val_out[:val_len]


@njit(cache=True, nogil=True, boundscheck=False)
def ans_decode_ranks(n, size, vbits, pos_buf, val_buf, count, gkey, gstart, ranks, zs):
    """Decode both ans streams of a segment over n elements, without the base words: the group
    table and, group-major, each change's rank within its group and its value (the contract of
    ctx_kernels.ctx_decode_ranks, so `place.ctx_place` places either). Returns the number of
    groups or a negative status. Every loop is bounded by count, n or the stream's length.
    """
    xa, xb, i, words, status = dec_init(pos_buf)
    if status < 0:
        return status
    icum, icnt = models(INT_SLOTS, INT_ALPHABET)
    ng, xa, xb, i = _get_int(xa, xb, i, pos_buf, icum, icnt, SLOT_NGROUPS)
    if i > words:
        return STREAM_OVERRUN
    if ng > np.uint64(size) or (ng == np.uint64(0)) != (count == 0):
        return BAD_CODE
    ngroups = np.int64(ng)
    gk = np.empty(ngroups, np.int64)
    kmax = bit_length_u64(np.uint64(n))  # 2^k ≤ 2n: a remainder never needs more
    gstart[0] = 0
    prev = np.int64(-1)
    for grp in range(ngroups):
        dk, xa, xb, i = _get_int(xa, xb, i, pos_buf, icum, icnt, SLOT_KEY)
        c, xa, xb, i = _get_int(xa, xb, i, pos_buf, icum, icnt, SLOT_COUNT)
        rk, xa, xb, i = _get_int(xa, xb, i, pos_buf, icum, icnt, SLOT_RICE)
        if i > words:
            return STREAM_OVERRUN
        if dk >= np.uint64(size) or c >= np.uint64(count) or rk > np.uint64(kmax):
            return BAD_CODE
        key = prev + 1 + np.int64(dk)
        if key >= size:
            return BAD_CODE
        gkey[grp] = key
        prev = key
        gstart[grp + 1] = gstart[grp] + np.int64(c) + 1
        if gstart[grp + 1] > count:
            return BAD_CODE
        gk[grp] = np.int64(rk)
    if gstart[ngroups] != count:
        return BAD_CODE

    # both streams at once, change by change (positions in states xa/xb, values in ya/yb):
    # two independent chains of dependent steps, each filling the other's waits
    ya, yb, j, vwords, status = dec_init(val_buf)
    if status < 0:
        return status
    qcum, qcnt = models(1, Q_ALPHABET)
    ha = head_alphabet(vbits)
    hcum, hcnt = models(1, ha)
    ccum, ccnt = models(chunk_contexts(vbits), CHUNK_ALPHABET)
    for grp in range(ngroups):
        k = gk[grp]
        r = np.int64(-1)
        model_enter(qcum, qcnt, 0, Q_ALPHABET, grp)  # every group codes at least one change
        model_enter(hcum, hcnt, 0, ha, grp)
        first = gstart[grp]
        due = first  # the change whose counts rebuild the tables (next_rebuild)
        for t in range(first, gstart[grp + 1]):
            q, xa, xb, i = dec_symbol(xa, xb, i, pos_buf, qcum, 0)
            h, ya, yb, j = dec_symbol(ya, yb, j, val_buf, hcum, 0)
            qcnt[0, q] += WEIGHT
            hcnt[0, h] += WEIGHT
            if t == due:
                due = first + next_rebuild(t - first + 1) - 1
                model_rebuild(qcum, qcnt, 0, Q_ALPHABET)
                model_rebuild(hcum, hcnt, 0, ha)
            if q == Q_ALPHABET - 1:
                esc, xa, xb, i = _get_int(xa, xb, i, pos_buf, icum, icnt, SLOT_ESCAPE)
                if esc >= np.uint64(n):
                    return BAD_CODE
                q += np.int64(esc)
            if q > (n - 1) >> k:  # q·2^k ≥ n: a gap past any range
                return BAD_CODE
            rem, xa, xb, i = get_raw(xa, xb, i, pos_buf, k)
            if i > words:
                return STREAM_OVERRUN
            r += 1 + (q << k) + np.int64(rem)
            if r >= n:
                return POSITION_OUT_OF_RANGE
            ranks[np.uint64(t)] = r  # unsigned: see codec.ans (Indices)
            z = np.uint64(h)
            if h >= SMALL:
                nb = h - SMALL + SMALL_BITS + 1
                t1 = min(nb - 1, CHUNK_BITS)
                rest = nb - 1 - t1
                if ccnt[nb, CHUNK_ALPHABET + 2] != grp:
                    model_enter(ccum, ccnt, nb, CHUNK_ALPHABET, grp)
                c1, ya, yb, j = dec_symbol(ya, yb, j, val_buf, ccum, nb)
                if observe(ccnt, nb, CHUNK_ALPHABET, c1):
                    model_rebuild(ccum, ccnt, nb, CHUNK_ALPHABET)
                if c1 >> t1:
                    return BAD_CODE
                z = (_U1 << np.uint64(nb - 1)) | (np.uint64(c1) << np.uint64(rest))
                if rest > 0:
                    t2 = min(rest, CHUNK_BITS)
                    rest -= t2
                    row = vbits + 1 + nb * CHUNK_ALPHABET + c1
                    if ccnt[row, CHUNK_ALPHABET + 2] != grp:
                        model_enter(ccum, ccnt, row, CHUNK_ALPHABET, grp)
                    c2, ya, yb, j = dec_symbol(ya, yb, j, val_buf, ccum, row)
                    if observe(ccnt, row, CHUNK_ALPHABET, c2):
                        model_rebuild(ccum, ccnt, row, CHUNK_ALPHABET)
                    if c2 >> t2:
                        return BAD_CODE
                    low, ya, yb, j = get_raw(ya, yb, j, val_buf, rest)
                    z |= (np.uint64(c2) << np.uint64(rest)) | low
            if j > vwords:
                return STREAM_OVERRUN
            zs[np.uint64(t)] = z
    status = dec_finish(xa, xb, i, words)
    if status < 0:
        return status
    status = dec_finish(ya, yb, j, vwords)
    if status < 0:
        return status
    return ngroups
