"""codec.place: the block placement places exactly what the word-by-word one places.

Both are run on the same decoded segments (real encoder, real decoder) over word types, key
widths, range lengths around the block size and the sample, change rates, and ranges with more
keys than the blocks track (the rare keys' word-by-word path); and on hostile ranks, which both
must refuse the same way (fewer changes placed than declared).
"""

from __future__ import annotations

import numpy as np
import pytest

from weighthub.codec import UndoLog, apply_segment, encode_segment
from weighthub.codec.coding import CONTEXT_CODINGS, ENCODE_PROFILES
from weighthub.codec.ctx import decode_changes, group_ranks
from weighthub.codec.kernels import POSITION_OUT_OF_RANGE
from weighthub.codec.place import BLOCK, BLOCKS_FROM, _place, _place_blocks, ctx_place
from weighthub.tensors import DTYPE_BY_NAME, DType


def _words(dtype: DType, n: int, wide: bool, rng: np.random.Generator) -> np.ndarray:
    """n words of `dtype` with random signs and mantissas, their exponents (the keys) spread
    like trained weights' (a few binades carry most) or, `wide`, over every exponent (more
    keys than TOP: the rare keys' path runs)."""
    top = int(dtype.exponent_mask)
    keys = (rng.integers(0, top + 1, n) if wide
            else np.clip(top // 2 - rng.geometric(0.45, n), 0, top))
    shift = dtype.exponent_shift
    mant = rng.integers(0, 1 << shift, n)
    sign = rng.integers(0, 2, n) << (8 * dtype.width - 1)
    return (sign | (keys << shift) | mant).astype(dtype.uint)


def _placed(old: np.ndarray, dtype: DType, changed: np.ndarray):
    """Both placements of the changes at `changed`, decoded as a decoder gives them (group-major
    ranks by old exponent); each change's value is its position, so a value placed with the
    wrong change shows."""
    keys, ranks = group_ranks(old, changed, dtype)
    order = np.argsort(keys, kind="stable")
    gkey, counts = np.unique(keys, return_counts=True)
    gstart = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    ranks, zs = ranks[order], changed[order].astype(np.uint64)
    out = []
    for place in (_place, _place_blocks):
        pos, z = np.empty(changed.size, np.int64), np.empty(changed.size, np.uint64)
        placed = place(old, dtype.exponent_shift, np.uint64(dtype.exponent_mask),
                       gkey.astype(np.int64), gstart, gkey.size, ranks, zs, pos, z,
                       np.empty(changed.size, np.int32))
        out.append((placed, pos, z))
    return out


@pytest.mark.parametrize("name", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("n", [BLOCKS_FROM, BLOCKS_FROM + 1, BLOCKS_FROM + 4 * BLOCK - 1,
                               70_001])
@pytest.mark.parametrize("rate,wide", [(0.003, False), (0.05, False), (0.3, True)])
def test_blocks_place_what_the_word_by_word_count_places(name: str, n: int, rate: float,
                                                         wide: bool) -> None:
    dtype = DTYPE_BY_NAME[name]
    rng = np.random.default_rng(n + int(1000 * rate))
    old = _words(dtype, n, wide, rng)
    changed = np.flatnonzero(rng.random(n) < rate)
    (word_count, word_pos, word_z), (block_count, block_pos, block_z) = \
        _placed(old, dtype, changed)
    assert word_count == block_count == changed.size
    assert np.array_equal(word_pos, changed) and np.array_equal(block_pos, changed)
    assert np.array_equal(word_z.view(np.int64), changed)
    assert np.array_equal(block_z.view(np.int64), changed)


def test_a_real_delta_decodes_to_its_changes() -> None:
    """Through the encoder, the decoder and ctx_place (which takes the blocks here)."""
    dtype = DTYPE_BY_NAME["BF16"]
    rng = np.random.default_rng(7)
    w = rng.normal(0, 0.02, 50_000).astype(np.float32)  # an optimizer step on N(0, 0.02)
    old = (w.view(np.uint32) >> 16).astype(np.uint16)
    step = rng.choice([-1e-6, 1e-6], w.size).astype(np.float32)
    new = ((w + step).view(np.uint32) >> 16).astype(np.uint16)
    changed = np.flatnonzero(old != new)
    seg = encode_segment(old, new, dtype, tensor=0, start=0, policy=ENCODE_PROFILES["compact"])
    assert seg is not None and seg.positions in CONTEXT_CODINGS
    pos, _ = decode_changes(seg, old, dtype, "test")
    assert np.array_equal(pos, changed)
    dst = old.copy()  # and the values placed with them make the new words, bit for bit
    apply_segment(seg, dst, dtype, UndoLog(), "test")
    assert np.array_equal(dst, new)


def _hostile(n: int, keys: np.ndarray, ranks_per_key: list[list[int]]):
    gkey = np.asarray(keys, np.int64)
    gstart = np.concatenate([[0], np.cumsum([len(r) for r in ranks_per_key])]).astype(np.int64)
    ranks = np.asarray([r for rs in ranks_per_key for r in rs], np.int64)
    return gkey, gstart, ranks, np.arange(ranks.size, dtype=np.uint64)


@pytest.mark.parametrize("place", [_place, _place_blocks, None])
def test_ranks_past_their_keys_elements_are_refused(place) -> None:
    """A rank no element reaches (the key has fewer elements, or none) places fewer changes
    than declared, however the range is placed."""
    n = 4 * BLOCKS_FROM
    old = np.full(n, 0x3C00, np.uint16)  # one key (bf16 exponent 120) everywhere
    old[::7] = 0x3D00
    gkey, gstart, ranks, zs = _hostile(n, [120, 122, 200], [[0, 5, n - 1], [3], [0]])
    pos, z = np.empty(ranks.size, np.int64), np.empty(ranks.size, np.uint64)
    if place is None:
        got = ctx_place(old, 7, np.uint64(255), gkey, gstart, gkey.size, ranks, zs, pos, z)
        assert got == POSITION_OUT_OF_RANGE
        return
    placed = place(old, 7, np.uint64(255), gkey, gstart, gkey.size, ranks, zs, pos, z,
                   np.empty(ranks.size, np.int32))
    assert 0 <= placed < ranks.size


def test_blocks_decline_when_every_spare_key_has_changes() -> None:
    """With fewer keys in the range than TOP and every other key named by a (hostile) group,
    no slot can be spared: the blocks decline and ctx_place counts word by word (and refuses
    the ranks no element reaches)."""
    n = BLOCKS_FROM
    old = (np.arange(n) % 3 + 10).astype(np.uint16) << np.uint16(10)  # fp16 keys 10, 11, 12
    keys = list(range(32))
    ranks = [[0] for _ in keys]
    gkey, gstart, rk, zs = _hostile(n, np.asarray(keys), ranks)
    pos, z = np.empty(rk.size, np.int64), np.empty(rk.size, np.uint64)
    after = np.empty(rk.size, np.int32)
    assert _place_blocks(old, 10, np.uint64(31), gkey, gstart, gkey.size, rk, zs, pos, z,
                         after) == -1
    assert ctx_place(old, 10, np.uint64(31), gkey, gstart, gkey.size, rk, zs, pos, z) == \
        POSITION_OUT_OF_RANGE
