"""Compiled inner loops of the delta codec (numba, nogil, cached on disk).

All kernels work on flat unsigned-integer numpy views of bit patterns (uint8/16/32/64) and do
their own bounds checks: they run on untrusted payloads, with numba's boundscheck off for speed,
so every read of a stream and every write of a position is checked explicitly and a violation
returns a negative status instead of touching memory. Positive or zero status = elements done.

Value arithmetic happens in uint64 with an explicit width mask, so one kernel serves every width
(numba specialises it per array dtype). Never mix uint64 with signed ints here: numpy/numba
promote that to float64.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# Status codes returned by the decode kernels (negative = refused, nothing past that point done).
STREAM_OVERRUN = -1  # a varint or value ran past the end of its stream
POSITION_OUT_OF_RANGE = -2  # a decoded position beyond the segment's range
TRAILING_BYTES = -3  # the stream has bytes left over after `count` entries
BAD_VARINT = -4  # a varint longer than 10 bytes

OP_XOR = 1
OP_ADD = 2
OP_OVERWRITE = 3

VAL_RAW = 1  # full words, little-endian
VAL_VARINT = 2  # unsigned LEB128 varint (XOR values)
VAL_ZIGZAG = 3  # zigzag LEB128 varint of the wrap-around difference (ADD values)

_U1 = np.uint64(1)
_U7F = np.uint64(0x7F)
_U80 = np.uint64(0x80)
_ZERO = np.uint64(0)


@njit(cache=True, nogil=True, boundscheck=False)
def find_changed_words(a64, b64, lanes, lane_bits, out):
    """Positions (in elements) where two arrays differ, compared 8 bytes at a time.

    a64/b64 are uint64 views of the two bit arrays; each word holds `lanes` elements of
    `lane_bits` bits. Writes element positions into `out` and returns how many.
    Unchanged words (the vast majority at RL change rates) cost one XOR and one compare.
    """
    k = 0
    lane_mask = (_U1 << np.uint64(lane_bits)) - _U1 if lane_bits < 64 else ~_ZERO
    for i in range(a64.shape[0]):
        x = a64[i] ^ b64[i]
        if x != _ZERO:
            base = i * lanes
            for j in range(lanes):
                # branchless: always write, advance only when this lane changed
                out[k] = base + j
                k += ((x >> np.uint64(j * lane_bits)) & lane_mask) != _ZERO
    return k


@njit(cache=True, nogil=True, boundscheck=False)
def find_changed_tail(a, b, start, out, k):
    for i in range(start, a.shape[0]):
        if a[i] != b[i]:
            out[k] = i
            k += 1
    return k


@njit(cache=True, nogil=True, boundscheck=False)
def encode_gaps(pos, count, out):
    """Varint of (gap - 1) between consecutive positions (the first from -1). Returns bytes used."""
    g = 0
    prev = -1
    for t in range(count):
        p = pos[t]
        v = np.uint64(p - prev - 1)
        prev = p
        while v >= _U80:
            out[g] = np.uint8((v & _U7F) | _U80)
            g += 1
            v >>= np.uint64(7)
        out[g] = np.uint8(v)
        g += 1
    return g


@njit(cache=True, nogil=True, boundscheck=False)
def encode_values(old, new, pos, count, codec, mask, sign_shift, out):
    """Encode the values at `pos` as XOR varints, zigzag differences or raw words. Returns bytes.

    `mask` is 2**bits-1 for the element width; `sign_shift` is bits-1.
    """
    v = 0
    width = new.itemsize
    for t in range(count):
        p = pos[t]
        n = np.uint64(new[p])
        if codec == VAL_RAW:
            for b in range(width):
                out[v] = np.uint8((n >> np.uint64(8 * b)) & np.uint64(0xFF))
                v += 1
            continue
        o = np.uint64(old[p])
        if codec == VAL_VARINT:
            z = o ^ n
        else:
            d = (n - o) & mask
            z = ((d << _U1) & mask) ^ (mask if (d >> np.uint64(sign_shift)) & _U1 else _ZERO)
        while z >= _U80:
            out[v] = np.uint8((z & _U7F) | _U80)
            v += 1
            z >>= np.uint64(7)
        out[v] = np.uint8(z)
        v += 1
    return v


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _read_varint(buf, i, end):
    """Returns (value, next index); next index < 0 on overrun or an over-long varint."""
    v = _ZERO
    shift = 0
    while True:
        if i >= end:
            return _ZERO, STREAM_OVERRUN
        c = np.uint64(buf[i])
        i += 1
        v |= (c & _U7F) << np.uint64(shift)
        if c < _U80:
            return v, i
        shift += 7
        if shift > 63:
            return _ZERO, BAD_VARINT


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _apply_one(dst, p, op, codec, vals, vi, vend, mask, width, undo_pos, undo_val, t):
    """Apply the t-th value at position p. Returns the next value index (<0 on overrun)."""
    if codec == VAL_RAW:
        if vi + width > vend:
            return STREAM_OVERRUN
        z = _ZERO
        for b in range(width):
            z |= np.uint64(vals[vi + b]) << np.uint64(8 * b)
        vi += width
    else:
        z, vi = _read_varint(vals, vi, vend)
        if vi < 0:
            return vi
    o = np.uint64(dst[p])
    undo_pos[t] = p
    undo_val[t] = dst[p]
    if op == OP_XOR:
        dst[p] = (o ^ z) & mask
    elif op == OP_ADD:
        d = (z >> _U1) ^ (mask if z & _U1 else _ZERO)
        dst[p] = (o + d) & mask
    else:
        dst[p] = z & mask
    return vi


@njit(cache=True, nogil=True, boundscheck=False)
def apply_gap_stream(dst, gaps, op, codec, vals, count, mask, undo_pos, undo_val):
    """Fused decode + apply of a gap-coded segment into dst (the segment's range), in place.

    Records (position, old word) of every element it changes into undo_pos/undo_val, so a
    failure at any point can be rolled back exactly. Returns (status, done): status is `count`
    on success or a negative code; `done` entries of undo_* are valid either way.
    """
    n = dst.shape[0]
    width = dst.itemsize
    gi = 0
    gend = gaps.shape[0]
    vi = 0
    vend = vals.shape[0]
    p = -1
    for t in range(count):
        g, gi = _read_varint(gaps, gi, gend)
        if gi < 0:
            return gi, t
        if g >= np.uint64(n):
            return POSITION_OUT_OF_RANGE, t
        p = p + 1 + np.int64(g)
        if p >= n:
            return POSITION_OUT_OF_RANGE, t
        vi = _apply_one(dst, p, op, codec, vals, vi, vend, mask, width, undo_pos, undo_val, t)
        if vi < 0:
            return vi, t
    if gi != gend or vi != vend:
        return TRAILING_BYTES, count
    return count, count


@njit(cache=True, nogil=True, boundscheck=False)
def apply_positions(dst, pos, op, codec, vals, count, mask, undo_pos, undo_val):
    """Apply values at an already decoded, strictly increasing position array (see apply_gap_stream)."""
    n = dst.shape[0]
    width = dst.itemsize
    vi = 0
    vend = vals.shape[0]
    prev = -1
    for t in range(count):
        p = pos[t]
        if p <= prev or p >= n:
            return POSITION_OUT_OF_RANGE, t
        prev = p
        vi = _apply_one(dst, p, op, codec, vals, vi, vend, mask, width, undo_pos, undo_val, t)
        if vi < 0:
            return vi, t
    if vi != vend:
        return TRAILING_BYTES, count
    return count, count


@njit(cache=True, nogil=True, boundscheck=False)
def restore(dst, undo_pos, undo_val, done):
    """Write back the recorded old words (idempotent: safe to run twice)."""
    for t in range(done - 1, -1, -1):
        dst[undo_pos[t]] = undo_val[t]


# --- positions grouped by the old value's exponent -------------------------------------------
# The chance that a weight changes depends strongly on its magnitude (rate ∝ lr / ulp(|w|)), and
# the receiver knows the old weights. So positions are coded per group of elements sharing the
# old exponent, as gaps in that group's own index space: the gaps are more regular and compress
# 30-40% better than global gaps. Decoding needs one scan over the old exponents.


@njit(cache=True, nogil=True, boundscheck=False)
def group_ranks(old, pos, count, shift, gmask, keys, ranks):
    """For each changed position: its group key (old exponent) and rank within that group.

    Counts with 4 interleaved tables so consecutive same-key updates do not serialise on one
    memory location; a rank is the sum over the tables (all elements before it).
    """
    n = old.shape[0]
    cnt = np.zeros((4, int(gmask) + 1), np.int64)
    t = 0
    nxt = pos[0] if count > 0 else n
    sh = np.uint64(shift)
    for i in range(n):
        e = (np.uint64(old[i]) >> sh) & gmask
        lane = i & 3
        if i == nxt:
            keys[t] = e
            ranks[t] = cnt[0, e] + cnt[1, e] + cnt[2, e] + cnt[3, e]
            t += 1
            nxt = pos[t] if t < count else n
        cnt[lane, e] += 1
    return t


@njit(cache=True, nogil=True, boundscheck=False)
def decode_group_positions(old, shift, gmask, gkeys, gcounts, gaps, count, out):
    """Recover changed positions (in increasing order) from per-group rank gaps.

    gkeys/gcounts: the group table (keys distinct, each < gmask+1). Returns count or <0.
    """
    n = old.shape[0]
    ng = gkeys.shape[0]
    size = int(gmask) + 1
    nxt = np.full(size, -1, np.int64)  # next changed rank per group, -1 = none left
    left = np.zeros(size, np.int64)
    gpos = np.zeros(size, np.int64)  # read index into `gaps` per group
    gend = gaps.shape[0]
    # locate each group's sub-stream: varints are not indexable, so skip through them once
    i = 0
    total = 0
    for g in range(ng):
        k = int(gkeys[g])
        gpos[k] = i
        left[k] = gcounts[g]
        total += gcounts[g]
        for _ in range(gcounts[g]):
            _, i = _read_varint(gaps, i, gend)
            if i < 0:
                return i
    if i != gend:
        return TRAILING_BYTES
    if total != count:
        return STREAM_OVERRUN
    for g in range(ng):
        k = int(gkeys[g])
        if left[k] > 0:
            v, gpos[k] = _read_varint(gaps, gpos[k], gend)
            nxt[k] = np.int64(v)
    cnt = np.zeros((4, size), np.int64)
    t = 0
    sh = np.uint64(shift)
    for i in range(n):
        e = (np.uint64(old[i]) >> sh) & gmask
        r = cnt[0, e] + cnt[1, e] + cnt[2, e] + cnt[3, e]
        if r == nxt[e]:
            out[t] = i
            t += 1
            left[e] -= 1
            if left[e] > 0:
                v, gpos[e] = _read_varint(gaps, gpos[e], gend)
                nxt[e] = r + 1 + np.int64(v)
            else:
                nxt[e] = -1
        cnt[i & 3, e] += 1
    if t != count:
        return POSITION_OUT_OF_RANGE
    return t


@njit(cache=True, nogil=True, boundscheck=False)
def byte_histogram(buf, hist):
    for i in range(buf.shape[0]):
        hist[buf[i]] += 1
