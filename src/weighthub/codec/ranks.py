"""The old-exponent ranks of changed positions: the encoder's side of `codec/place.py`.

A context-coded segment codes each change as its rank among the range's elements of the same
old exponent (its key): counting every old word's key up to each change, a pass over every
word. As the placement does, it runs two ways, and both give the same ranks
(tests/unit/test_place.py):

    kernels.group_ranks  word by word, four count tables (any word type, any key size)
    group_ranks_blocks   64 words at a time: the window of TOP consecutive keys holding most of
                         a sample is counted per block by `place_vectors.window_counts`, the
                         other keys (rare in trained weights) word by word, and a change's rank
                         is its key's count through its block less the key's elements from it
                         to the block's end (a popcount of the key's lane mask)
    scan_ranks_blocks    the change scan and group_ranks_blocks fused: each block's words are
                         read once for both (the encoder's scan and ranks, when it will code
                         the changes in context)
"""

from __future__ import annotations

import numpy as np

from ..kernel_cache import njit
from .kernels import count_ones, group_ranks, trailing_zeros
from .place import BLOCKS_FROM, BLOCKS_UPTO, window_start
from .place_vectors import BLOCK, TOP, change_mask, key_mask, outside_lanes, window_counts

_U1 = np.uint64(1)
_ZERO = np.uint64(0)
_NO_SLOT = np.uint64(TOP)  # window_counts' pending update: none
_LAST = np.uint64(1 << (BLOCK - 1))


@njit(cache=True, nogil=True, boundscheck=False)
def blocks_apply(n, gmask):
    """Do the block kernels take a range of n words with keys below gmask + 1?"""
    return (gmask < np.uint64(256) and gmask >= np.uint64(TOP - 1)
            and BLOCKS_FROM <= n < BLOCKS_UPTO)


@njit(cache=True, nogil=True, boundscheck=False)
def ranks_of_changes(old, pos, count, shift, gmask, keys, ranks):
    """kernels.group_ranks (same arguments and result), in blocks where the keys fit a byte,
    number at least TOP and the range is long enough (and not too long: int32 counts)."""
    if blocks_apply(old.shape[0], gmask):
        return group_ranks_blocks(old, pos, count, shift, gmask, keys, ranks)
    return group_ranks(old, pos, count, shift, gmask, keys, ranks)


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _count_block(old, b, shift, gmask, kbase, neg, other, kb):
    """Count the block of BLOCK words from b: kb[:] = their keys, the window's counts into neg
    (less), the other keys' word by word into other."""
    flags = np.uint64(window_counts(old, b, shift, gmask, kbase, neg, kb, _NO_SLOT, 0))
    if flags >> np.uint64(TOP):  # words outside the window
        outside = outside_lanes(kb, kbase)
        while outside != _ZERO:
            other[kb[trailing_zeros(outside)]] += 1
            outside &= outside - _U1


@njit(cache=True, nogil=True, boundscheck=False)
def group_ranks_blocks(old, pos, count, shift, gmask, keys, ranks):
    """For each changed position (strictly increasing, < len(old)): its key and rank, counted
    in blocks (see the module docstring; the words after the last whole block word by word).
    Keys of at most 8 bits, at least TOP of them. Returns the entries done, < count if `pos`
    is not strictly increasing within range. Side by side with kernels.group_ranks on MiniLM's
    tensors at 0.3-7% changed, one thread: 0.34-0.42x its time."""
    n = old.shape[0]
    kbase = window_start(old, shift, gmask)
    neg = np.zeros(TOP + 1, np.int32)  # minus each window key's count through the blocks done
    other = np.zeros(int(gmask) + 1, np.int64)  # the other keys' counts (all keys', in the tail)
    kb = np.empty(BLOCK, np.uint8)  # the last block's keys
    sh = np.uint64(shift)
    full = n - n % BLOCK
    b = 0  # the next block to count
    tail = full  # the next word of the tail to count
    last = -1
    for t in range(count):
        p = pos[t]
        if p <= last or p >= n:
            return t
        last = p
        while b <= min(p, full - 1):
            _count_block(old, b, shift, gmask, kbase, neg, other, kb)
            b += BLOCK
            if b == full:  # the window's counts join the others' for the tail
                for q in range(TOP):
                    other[kbase + q] -= neg[q]
        if p < full:
            lane = np.uint64(p - (b - BLOCK))
            k = np.int64(kb[lane])
            later = count_ones(key_mask(kb, k) >> lane)  # from p to the block's end
            slot = k - kbase
            keys[t] = k
            ranks[t] = (-neg[slot] if 0 <= slot < TOP else other[k]) - later
        else:
            while tail < p:
                other[(np.uint64(old[tail]) >> sh) & gmask] += 1
                tail += 1
            k = np.int64((np.uint64(old[p]) >> sh) & gmask)
            keys[t] = k
            ranks[t] = other[k]
            other[k] += 1
            tail = p + 1
    return count


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _put_change(old, new, w, lane, kb, kbase, neg, other, j, pos, ov, nv, keys, ranks):
    """Slot j gets the change at lane `lane` of the block from word w."""
    e = np.int64(kb[lane])
    later = count_ones(key_mask(kb, e) >> lane)  # from the change to the block's end
    slot = e - kbase
    p = w + lane
    pos[j] = p
    ov[j] = old[p]
    nv[j] = new[p]
    keys[j] = e
    ranks[j] = (-neg[slot] if 0 <= slot < TOP else other[e]) - later


@njit(cache=True, nogil=True, boundscheck=False)
def scan_ranks_blocks(old, new, b, k, shift, gmask, kbase, neg, other, kb, pos, ov, nv, keys,
                      ranks):
    """The changes of old → new from word b (a multiple of BLOCK) on, written from slot k: each
    one's position, old and new word, key and rank (as scan.scan_range and group_ranks give
    them). The counts carry over between calls in neg and other (group_ranks_blocks', zero at
    b = 0; kbase: window_start's). Returns (k, b) where it stopped: at the range's end (b = n),
    or where the outputs might not hold one more block's changes (the caller grows them and
    calls again). Keys of at most 8 bits, at least TOP of them (blocks_apply).

    Side by side with scan.scan_range and then group_ranks_blocks, on MiniLM's 39 tensors of
    more than 4096 words at 0.3 / 1 / 3% changed (one thread, best of 9): 0.68-0.70 /
    0.63-0.67 / 0.65-0.70x their time (two runs), and 0.71 / 0.67 / 0.72x once scan_range
    scanned in blocks too (kernels.scan_blocks)."""
    n = old.shape[0]
    full = n - n % BLOCK
    cap = pos.shape[0]
    sh = np.uint64(shift)
    j = np.uint64(k)
    w = np.uint64(b)
    while w < np.uint64(full) and j + np.uint64(BLOCK) <= np.uint64(cap):
        _count_block(old, w, shift, gmask, kbase, neg, other, kb)
        m = change_mask(old, new, w)
        # the first change is written whether or not there is one (lane 63 stands for none,
        # and is not counted): whether a block holds a change is as good as random at 1%
        _put_change(old, new, w, trailing_zeros(m | _LAST), kb, kbase, neg, other, j, pos, ov,
                    nv, keys, ranks)
        j += np.uint64(m != _ZERO)
        m &= m - _U1
        while m != _ZERO:
            _put_change(old, new, w, trailing_zeros(m), kb, kbase, neg, other, j, pos, ov, nv,
                        keys, ranks)
            j += _U1
            m &= m - _U1
        w += np.uint64(BLOCK)
    if w < np.uint64(full) or j + np.uint64(BLOCK) > np.uint64(cap):
        return np.int64(j), np.int64(w)
    for q in range(TOP):  # the window's counts join the others' for the tail
        other[kbase + q] -= neg[q]
        neg[q] = 0
    for p in range(w, n):  # the last words, word by word
        e = np.int64((np.uint64(old[p]) >> sh) & gmask)
        if old[p] != new[p]:
            pos[j] = p
            ov[j] = old[p]
            nv[j] = new[p]
            keys[j] = e
            ranks[j] = other[e]
            j += _U1
        other[e] += 1
    return np.int64(j), np.int64(n)
