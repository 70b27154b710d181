"""Placing decoded changes against the old words (the last step of a context-coded decode).

A context-coded segment (`ctx`, `ans`) codes each change as its rank among the range's elements
of the same old exponent (its key). The decoders give those ranks group-major; placing them is
finding, for each key, the elements whose rank among that key's elements is one of the ranks:
a pass over every old word. That pass, not the entropy coder, is most of a decode at low change
rates, so it runs two ways:

    _place         one word at a time, a count-down per key (any word type, any key size)
    _place_blocks  64 words at a time: each of the TOP keys most frequent in a sample is
                   counted in a block with a vector compare and a popcount, and only a block
                   where a count passes that key's next change, or where a word's key is none of
                   the TOP, is looked at word by word (keys of at most 8 bits: every float
                   format but fp64)

Both place exactly the same changes (tests/unit/test_place.py); `ctx_place` chooses. The
vector code is LLVM IR built here (`block_counts`, `block_masks`): generic vectors, which LLVM
lowers for whatever CPU it compiles for (AVX-512 compares into mask registers on this
machine's, narrower vectors elsewhere).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ..kernel_cache import njit
from .kernels import POSITION_OUT_OF_RANGE, count_ones, prefetch, trailing_zeros

PLACE_AHEAD = np.uint64(16)  # changes of a key ahead that _place prefetches (see there)
BLOCK = 64  # words a block: one bit each in a uint64 lane mask
TOP = 16  # keys counted by vector compares; the others word by word
SAMPLE = 8192  # words whose keys choose the TOP, spread over the range
BLOCKS_FROM = 8 * BLOCK  # ranges shorter than this are placed word by word
_BIG = np.int64(1) << np.int64(62)  # "no change ahead": a count no range reaches

_U1 = np.uint64(1)
_ZERO = np.uint64(0)


@njit(cache=True, nogil=True, boundscheck=False)
def ctx_place(base, shift, gmask, gkey, gstart, ngroups, ranks, zs, out_pos, out_z):
    """Place group-major (rank, value) entries (`ctx_decode_ranks`, `ans_decode_ranks`) at the
    positions of the old words `base`: out_pos gets the positions, increasing, out_z the values
    in that order. Returns the count placed, or POSITION_OUT_OF_RANGE if a rank is past its
    group's elements. The decoder's keys (below 2^exponent bits) and each group's ranks are
    strictly increasing.

    In blocks where the keys fit a byte and the range is long enough (and TOP keys can be
    tracked: `_place_blocks` declines a range whose every key has changes beyond the sample's),
    else word by word. Tables are int32 where every count fits (0.94-0.97x the time of int64
    tables on MiniLM deltas)."""
    count = gstart[ngroups]
    if base.shape[0] < 1 << 31:
        t = _place_either(base, shift, gmask, gkey, gstart, ngroups, ranks, zs, out_pos, out_z,
                          np.empty(count, np.int32))
    else:
        t = _place_either(base, shift, gmask, gkey, gstart, ngroups, ranks, zs, out_pos, out_z,
                          np.empty(count, np.int64))
    return count if t == count else POSITION_OUT_OF_RANGE


@njit(cache=True, nogil=True, boundscheck=False)
def _place_either(base, shift, gmask, gkey, gstart, ngroups, ranks, zs, out_pos, out_z, after):
    """ctx_place with tables of after's integer type: the changes placed."""
    if gmask < np.uint64(256) and base.shape[0] >= BLOCKS_FROM:
        t = _place_blocks(base, shift, gmask, gkey, gstart, ngroups, ranks, zs, out_pos, out_z,
                          after)
        if t >= 0:
            return t
    return _place(base, shift, gmask, gkey, gstart, ngroups, ranks, zs, out_pos, out_z, after)


@njit(cache=True, nogil=True, boundscheck=False)
def _tables(gmask, gkey, gstart, ngroups, ranks, after):
    """(left, nxt): per key, its elements before its next change (-1: none ahead) and the
    group-major index of that change; after[j]: the key's elements between change j and its
    next (-1 after a group's last: the count never reaches zero again)."""
    left = np.full(int(gmask) + 1, -1, after.dtype)
    nxt = np.zeros(int(gmask) + 1, after.dtype)
    count = gstart[ngroups]
    for j in range(count - 1):
        after[j] = ranks[j + 1] - ranks[j] - 1
    for grp in range(ngroups):
        k = gkey[grp]
        nxt[k] = gstart[grp]
        left[k] = ranks[gstart[grp]]
        after[gstart[grp + 1] - 1] = -1
    return left, nxt


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _count_down(base, p, sh, gmask, left, nxt, after):
    """Word p of the word-by-word count-down: the entry of the change it is, or -1."""
    k = (np.uint64(base[p]) >> sh) & gmask
    r = left[k]
    left[k] = r - 1
    if r != 0:
        return np.int64(-1)
    e = np.uint64(nxt[k])
    nxt[k] = e + _U1
    left[k] = after[e]
    return np.int64(e)


@njit(cache=True, nogil=True, boundscheck=False)
def _place(base, shift, gmask, gkey, gstart, ngroups, ranks, zs, out_pos, out_z, after):
    """Word by word: `left[k]` elements of key k pass before its next change, where the count
    reaches zero and restarts at the gap to the key's next change (`after`, computed before
    the pass: reading two ranks and the group's end at each change took 1.10-1.12x as long on
    MiniLM deltas). One load, one store and a test against zero per element (a running rank
    compared with a loaded target took 1.04-1.19x as long). Unsigned indices where a change is
    placed: numba adds a wrap-around fix to every signed index LLVM cannot prove non-negative
    (0.88-0.90x the time without it); and each group's entries are prefetched PLACE_AHEAD
    changes ahead, one stream per key being more than the hardware prefetcher follows (0.95x).
    Returns the changes placed."""
    left, nxt = _tables(gmask, gkey, gstart, ngroups, ranks, after)
    sh = np.uint64(shift)
    t = _ZERO
    for p in range(base.shape[0]):
        e = _count_down(base, p, sh, gmask, left, nxt, after)
        if e < 0:
            continue
        u = np.uint64(e)
        out_pos[t] = p
        out_z[t] = zs[u]
        t += _U1
        prefetch(zs, u + PLACE_AHEAD)
        prefetch(after, u + PLACE_AHEAD)
    return np.int64(t)


@njit(cache=True, nogil=True, boundscheck=False)
def _place_blocks(base, shift, gmask, gkey, gstart, ngroups, ranks, zs, out_pos, out_z, after):
    """In blocks of BLOCK words (see the module docstring); the rest of the range word by word.
    Returns the changes placed, or -1 when fewer than TOP keys can be tracked (the caller then
    places word by word). Side by side with `_place` on MiniLM's tensors, one thread, two runs:
    0.52-0.53x its time at 0.3% changed, 0.73x at 1%, 0.76-0.82x at 3%, 0.89-0.92x on a real
    step at 7%, where most of what is left is a mispredicted branch per change found."""
    n = base.shape[0]
    size = int(gmask) + 1
    left, nxt = _tables(gmask, gkey, gstart, ngroups, ranks, after)
    sh = np.uint64(shift)
    hist = np.zeros(size, np.int64)
    for p in range(0, n, max(1, n // SAMPLE)):
        hist[(np.uint64(base[p]) >> sh) & gmask] += 1
    # the TOP keys most frequent in the sample; slots to spare take keys without changes,
    # which count against nothing (a key with changes is a slot's or is counted word by word)
    tkey = np.empty(TOP, np.int64)
    tleft = np.full(TOP, _BIG, np.int64)  # as left[k]; _BIG: no change ahead
    tnxt = np.zeros(TOP, np.int64)
    ntop = 0
    for k in np.argsort(-hist):
        if ntop == TOP:
            break
        if hist[k] == 0 and left[k] >= 0:
            continue
        tkey[ntop] = k
        if left[k] >= 0:
            tleft[ntop] = left[k]
        tnxt[ntop] = nxt[k]
        ntop += 1
    if ntop < TOP:
        return -1
    masks = np.empty(TOP + 1, np.uint64)
    zslot = np.empty(BLOCK, np.uint64)  # the values of the block's changes, by lane
    t = _ZERO
    full = n - n % BLOCK
    for b0 in range(0, full, BLOCK):
        flags = np.uint64(block_counts(base, b0, shift, gmask, tkey, tleft))
        if flags == _ZERO:
            continue
        block_masks(base, b0, shift, gmask, tkey, masks)
        found = _ZERO  # lanes holding a change
        due = flags & np.uint64((1 << TOP) - 1)  # slots with a change in the block
        while due != _ZERO:
            q = trailing_zeros(due)
            due &= due - _U1
            m = masks[q]
            c = count_ones(m)
            i = tleft[q] + c  # block_counts took the block's c off: this is the count before
            e = tnxt[q]
            while i < c:  # the change is the key's i-th element in the block
                lane = nth_set_bit(m, i)
                found |= _U1 << np.uint64(lane)
                zslot[lane] = zs[np.uint64(e)]
                a = after[np.uint64(e)]
                i = i + 1 + a if a >= 0 else _BIG
                e += 1
            tnxt[q] = e
            tleft[q] = i - c
        rare = ~masks[TOP] if flags >> np.uint64(TOP) else _ZERO  # lanes of no slot's key
        while rare != _ZERO:
            lane = trailing_zeros(rare)
            rare &= rare - _U1
            e = _count_down(base, b0 + lane, sh, gmask, left, nxt, after)
            if e >= 0:
                found |= _U1 << np.uint64(lane)
                zslot[lane] = zs[np.uint64(e)]
        while found != _ZERO:
            lane = trailing_zeros(found)
            found &= found - _U1
            out_pos[t] = b0 + lane
            out_z[t] = zslot[lane]
            t += _U1
    for q in range(TOP):  # the last words, word by word: the slots' counts back in the tables
        left[tkey[q]] = tleft[q] if tleft[q] < _BIG // 2 else -1
        nxt[tkey[q]] = tnxt[q]
    for p in range(full, n):
        e = _count_down(base, p, sh, gmask, left, nxt, after)
        if e >= 0:
            out_pos[t] = p
            out_z[t] = zs[np.uint64(e)]
            t += _U1
    return np.int64(t)


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def nth_set_bit(m, i):
    """The index of the i-th (from 0) set bit of m, i < popcount(m): a binary search by
    popcounts, without branches (a branch per halving mispredicted half the time)."""
    at = np.int64(0)
    for half in (32, 16, 8, 4, 2, 1):
        c = count_ones(m & ((_U1 << np.uint64(half)) - _U1))
        skip = np.int64(i >= c)
        i -= c * skip
        m >>= np.uint64(half * skip)
        at += half * skip
    return at


# --- the vector steps, in LLVM IR -----------------------------------------------------------

def _splat(builder, x, ty):
    """A vector of type `ty` with every lane x."""
    i32 = ir.IntType(32)
    one = builder.insert_element(ir.Constant(ty, ir.Undefined), x, ir.Constant(i32, 0))
    return builder.shuffle_vector(one, ir.Constant(ty, ir.Undefined),
                                  ir.Constant(ir.VectorType(i32, ty.count), [0] * ty.count))


def _key_masks(context, builder, sig, args):
    """IR: the lane masks (i64) of keys tkey[0..TOP) (args[4]) among the BLOCK words of
    args[0] from args[1], the key of a word w being (w >> args[2]) & args[3] (< 256)."""
    wty = context.get_value_type(sig.args[0].dtype)
    i8, i64 = ir.IntType(8), ir.IntType(64)
    words = context.make_array(sig.args[0])(context, builder, args[0])
    keys = context.make_array(sig.args[4])(context, builder, args[4])
    vty = ir.VectorType(wty, BLOCK)

    def word(x):
        return builder.trunc(x, wty) if wty.width < 64 else x

    v = builder.load(builder.bitcast(builder.gep(words.data, [args[1]]), vty.as_pointer()),
                     align=1)
    v = builder.and_(builder.lshr(v, _splat(builder, word(args[2]), vty)),
                     _splat(builder, word(args[3]), vty))
    v8 = builder.trunc(v, ir.VectorType(i8, BLOCK)) if wty.width > 8 else v  # compare bytes
    masks = []
    for q in range(TOP):
        key = builder.trunc(builder.load(builder.gep(keys.data, [ir.Constant(i64, q)])), i8)
        hit = builder.icmp_unsigned("==", v8, _splat(builder, key, ir.VectorType(i8, BLOCK)))
        masks.append(builder.bitcast(hit, i64))
    return masks


def _typed_words(words: types.Type) -> bool:
    return isinstance(words, types.Array) and isinstance(words.dtype, types.Integer)


@intrinsic
def block_counts(typingctx, words, start, shift, gmask, tkey, tleft):
    """tleft[q] -= the count of key tkey[q] among the BLOCK words from `start` (q < TOP).
    Returns the bits q whose tleft went negative (a change of that key is in the block), and
    bit TOP when a word's key is none of tkey."""
    if not _typed_words(words):
        return None

    def codegen(context, builder, sig, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        lty = ir.VectorType(i64, TOP)
        counts = ir.Constant(lty, ir.Undefined)
        total = ir.Constant(i64, 0)
        for q, m in enumerate(_key_masks(context, builder, sig, args)):
            c = builder.ctpop(m)
            counts = builder.insert_element(counts, c, ir.Constant(i32, q))
            total = builder.add(total, c)
        lptr = builder.bitcast(context.make_array(sig.args[5])(context, builder, args[5]).data,
                               lty.as_pointer())
        left = builder.sub(builder.load(lptr, align=8), counts)
        builder.store(left, lptr, align=8)
        due = builder.icmp_signed("<", left, ir.Constant(lty, [0] * TOP))
        due = builder.zext(builder.bitcast(due, ir.IntType(TOP)), i64)
        rare = builder.zext(builder.icmp_unsigned("!=", total, ir.Constant(i64, BLOCK)), i64)
        return builder.or_(due, builder.shl(rare, ir.Constant(i64, TOP)))

    return types.int64(words, start, shift, gmask, tkey, tleft), codegen


@intrinsic
def block_masks(typingctx, words, start, shift, gmask, tkey, masks):
    """masks[q] = the lane mask of key tkey[q] among the BLOCK words from `start` (q < TOP),
    masks[TOP] = their union."""
    if not _typed_words(words):
        return None

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        out = context.make_array(sig.args[5])(context, builder, args[5])
        union = ir.Constant(i64, 0)
        for q, m in enumerate(_key_masks(context, builder, sig, args)):
            builder.store(m, builder.gep(out.data, [ir.Constant(i64, q)]))
            union = builder.or_(union, m)
        builder.store(union, builder.gep(out.data, [ir.Constant(i64, TOP)]))
        return context.get_dummy_value()

    return types.none(words, start, shift, gmask, tkey, masks), codegen
