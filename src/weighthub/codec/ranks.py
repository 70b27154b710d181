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
"""

from __future__ import annotations

import numpy as np

from ..kernel_cache import njit
from .kernels import count_ones, group_ranks, trailing_zeros
from .place import BLOCKS_FROM, BLOCKS_UPTO, window_start
from .place_vectors import BLOCK, TOP, key_mask, window_counts

_U1 = np.uint64(1)
_ZERO = np.uint64(0)
_NO_SLOT = np.uint64(TOP)  # window_counts' pending update: none


@njit(cache=True, nogil=True, boundscheck=False)
def ranks_of_changes(old, pos, count, shift, gmask, keys, ranks):
    """kernels.group_ranks (same arguments and result), in blocks where the keys fit a byte,
    number at least TOP and the range is long enough (and not too long: int32 counts)."""
    if (gmask < np.uint64(256) and gmask >= np.uint64(TOP - 1)
            and BLOCKS_FROM <= old.shape[0] < BLOCKS_UPTO):
        return group_ranks_blocks(old, pos, count, shift, gmask, keys, ranks)
    return group_ranks(old, pos, count, shift, gmask, keys, ranks)


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
            flags = np.uint64(window_counts(old, b, shift, gmask, kbase, neg, kb, _NO_SLOT, 0))
            if flags >> np.uint64(TOP):  # words outside the window
                inside = _ZERO
                for q in range(TOP):
                    inside |= key_mask(kb, kbase + q)
                outside = ~inside
                while outside != _ZERO:
                    other[kb[trailing_zeros(outside)]] += 1
                    outside &= outside - _U1
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
