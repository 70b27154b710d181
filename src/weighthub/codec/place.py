"""Placing decoded changes against the old words (the last step of a context-coded decode, and
of re-coding grouped positions as gaps: `apply.regap_segment`).

A context-coded segment (`ctx`, `ans`) codes each change as its rank among the range's elements
of the same old exponent (its key). The decoders give those ranks group-major; placing them is
finding, for each key, the elements whose rank among that key's elements is one of the ranks:
a pass over every old word. That pass, not the entropy coder, is most of a decode at low change
rates, so it runs two ways:

    _place         one word at a time, a count-down per key (any word type, any key size)
    _place_blocks  64 words at a time: the TOP consecutive keys holding most of a sample (the
                   window) are counted per block by vector code, and a block's words are looked
                   at one by one only where a count passes its key's next change or a word's
                   key is outside the window (keys of at most 8 bits: every float format but
                   fp64)

Both place exactly the same changes (tests/unit/test_place.py); `ctx_place` chooses. The
vector steps are LLVM IR in `place_vectors`, lowered for the CPU numba compiles for.
"""

from __future__ import annotations

import numpy as np

from ..kernel_cache import njit
from .kernels import POSITION_OUT_OF_RANGE, count_ones, prefetch, trailing_zeros
from .place_vectors import BLOCK, TOP, key_mask, nth_set_bit, outside_lanes, set_lane, window_counts

PLACE_AHEAD = np.uint64(16)  # changes of a key ahead that _place prefetches (see there)
# words whose keys choose the window, spread over the range: on MiniLM's 39 tensors of more
# than 4096 words 0.13 ms in all, against 0.52-0.67 for 8192 (each a cache line of its own)
SAMPLE = 1024
BLOCKS_FROM = 8 * BLOCK  # ranges shorter than this are placed word by word
# ... and ranges this long or longer: the blocks count in int32 lanes (0.90-0.93x the time of
# int64 lanes), where "no change ahead" (_BIG) less all a range counts stays above _BIG / 2
BLOCKS_UPTO = 1 << 28
_BIG = np.int64(1) << np.int64(30)
# Ranges with fewer changes than one per SPARSE_BLOCKS blocks (below 0.26% changed) pass over
# blocks without a change in a loop of their own: a branch, predicted right most of the time,
# instead of the branch-free work of a block's one change. Side by side on MiniLM's tensors at
# 0.05 / 0.1 / 0.2 / 0.25% changed: 0.68 / 0.77 / 0.89-0.91 / 0.96-0.98x the time; at 0.3%,
# where it stays off, 1.02x, and 1.00-1.02x at 1% (the loop's code alone).
SPARSE_BLOCKS = 6

_U1 = np.uint64(1)
_ZERO = np.uint64(0)
_DUE = np.uint64((1 << TOP) - 1)  # window_counts' bits of the keys due in a block
_NONE = np.uint64(1 << TOP)  # ... and the slot standing for none
_LANE = np.uint64(BLOCK - 1)


@njit(cache=True, nogil=True, boundscheck=False)
def ctx_place(base, shift, gmask, gkey, gstart, ngroups, ranks, zs, out_pos, out_z, out_old):
    """Place group-major (rank, value) entries (`ctx_decode_ranks`, `ans_decode_ranks`) at the
    positions of the old words `base`: out_pos gets the positions, increasing, out_z the values
    in that order and out_old the words of `base` there (read while their block is in cache: a
    gather afterwards, one cache miss a change, took 7.7-10.6 ns a change on MiniLM at 0.7-1%
    changed). Returns the count placed, or POSITION_OUT_OF_RANGE if a rank is past its
    group's elements. The decoder's keys (below 2^exponent bits) and each group's ranks are
    strictly increasing.

    In blocks where the keys fit a byte, number at least TOP and the range is long enough (and
    not too long: BLOCKS_UPTO), else word by word. Tables are int32 where every count fits
    (0.94-0.97x the time of int64 tables on MiniLM deltas)."""
    count = gstart[ngroups]
    if base.shape[0] < 1 << 31:
        t = _place_either(base, shift, gmask, gkey, gstart, ngroups, ranks, zs, out_pos, out_z,
                          out_old, np.empty(count, np.int32))
    else:
        t = _place_either(base, shift, gmask, gkey, gstart, ngroups, ranks, zs, out_pos, out_z,
                          out_old, np.empty(count, np.int64))
    return count if t == count else POSITION_OUT_OF_RANGE


@njit(cache=True, nogil=True, boundscheck=False)
def _place_either(base, shift, gmask, gkey, gstart, ngroups, ranks, zs, out_pos, out_z, out_old,
                  after):
    """ctx_place with tables of after's integer type: the changes placed."""
    if gmask < np.uint64(256) and BLOCKS_FROM <= base.shape[0] < BLOCKS_UPTO:
        t = _place_blocks(base, shift, gmask, gkey, gstart, ngroups, ranks, zs, out_pos, out_z,
                          out_old, after)
        if t >= 0:
            return t
    return _place(base, shift, gmask, gkey, gstart, ngroups, ranks, zs, out_pos, out_z, out_old,
                  after)


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
def _place(base, shift, gmask, gkey, gstart, ngroups, ranks, zs, out_pos, out_z, out_old, after):
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
        out_old[t] = base[np.uint64(p)]
        t += _U1
        prefetch(zs, u + PLACE_AHEAD)
        prefetch(after, u + PLACE_AHEAD)
    return np.int64(t)


@njit(cache=True, nogil=True, boundscheck=False)
def _place_blocks(base, shift, gmask, gkey, gstart, ngroups, ranks, zs, out_pos, out_z, out_old,
                  after):
    """In blocks of BLOCK words (see the module docstring); the words after the last whole
    block word by word. Returns the changes placed, or -1 for keys too few for a window (the
    caller then places word by word).

    A block with no change, or one change, takes no branch on the data (but where changes are
    sparse, see SPARSE_BLOCKS, blocks without one are passed over): the first key due is
    placed whether or not there is one (slot TOP, a spare that is never due, stands for none),
    and its count's restart is handed to the next block's window_counts rather than stored (a
    scalar store that the next block's vector load could not forward). Blocks with more
    changes, or a word outside the window, take the general path: every due key's changes,
    the words outside the window word by word, and the block's changes written in lane order.
    Side by side with the blocks of 16 compares and popcounts that came before (the window's
    counts by GFNI, pdep, int32 lanes), on MiniLM's tensors at 0.3 / 1 / 2 / 3 / 7% changed,
    one thread: 0.68 / 0.56-0.57 / 0.65-0.70 / 0.79 / 0.81-0.82x their time (two runs)."""
    n = base.shape[0]
    count = gstart[ngroups]
    size = int(gmask) + 1
    if size < TOP:
        return -1
    left, nxt = _tables(gmask, gkey, gstart, ngroups, ranks, after)
    if count == 0:
        return 0
    kbase = window_start(base, shift, gmask)
    sh = np.uint64(shift)
    tkey = np.zeros(TOP + 1, np.int64)  # slot TOP: no key due (never due itself)
    tleft = np.full(TOP + 1, _BIG, np.int32)  # as left[k]; _BIG: no change ahead
    tleft[TOP] = 0  # (so that i + gap below stays far from overflowing for slot TOP)
    tnxt = np.zeros(TOP + 1, np.int64)
    for q in range(TOP):
        tkey[q] = kbase + q
        if left[kbase + q] >= 0:
            tleft[q] = left[kbase + q]
        tnxt[q] = nxt[kbase + q]
    kb = np.empty(BLOCK, np.uint8)  # the block's keys
    zslot = np.empty(BLOCK, np.uint64)  # the values of the block's changes, by lane
    t = _ZERO
    full = n - n % BLOCK
    b0 = 0
    qp, addp = np.uint64(TOP), np.int64(0)  # the restart handed on: slot, increment
    sparse = count * BLOCK * SPARSE_BLOCKS < full  # see SPARSE_BLOCKS
    while b0 < full and t < np.uint64(count):
        flags = np.uint64(window_counts(base, b0, shift, gmask, kbase, tleft, kb, qp, addp))
        if sparse:
            while flags == _ZERO and b0 + BLOCK < full:
                b0 += BLOCK
                flags = np.uint64(window_counts(base, b0, shift, gmask, kbase, tleft, kb,
                                                np.uint64(TOP), np.int64(0)))
        due = flags & _DUE
        q = trailing_zeros(due | _NONE)
        m = key_mask(kb, tkey[q])
        c = count_ones(m)
        i = tleft[q] + c  # window_counts took the block's c off: this is the count before
        e = np.uint64(tnxt[q])
        a = after[e]
        gap = 1 + a if a >= 0 else _BIG  # to the key's next change; _BIG: none
        if ((flags ^ due) | (due & (due - _U1))) != _ZERO or i + gap < c:
            # the general path (written out here: a call would count references to 12 arrays)
            qp = np.uint64(TOP)
            found = _ZERO  # lanes holding a change
            while due != _ZERO:
                q = trailing_zeros(due)
                due &= due - _U1
                m = key_mask(kb, tkey[q])
                c = count_ones(m)
                i = tleft[q] + c
                e = np.uint64(tnxt[q])
                while i < c:  # the change is the key's i-th element in the block
                    lane = nth_set_bit(m, np.uint64(i))
                    found |= _U1 << np.uint64(lane)
                    zslot[lane] = zs[e]
                    a = after[e]
                    i = i + 1 + a if a >= 0 else _BIG
                    e += _U1
                tnxt[q] = e
                set_lane(tleft, q, i - c)
            if flags >> np.uint64(TOP):  # words outside the window, word by word
                outside = outside_lanes(kb, kbase)
                while outside != _ZERO:
                    lane = trailing_zeros(outside)
                    outside &= outside - _U1
                    e2 = _count_down(base, b0 + lane, sh, gmask, left, nxt, after)
                    if e2 >= 0:
                        found |= _U1 << np.uint64(lane)
                        zslot[lane] = zs[np.uint64(e2)]
            while found != _ZERO:
                lane = trailing_zeros(found)
                found &= found - _U1
                out_pos[t] = b0 + lane
                out_z[t] = zslot[lane]
                out_old[t] = base[np.uint64(b0 + lane)]
                t += _U1
        else:  # one change, or none (q == TOP: written where the next change goes, not counted)
            one = np.uint64(q < TOP)
            p = b0 + nth_set_bit(m, np.uint64(i) & _LANE)
            out_pos[t] = p
            out_z[t] = zs[e]
            out_old[t] = base[np.uint64(p)]
            t += one
            tnxt[q] = e + one
            qp, addp = np.uint64(q), gap  # not i + gap - c: i is not on the next block's path
        b0 += BLOCK
    if qp < np.uint64(TOP):
        tleft[qp] += addp
    if t == np.uint64(count):
        return np.int64(t)
    for q in range(TOP):  # the last words, word by word: the slots' counts back in the tables
        left[tkey[q]] = tleft[q] if tleft[q] < _BIG // 2 else -1
        nxt[tkey[q]] = tnxt[q]
    for p in range(b0, n):
        e3 = _count_down(base, p, sh, gmask, left, nxt, after)
        if e3 >= 0:
            out_pos[t] = p
            out_z[t] = zs[np.uint64(e3)]
            out_old[t] = base[np.uint64(p)]
            t += _U1
    return np.int64(t)


@njit(cache=True, nogil=True, boundscheck=False)
def window_start(base, shift, gmask):
    """The first of the TOP consecutive keys that hold most of a sample of SAMPLE words spread
    over the range (trained weights' exponents crowd into a few binades). Counted into two
    tables taking turns (8192 samples of a 147k-word bf16 range: 5.0 µs instead of 7.8)."""
    n = base.shape[0]
    size = int(gmask) + 1
    hist = np.zeros(size, np.int64)
    h1 = np.zeros(size, np.int64)  # a second table: equal keys one after the other (most of
    sh = np.uint64(shift)  # them) do not wait on each other's counts
    step = max(1, n // SAMPLE)
    p = 0
    while p + step < n:
        hist[(np.uint64(base[p]) >> sh) & gmask] += 1
        h1[(np.uint64(base[p + step]) >> sh) & gmask] += 1
        p += 2 * step
    if p < n:
        hist[(np.uint64(base[p]) >> sh) & gmask] += 1
    hist += h1
    held = np.int64(0)
    for q in range(TOP):
        held += hist[q]
    best, kbase = held, 0
    for k in range(1, size - TOP + 1):
        held += hist[k + TOP - 1] - hist[k - 1]
        if held > best:
            best, kbase = held, k
    return kbase
