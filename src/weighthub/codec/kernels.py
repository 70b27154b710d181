"""Compiled inner loops of the delta codec (numba, nogil, cached on disk).

All kernels work on flat unsigned-integer numpy views of bit patterns (uint8/16/32/64) and do
their own bounds checks: they run on untrusted payloads, with numba's boundscheck off for speed,
so every read of a stream and every write of a position is checked explicitly and a violation
returns a negative status instead of touching memory. Positive or zero status = elements done.

Value arithmetic happens in uint64 with an explicit width mask, so one kernel serves every width
(numba specialises it per array dtype). Never mix uint64 with signed ints here: numpy/numba
promote that to float64.

Where the time goes (2-core CPU, 64M bf16 elements, 1-3% changed): the encoder's single pass
over old/new is memory-bound (~20 ms), so everything per changed element is done in that pass
on words already in cache (positions, old and new values compacted into small arrays); the
value streams are then built from the compact arrays instead of by random access. Exponent
groups need a pass over every old element; those loops keep four count tables so that
consecutive updates of a common key do not serialise on one memory location.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ..digest.mix import K0, K1, fold, fold_weyl
from ..kernel_cache import njit
from .coding import Op, Values
from .place_vectors import BLOCK, change_mask

# Status codes returned by the decode kernels (negative = refused, nothing past that point done).
STREAM_OVERRUN = -1  # a varint or value ran past the end of its stream
POSITION_OUT_OF_RANGE = -2  # a decoded position beyond the segment's range
TRAILING_BYTES = -3  # the stream has bytes left over after `count` entries
BAD_VARINT = -4  # a varint longer than 10 bytes
BAD_CODE = -5  # an entropy-coded stream decodes to a value the format forbids

# the wire ids (codec.coding) as plain ints: numba folds module-level ints as constants
OP_XOR, OP_ADD, OP_OVERWRITE = int(Op.XOR), int(Op.ADD), int(Op.OVERWRITE)
# Kernel-only (never a wire op id): ADD applied inversely, new = old - difference. XOR is its own
# inverse, so undoing a delta needs just this one more op.
OP_SUB = 16

VAL_RAW, VAL_VARINT, VAL_ZIGZAG = int(Values.RAW), int(Values.VARINT), int(Values.ZIGZAG)

# Blocks of BLOCK elements per chunk of scan_blocks: a chunk's words stay in L1 for its second
# phase (2 x 4 KiB of bf16 words, as the word-wide scan before it found best).
SCAN_CHUNK = 32

_U1 = np.uint64(1)
_U7F = np.uint64(0x7F)
_U80 = np.uint64(0x80)
_ZERO = np.uint64(0)
_NEVER = np.int64(1) << np.int64(62)  # a skip count no segment reaches


# --- change detection -------------------------------------------------------------------------


@intrinsic
def trailing_zeros(typingctx, x):
    """The index of the lowest set bit of a uint64 x ≠ 0 (LLVM's cttz: one instruction; 0 gives
    an undefined result)."""
    if x != types.uint64:
        return None

    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))

    return types.int64(x), codegen


@intrinsic
def count_ones(typingctx, x):
    """The set bits of a uint64 (LLVM's ctpop: one instruction where the CPU has one)."""
    if x != types.uint64:
        return None

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return types.int64(x), codegen


@intrinsic
def bit_length(typingctx, x):
    """The bits of a uint64 up to its highest set bit (0 for 0): 64 less LLVM's ctlz, one
    instruction (lzcnt) where the CPU has one. A shift-and-count loop took ~5 ns a value in
    the ans encoder (numba's loop is not one that LLVM recognizes as a ctlz)."""
    if x != types.uint64:
        return None

    def codegen(context, builder, signature, args):
        return builder.sub(ir.Constant(ir.IntType(64), 64),
                           builder.ctlz(args[0], ir.Constant(ir.IntType(1), 0)))

    return types.int64(x), codegen


@intrinsic
def prefetch(typingctx, arr, index):
    """Ask the cache for arr[index] ahead of its use (LLVM's prefetch: a read, kept close). A
    hint only: it never faults, so an index past the end is harmless and needs no clamp."""
    if not isinstance(arr, types.Array) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte_ptr = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic(
            "llvm.prefetch", [byte_ptr], ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32]))
        # (address, 0: read, 3: keep in all levels, 1: data)
        builder.call(fn, [builder.bitcast(builder.gep(data, [args[1]]), byte_ptr),
                          ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.none(arr, index), codegen


@njit(cache=True, nogil=True, boundscheck=False)
def scan_blocks(old, new, b, k, out_pos, out_old, out_new, where, masks):
    """The changed elements of old → new (arrays of one word type) from element b (a multiple
    of BLOCK) on, written from slot k: each one's position, old and new word. Returns (k, b)
    where it stopped: after the last whole block, or where the outputs might not hold one more
    chunk's changes (the caller grows them and calls again). where/masks: SCAN_CHUNK slots.

    Two phases per chunk of SCAN_CHUNK blocks: a branch-free pass lists the blocks holding a
    change with their lanes (one vector compare a block: `place_vectors.change_mask`; a branch
    per block would mispredict at 1% changed, where half the blocks hold one), then each listed
    block writes its changes, lowest lane first (most hold one: the loop's exit is
    predictable). Against the word-wide scan that came before (8 bytes compared at a time, each
    nonzero word listed), on MiniLM's 39 tensors of more than 4096 words at 0.3 / 1 / 3 / 20%
    changed, one thread, best of 9: 0.72 / 0.78 / 0.71 / 0.66x its time.
    """
    n = old.shape[0]
    full = np.uint64(n - n % BLOCK)
    chunk = np.uint64(SCAN_CHUNK * BLOCK)
    cap = np.uint64(out_pos.shape[0])
    j = np.uint64(k)
    w = np.uint64(b)
    while w < full and j + chunk <= cap:
        hi = min(full, w + chunk)
        found = _ZERO
        x = w
        while x < hi:
            m = change_mask(old, new, x)
            where[found] = x
            masks[found] = m
            found += np.uint64(m != _ZERO)
            x += np.uint64(BLOCK)
        for q in range(found):
            x = where[q]
            m = masks[q]
            while True:  # a listed block holds at least one change
                p = x + np.uint64(trailing_zeros(m))
                out_pos[j] = p
                out_old[j] = old[p]
                out_new[j] = new[p]
                j += _U1
                m &= m - _U1
                if m == _ZERO:
                    break
        w = hi
    return np.int64(j), np.int64(w)


@njit(cache=True, nogil=True, boundscheck=False)
def positions_bitmap(pos, out):
    """The bitmap of positions `pos` (each < 8 len(out)) into `out` (zeroed): bit i of byte j
    for element 8j + i. numpy's packbits of a boolean mask wrote and read a byte per element:
    5.3 ms for a 28M-element tensor at 7% changed, this 1.5."""
    for t in range(pos.shape[0]):
        p = pos[t]
        out[p >> 3] |= np.uint8(1 << (p & 7))


@njit(cache=True, nogil=True, boundscheck=False)
def bitmap_positions(bitmap, out):
    """The positions of the set bits of a bitmap (bit i of byte j: element 8j + i), increasing,
    into `out`. Returns how many there are, or len(out) + 1 as soon as there are more than
    `out` holds (nothing written past it).

    Eight bytes at a time, each set bit's position from the count of trailing zeros: numpy's
    unpackbits and flatnonzero wrote and read a byte per element, 77 ms for a 28M-element
    bitmap with 7% of its bits set, where this takes 4.7 (best of 5, side by side).
    """
    cap = out.shape[0]
    nb = bitmap.shape[0]
    k = 0
    for w in range(nb // 8):
        x = _ZERO  # the 8 bytes as a little-endian word (LLVM makes it one load)
        for i in range(8):
            x |= np.uint64(bitmap[8 * w + i]) << np.uint64(8 * i)
        first = 64 * w
        while x != _ZERO:
            if k == cap:
                return cap + 1
            out[k] = first + trailing_zeros(x)
            k += 1
            x &= x - _U1
    for b in range(nb // 8 * 8, nb):
        x = np.uint64(bitmap[b])
        while x != _ZERO:
            if k == cap:
                return cap + 1
            out[k] = 8 * b + trailing_zeros(x)
            k += 1
            x &= x - _U1
    return k


@njit(cache=True, nogil=True, boundscheck=False)
def scan_tail(a, b, lo, hi, out_pos, out_old, out_new, k):
    """Element-wise scan_blocks for [lo, hi) (the last partial block, short ranges). Caller
    guarantees capacity."""
    for i in range(lo, hi):
        if a[i] != b[i]:
            out_pos[k] = i
            out_old[k] = a[i]
            out_new[k] = b[i]
            k += 1
    return k


# --- encoding ---------------------------------------------------------------------------------


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _put_varint(out, g, v):
    while v >= _U80:
        out[g] = np.uint8((v & _U7F) | _U80)
        g += 1
        v >>= np.uint64(7)
    out[g] = np.uint8(v)
    return g + 1


@njit(cache=True, nogil=True, boundscheck=False)
def encode_gaps(pos, count, out):
    """Varint of (gap - 1) between consecutive positions (the first from -1). Returns bytes used."""
    g = 0
    prev = -1
    for t in range(count):
        p = pos[t]
        g = _put_varint(out, g, np.uint64(p - prev - 1))
        prev = p
    return g


@njit(cache=True, nogil=True, boundscheck=False)
def encode_varints(vals, count, out):
    """One varint per uint64 value (already XOR or zigzag). Returns bytes used."""
    g = 0
    for t in range(count):
        g = _put_varint(out, g, vals[t])
    return g


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _zigzag(o, n, mask, sign_shift):
    d = (n - o) & mask
    return ((d << _U1) & mask) ^ (mask if (d >> np.uint64(sign_shift)) & _U1 else _ZERO)


@njit(cache=True, nogil=True, boundscheck=False)
def encode_values(oldv, newv, count, codec, mask, sign_shift, out):
    """Encode compacted (old, new) word pairs as XOR varints, zigzag differences or raw words.

    `mask` is 2**bits-1 for the element width; `sign_shift` is bits-1. Returns bytes used.
    """
    v = 0
    width = newv.itemsize
    for t in range(count):
        n = np.uint64(newv[t])
        if codec == VAL_RAW:
            for b in range(width):
                out[v] = np.uint8((n >> np.uint64(8 * b)) & np.uint64(0xFF))
                v += 1
            continue
        o = np.uint64(oldv[t])
        z = o ^ n if codec == VAL_VARINT else _zigzag(o, n, mask, sign_shift)
        v = _put_varint(out, v, z)
    return v


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _count_varint(hist, v):
    while v >= _U80:
        hist[(v & _U7F) | _U80] += 1
        v >>= np.uint64(7)
    hist[v] += 1


@njit(cache=True, nogil=True, boundscheck=False)
def value_histograms(oldv, newv, count, stride, mask, sign_shift, h_zigzag, h_xor, h_raw):
    """Byte histograms of the three value streams, over every `stride`-th pair, unwritten.

    Enough to choose the value coding by entropy without encoding the losing candidates.
    """
    width = newv.itemsize
    for t in range(0, count, stride):
        o = np.uint64(oldv[t])
        n = np.uint64(newv[t])
        _count_varint(h_zigzag, _zigzag(o, n, mask, sign_shift))
        _count_varint(h_xor, o ^ n)
        for b in range(width):
            h_raw[(n >> np.uint64(8 * b)) & np.uint64(0xFF)] += 1


@njit(cache=True, nogil=True, boundscheck=False)
def value_estimates(oldv, newv, count, stride, mask, sign_shift, scale):
    """Estimated bytes (`entropy_of_hist`) of the zigzag, xor and raw value streams from the
    histograms of every `stride`-th pair (`value_histograms`), each `scale` times as long:
    one call per segment where three histograms and three estimates in Python cost ~40 µs."""
    h_zigzag = np.zeros(256, np.int64)
    h_xor = np.zeros(256, np.int64)
    h_raw = np.zeros(256, np.int64)
    value_histograms(oldv, newv, count, stride, mask, sign_shift, h_zigzag, h_xor, h_raw)
    return (entropy_of_hist(h_zigzag, scale), entropy_of_hist(h_xor, scale),
            entropy_of_hist(h_raw, scale))


@njit(cache=True, nogil=True, boundscheck=False)
def stream_estimate(buf):
    """Estimated bytes (`entropy_of_hist`) of a byte stream once compressed."""
    hist = np.zeros(256, np.int64)
    for i in range(buf.shape[0]):
        hist[buf[i]] += 1
    return entropy_of_hist(hist, 1.0)


@njit(cache=True, nogil=True, boundscheck=False)
def entropy_of_hist(hist, scale):
    """Order-0 entropy in bytes of a stream with this byte histogram, `scale` times as long, plus
    16 bytes of table (0 for an empty stream): what zstd-1's Huffman stage approaches."""
    total = 0
    for s in range(hist.shape[0]):
        total += hist[s]
    if total == 0:
        return 0.0
    bits = 0.0
    for s in range(hist.shape[0]):
        if hist[s] > 0:
            p = hist[s] / total
            bits -= p * np.log2(p)
    return bits * total * scale / 8 + 16


# --- decoding and applying --------------------------------------------------------------------


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _read_varint(buf, i, end):
    """Returns (value, next index); next index < 0 on overrun or an over-long varint."""
    if i < end and buf[i] < 0x80:  # one-byte fast path: most gaps and values at RL rates
        return np.uint64(buf[i]), i + 1
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
def _read_value(vals, vi, vend, codec, width):
    """The next value of a value stream: (value, next index); next index < 0 on a bad stream."""
    if codec == VAL_RAW:
        if vi + width > vend:
            return _ZERO, STREAM_OVERRUN
        z = _ZERO
        for b in range(width):
            z |= np.uint64(vals[vi + b]) << np.uint64(8 * b)
        return z, vi + width
    return _read_varint(vals, vi, vend)


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _combine(o, z, op, mask):
    """The new word from old word o and decoded value z under op."""
    if op == OP_XOR:
        return (o ^ z) & mask
    if op == OP_ADD:
        return (o + ((z >> _U1) ^ (mask if z & _U1 else _ZERO))) & mask
    if op == OP_SUB:  # uint64 wraps, and the mask reduces mod 2^B: exactly undoes OP_ADD
        return (o - ((z >> _U1) ^ (mask if z & _U1 else _ZERO))) & mask
    return z & mask


# The apply loops below read a value, then record and change the word, in that order and
# without a shared helper that returns status-or-index: written that way numba's output is
# ~1.6x faster (the loop runs near the speed of its memory accesses).
#
# They also fold the digest change (format/spec.md §4) of every word they rewrite into two
# optional sums, dnew += mix(i, new word) and dold += mix(i, old word), i = first + position,
# while both words are in registers: the receiver then verifies in O(changed) with no second
# pass over memory. dnew/dold are uint64[2], or empty (uint64[0]) for a sum not wanted: always
# arrays, so each kernel compiles once per word width (None would make numba compile a variant
# per combination; a cold CI run paid minutes for them), at the cost of a loop-invariant,
# predictable branch per changed word. The sums are written only on success. The fold does
# not care which way a delta runs: applied inversely (undoing it), "new" is the base's word it
# writes back and "old" the word it replaces, so the held digest plus dnew - dold is the
# base's digest. The words are not read back after writing: that proves what the kernel
# wrote, not what memory holds, which is the same thing unless another view of the target
# overlaps this one in memory (the receiver refuses such targets; see receive/).


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _store(out, s0, s1):
    out[0] += s0
    out[1] += s1


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _gap_loop(dst, gaps, op, codec, vals, count, mask, undo_pos, undo_val, first, dnew, dold):
    n = dst.shape[0]
    want_new = dnew.shape[0] != 0
    want_old = dold.shape[0] != 0
    f1 = np.uint64(first) + _U1
    n0 = n1 = o0 = o1 = _ZERO
    width = dst.itemsize
    gi = 0
    gend = gaps.shape[0]
    vi = 0
    vend = vals.shape[0]
    p = np.int64(-1)
    for t in range(count):
        g, gi = _read_varint(gaps, gi, gend)
        if gi < 0:
            return gi, t
        if g >= np.uint64(n - 1 - p):  # p + 1 + g must stay below n (p >= -1, so no wrap)
            return POSITION_OUT_OF_RANGE, t
        p = p + 1 + np.int64(g)
        z, vi = _read_value(vals, vi, vend, codec, width)
        if vi < 0:
            return vi, t
        o = dst[p]
        undo_pos[t] = p
        undo_val[t] = o
        w = _combine(np.uint64(o), z, op, mask)
        dst[p] = w
        if want_new:
            n0, n1 = fold(n0, n1, f1 + np.uint64(p), w)
        if want_old:
            o0, o1 = fold(o0, o1, f1 + np.uint64(p), np.uint64(o))
    if gi != gend or vi != vend:
        return TRAILING_BYTES, count
    if want_new:
        _store(dnew, n0, n1)
    if want_old:
        _store(dold, o0, o1)
    return count, count


@njit(cache=True, nogil=True, boundscheck=False)
def apply_gap_stream(dst, gaps, op, codec, vals, count, mask, undo_pos, undo_val, first, dnew,
                     dold):
    """Fused decode + apply of a gap-coded segment into dst (the segment's range), in place.

    Records (position, old word) of every element it changes into undo_pos/undo_val, so a
    failure at any point can be rolled back exactly. Returns (status, done): status is `count`
    on success or a negative code; `done` entries of undo_* are valid either way. On success,
    adds the digest lanes of the new / old words to dnew / dold (see above); dst[0] is
    canonical element `first`.

    The loop is inlined once more for the usual (op, codec) pair with constant arguments, so
    the compiler drops the per-element dispatch; and for its inverse (a rollback through
    deltas), which runs in the pause too.
    """
    if op == OP_ADD and codec == VAL_ZIGZAG:
        return _gap_loop(dst, gaps, OP_ADD, VAL_ZIGZAG, vals, count, mask, undo_pos, undo_val,
                         first, dnew, dold)
    if op == OP_SUB and codec == VAL_ZIGZAG:
        return _gap_loop(dst, gaps, OP_SUB, VAL_ZIGZAG, vals, count, mask, undo_pos, undo_val,
                         first, dnew, dold)
    return _gap_loop(dst, gaps, op, codec, vals, count, mask, undo_pos, undo_val, first, dnew, dold)


@njit(cache=True, nogil=True, boundscheck=False)
def apply_positions(dst, pos, op, codec, vals, count, mask, undo_pos, undo_val, first, dnew,
                    dold):
    """Apply values at an already decoded, strictly increasing position array (see apply_gap_stream)."""
    n = dst.shape[0]
    want_new = dnew.shape[0] != 0
    want_old = dold.shape[0] != 0
    f1 = np.uint64(first) + _U1
    n0 = n1 = o0 = o1 = _ZERO
    width = dst.itemsize
    vi = 0
    vend = vals.shape[0]
    prev = -1
    for t in range(count):
        p = pos[t]
        if p <= prev or p >= n:
            return POSITION_OUT_OF_RANGE, t
        prev = p
        z, vi = _read_value(vals, vi, vend, codec, width)
        if vi < 0:
            return vi, t
        o = dst[p]
        undo_pos[t] = p
        undo_val[t] = o
        w = _combine(np.uint64(o), z, op, mask)
        dst[p] = w
        if want_new:
            n0, n1 = fold(n0, n1, f1 + np.uint64(p), w)
        if want_old:
            o0, o1 = fold(o0, o1, f1 + np.uint64(p), np.uint64(o))
    if vi != vend:
        return TRAILING_BYTES, count
    if want_new:
        _store(dnew, n0, n1)
    if want_old:
        _store(dold, o0, o1)
    return count, count


@njit(cache=True, nogil=True, boundscheck=False)
def copy_words(dst, src, undo, first, dnew, dold):
    """Dense apply: dst[:] = src, saving the old words into `undo` (or empty: nothing to keep).

    One pass that also folds the digest lanes of the new / old words into dnew / dold (empty to
    skip), as the sparse apply kernels do; dst[0] is canonical element `first`.
    """
    keep = undo.shape[0] != 0
    want_new = dnew.shape[0] != 0
    want_old = dold.shape[0] != 0
    f1 = np.uint64(first) + _U1
    k0 = f1 * K0  # Weyl sequences: one add per element along the run
    k1 = f1 * K1
    n0 = n1 = o0 = o1 = _ZERO
    for j in range(dst.shape[0]):
        o = dst[j]
        w = src[j]
        if keep:
            undo[j] = o
        dst[j] = w
        if want_new:
            n0, n1 = fold_weyl(n0, n1, k0, k1, np.uint64(w))
        if want_old:
            o0, o1 = fold_weyl(o0, o1, k0, k1, np.uint64(o))
        k0 += K0
        k1 += K1
    if want_new:
        _store(dnew, n0, n1)
    if want_old:
        _store(dold, o0, o1)


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
#
# Stream layout: varints ngroups, then (key, count) per group in increasing key order, then per
# group (same order) the varints of (rank gap - 1) of its changed elements, where an element's
# rank is the number of earlier elements of the range in the same group.


@njit(cache=True, nogil=True, boundscheck=False)
def group_ranks(old, pos, count, shift, gmask, keys, ranks):
    """For each changed position (strictly increasing, < len(old)): group key and rank.

    Walks the changes rather than testing every element: between two changes a tight loop
    counts keys into four tables (one per lane of four, so consecutive equal keys do not wait
    on each other's stores); a rank is the sum over the tables. Returns the number of entries
    done, which is < count if `pos` is not strictly increasing within range.
    """
    n = old.shape[0]
    size = int(gmask) + 1
    c0 = np.zeros(size, np.int64)
    c1 = np.zeros(size, np.int64)
    c2 = np.zeros(size, np.int64)
    c3 = np.zeros(size, np.int64)
    sh = np.uint64(shift)
    i = 0
    for t in range(count):
        p = pos[t]
        if p < i or p >= n:
            return t
        while i + 4 <= p:
            c0[(np.uint64(old[i]) >> sh) & gmask] += 1
            c1[(np.uint64(old[i + 1]) >> sh) & gmask] += 1
            c2[(np.uint64(old[i + 2]) >> sh) & gmask] += 1
            c3[(np.uint64(old[i + 3]) >> sh) & gmask] += 1
            i += 4
        while i < p:
            c0[(np.uint64(old[i]) >> sh) & gmask] += 1
            i += 1
        e = (np.uint64(old[p]) >> sh) & gmask
        keys[t] = e
        ranks[t] = c0[e] + c1[e] + c2[e] + c3[e]
        c0[e] += 1
        i = p + 1
    return count


@njit(cache=True, nogil=True, boundscheck=False)
def group_starts(keys, count, size):
    """(start, ngroups) of `count` changes by key (< size): group e's changes are the
    [start[e], start[e + 1]) of a group-major order, ngroups the non-empty groups."""
    start = np.zeros(size + 1, np.int64)
    for t in range(count):
        start[keys[t] + _U1] += 1
    ngroups = 0
    for e in range(size):
        ngroups += start[e + 1] > 0
        start[e + 1] += start[e]
    return start, ngroups


@njit(cache=True, nogil=True, boundscheck=False)
def group_order(keys, count, size):
    """Group-major order of `count` changes by key (< size): a counting sort, stable, so ranks
    stay increasing within a group. Returns (start, order, ngroups): group e's changes are
    order[start[e]:start[e + 1]] (indexes into keys), ngroups the non-empty groups."""
    start, ngroups = group_starts(keys, count, size)
    order = np.empty(count, np.int64)
    fill = start[:size].copy()
    for t in range(count):
        e = keys[t]
        order[fill[e]] = t
        fill[e] += 1
    return start, order, ngroups


@njit(cache=True, nogil=True, boundscheck=False)
def encode_group_stream(keys, ranks, count, size, out):
    """The grouped position stream (layout above) from group_ranks' output. Returns bytes used;
    `out` must hold 10 * (count + 2 * size + 1) bytes."""
    start, order, ngroups = group_order(keys, count, size)
    g = _put_varint(out, 0, np.uint64(ngroups))
    for e in range(size):
        if start[e + 1] > start[e]:
            g = _put_varint(out, g, np.uint64(e))
            g = _put_varint(out, g, np.uint64(start[e + 1] - start[e]))
    sorted_ranks = ranks[order]
    for e in range(size):
        prev = -1
        for t in range(start[e], start[e + 1]):
            r = sorted_ranks[t]
            g = _put_varint(out, g, np.uint64(r - prev - 1))
            prev = r
    return g


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _group_cursors(n, gmask, gkeys, gcounts, gaps):
    """Per group: elements to skip before its next change, changes left, read index in `gaps`.

    Varints are not indexable, so each group's sub-stream is located by one pass through them
    (which also validates them all). Returns (status, skip, left, gpos); status < 0 on error.
    """
    size = int(gmask) + 1
    skip = np.full(size, _NEVER, np.int64)
    left = np.zeros(size, np.int64)
    gpos = np.zeros(size, np.int64)
    gend = gaps.shape[0]
    i = 0
    for g in range(gkeys.shape[0]):
        k = gkeys[g]
        gpos[k] = i
        left[k] = gcounts[g]
        for _ in range(gcounts[g]):
            _, i = _read_varint(gaps, i, gend)
            if i < 0:
                return i, skip, left, gpos
    if i != gend:
        return TRAILING_BYTES, skip, left, gpos
    for g in range(gkeys.shape[0]):
        k = gkeys[g]
        if left[k] > 0:
            v, gpos[k] = _read_varint(gaps, gpos[k], gend)  # validated by the pass above
            if v >= np.uint64(n):
                return POSITION_OUT_OF_RANGE, skip, left, gpos
            skip[k] = np.int64(v)
    return 0, skip, left, gpos


@njit(cache=True, nogil=True, boundscheck=False)
def apply_group_stream(dst, shift, gmask, gkeys, gcounts, gaps, op, codec, vals, count, mask,
                       undo_pos, undo_val, first, dnew, dold):
    """Fused decode + apply of an exponent-grouped segment into dst, in place.

    gkeys/gcounts: the parsed group table (keys distinct and < gmask+1, counts summing to
    count: the caller checks). Keys are read from dst before an element is changed, so they
    are the old exponents the encoder saw. Returns (status, done) as apply_gap_stream.

    Per group, `skip` holds how many more of its elements pass before its next changed one;
    an element is changed when its group's skip is 0. Groups without changes never reach 0.
    """
    n = dst.shape[0]
    want_new = dnew.shape[0] != 0
    want_old = dold.shape[0] != 0
    width = dst.itemsize
    gend = gaps.shape[0]
    status, skip, left, gpos = _group_cursors(n, gmask, gkeys, gcounts, gaps)
    if status < 0:
        return status, 0
    sh = np.uint64(shift)
    vi = 0
    vend = vals.shape[0]
    t = 0
    f1 = np.uint64(first) + _U1
    n0 = n1 = o0 = o1 = _ZERO
    for p in range(n):
        e = (np.uint64(dst[p]) >> sh) & gmask
        s = skip[e]
        if s != 0:
            skip[e] = s - 1
            continue
        if t >= count:  # more changes than entries: only a corrupt table can do this
            return POSITION_OUT_OF_RANGE, t
        z, vi = _read_value(vals, vi, vend, codec, width)
        if vi < 0:
            return vi, t
        o = dst[p]
        undo_pos[t] = p
        undo_val[t] = o
        w = _combine(np.uint64(o), z, op, mask)
        dst[p] = w
        if want_new:
            n0, n1 = fold(n0, n1, f1 + np.uint64(p), w)
        if want_old:
            o0, o1 = fold(o0, o1, f1 + np.uint64(p), np.uint64(o))
        t += 1
        left[e] -= 1
        if left[e] > 0:
            v, gpos[e] = _read_varint(gaps, gpos[e], gend)
            skip[e] = np.int64(v) if v < np.uint64(n) else _NEVER
        else:
            skip[e] = _NEVER
    if t != count:
        return POSITION_OUT_OF_RANGE, t
    if vi != vend:
        return TRAILING_BYTES, t
    if want_new:
        _store(dnew, n0, n1)
    if want_old:
        _store(dold, o0, o1)
    return t, t


# --- decoding to arrays (a destination elsewhere: device memory) ------------------------------
# A receiver whose target lives on a device decodes a segment's streams on the host into
# compact arrays (positions, values), checked exactly as the fused apply kernels check them;
# the device then gathers, combines and scatters (codec/device.py). Same refusals, same order.


@njit(cache=True, nogil=True, boundscheck=False)
def decode_gap_stream(gaps, codec, vals, count, n, width, out_pos, out_z):
    """Positions and values of a gap-coded segment over n elements of `width` bytes, into
    out_pos (increasing) and out_z (the values as coded: XOR, zigzag difference or raw word).
    Returns count or a negative status (as apply_gap_stream)."""
    gi = 0
    gend = gaps.shape[0]
    vi = 0
    vend = vals.shape[0]
    p = np.int64(-1)
    for t in range(count):
        g, gi = _read_varint(gaps, gi, gend)
        if gi < 0:
            return gi
        if g >= np.uint64(n - 1 - p):  # p + 1 + g must stay below n (p >= -1, so no wrap)
            return POSITION_OUT_OF_RANGE
        p = p + 1 + np.int64(g)
        z, vi = _read_value(vals, vi, vend, codec, width)
        if vi < 0:
            return vi
        out_pos[t] = p
        out_z[t] = z
    if gi != gend or vi != vend:
        return TRAILING_BYTES
    return count


@njit(cache=True, nogil=True, boundscheck=False)
def decode_value_stream(codec, vals, count, width, out_z):
    """The first `count` values of a value stream into out_z; count or a negative status."""
    vi = 0
    vend = vals.shape[0]
    for t in range(count):
        z, vi = _read_value(vals, vi, vend, codec, width)
        if vi < 0:
            return vi
        out_z[t] = z
    if vi != vend:
        return TRAILING_BYTES
    return count


@njit(cache=True, nogil=True, boundscheck=False)
def decode_group_ranks(gcounts, gaps, count, n, out):
    """Group-major ranks of an exponent-grouped segment over n elements (groups in table order,
    gcounts summing to count: the caller checks): rank = previous + 1 + gap, the first gap the
    first rank. Returns count or a negative status (a rank ≥ n: POSITION_OUT_OF_RANGE)."""
    gend = gaps.shape[0]
    i = 0
    t = 0
    for g in range(gcounts.shape[0]):
        r = np.int64(-1)
        for _ in range(gcounts[g]):
            v, i = _read_varint(gaps, i, gend)
            if i < 0:
                return i
            if v >= np.uint64(n - 1 - r):
                return POSITION_OUT_OF_RANGE
            r = r + 1 + np.int64(v)
            out[t] = r
            t += 1
    if i != gend:
        return TRAILING_BYTES
    return t


# --- digests of the words a segment will rewrite ---------------------------------------------


@njit(cache=True, nogil=True, boundscheck=False)
def sum_at_gaps(words, gaps, count, first, out):
    """out += Σ mix(first + p, words[p]) over the positions p of a gap-coded stream (spec §2).

    Returns count, or a negative status (as the apply kernels: a varint overrun or too long, a
    position past the end, bytes left over) with `out` untouched.
    """
    n = words.shape[0]
    gend = gaps.shape[0]
    gi = 0
    p = np.int64(-1)
    s0 = s1 = _ZERO
    f1 = np.uint64(first) + _U1
    for _ in range(count):
        g, gi = _read_varint(gaps, gi, gend)
        if gi < 0:
            return gi
        if g >= np.uint64(n - 1 - p):
            return POSITION_OUT_OF_RANGE
        p = p + 1 + np.int64(g)
        s0, s1 = fold(s0, s1, f1 + np.uint64(p), np.uint64(words[p]))
    if gi != gend:
        return TRAILING_BYTES
    out[0] += s0
    out[1] += s1
    return count
