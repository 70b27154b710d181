"""codec.place: the block placement places exactly what the word-by-word one places; and
codec.ranks, its inverse on the encoder's side: the block ranks are the word-by-word ones, and
the fused scan (scan.scan_ranked) finds the scan's changes with those ranks.

Both are run on the same decoded segments (real encoder, real decoder) over word types, key
widths, range lengths around the block size and the sample, change rates, and ranges with keys
outside the blocks' window (their word-by-word path); and on hostile ranks, which both must
refuse the same way (fewer changes placed than declared). The vector steps' generic lowerings
(for CPUs without GFNI or a fast pdep) run in subprocesses compiling for such CPUs.
"""

from __future__ import annotations

import itertools
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import njit

from weighthub.codec import UndoLog, apply_segment, encode_segment, encode_segment_tracked, place_vectors
from weighthub.codec import encode as encode_module
from weighthub.codec.coding import CONTEXT_CODINGS, ENCODE_PROFILES
from weighthub.codec.ctx import decode_changes, group_ranks
from weighthub.codec.kernels import POSITION_OUT_OF_RANGE
from weighthub.codec.kernels import group_ranks as word_ranks
from weighthub.codec.place import BLOCK, BLOCKS_FROM, SPARSE_BLOCKS, _place, _place_blocks, ctx_place
from weighthub.codec.ranks import group_ranks_blocks, ranks_of_changes
from weighthub.codec.scan import ranked_scan_applies, scan_range, scan_ranked
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


def _case(name: str, n: int, rate: float, wide: bool) -> tuple[DType, np.ndarray, np.ndarray]:
    """(dtype, old words, changed positions) of one of the _CASES."""
    dtype = DTYPE_BY_NAME[name]
    rng = np.random.default_rng(n + int(1000 * rate))
    old = _words(dtype, n, wide, rng)
    return dtype, old, np.flatnonzero(rng.random(n) < rate)


# word types (every key width the blocks take), range lengths around the block and the
# sample, change rates (and keys over the whole format: many outside the window); 0.05%: the
# placement's sparse loop (place.SPARSE_BLOCKS), with and without keys outside the window
_CASES = pytest.mark.parametrize(
    "name,n,rate,wide",
    [(name, n, rate, wide) for name in ("BF16", "F16", "F32", "F8_E4M3", "F8_E5M2")
     for n in (BLOCKS_FROM, BLOCKS_FROM + 1, BLOCKS_FROM + 4 * BLOCK - 1, 70_001)
     for rate, wide in ((0.0005, False), (0.0005, True), (0.003, False), (0.05, False),
                        (0.3, True))])


def _placed(old: np.ndarray, dtype: DType, changed: np.ndarray):
    """Both placements of the changes at `changed`, decoded as a decoder gives them (group-major
    ranks by old exponent); each change's value is its position, so a value placed with the
    wrong change shows. The old words each placed must be the base's words there."""
    keys, ranks = group_ranks(old, changed, dtype)
    order = np.argsort(keys, kind="stable")
    gkey, counts = np.unique(keys, return_counts=True)
    gstart = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    ranks, zs = ranks[order], changed[order].astype(np.uint64)
    out = []
    for place in (_place, _place_blocks):
        pos, z = np.empty(changed.size, np.int64), np.empty(changed.size, np.uint64)
        held = np.empty(changed.size, old.dtype)
        placed = place(old, dtype.exponent_shift, np.uint64(dtype.exponent_mask),
                       gkey.astype(np.int64), gstart, gkey.size, ranks, zs, pos, z, held,
                       np.empty(changed.size, np.int32))
        assert np.array_equal(held[:max(placed, 0)], old[changed[:max(placed, 0)]])
        out.append((placed, pos, z))
    return out


@_CASES
def test_blocks_place_what_the_word_by_word_count_places(name: str, n: int, rate: float,
                                                         wide: bool) -> None:
    dtype, old, changed = _case(name, n, rate, wide)
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
    pos, _, held = decode_changes(seg, old, dtype, "test")
    assert np.array_equal(pos, changed) and np.array_equal(held, old[changed])
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
        got = ctx_place(old, 7, np.uint64(255), gkey, gstart, gkey.size, ranks, zs, pos, z,
                        np.empty(ranks.size, old.dtype))
        assert got == POSITION_OUT_OF_RANGE
        return
    placed = place(old, 7, np.uint64(255), gkey, gstart, gkey.size, ranks, zs, pos, z,
                   np.empty(ranks.size, old.dtype), np.empty(ranks.size, np.int32))
    assert 0 <= placed < ranks.size


def test_ranks_for_every_key_past_the_few_present_are_refused() -> None:
    """A (hostile) group for every key of the format, where the range holds three: the blocks
    place the changes of the keys present and no more, and ctx_place refuses the segment."""
    n = BLOCKS_FROM
    old = (np.arange(n) % 3 + 10).astype(np.uint16) << np.uint16(10)  # fp16 keys 10, 11, 12
    gkey, gstart, rk, zs = _hostile(n, np.arange(32), [[0] for _ in range(32)])
    pos, z = np.empty(rk.size, np.int64), np.empty(rk.size, np.uint64)
    held = np.empty(rk.size, old.dtype)
    assert _place_blocks(old, 10, np.uint64(31), gkey, gstart, gkey.size, rk, zs, pos, z, held,
                         np.empty(rk.size, np.int32)) == 3
    assert list(pos[:3]) == [0, 1, 2] and np.array_equal(held[:3], old[:3])
    assert ctx_place(old, 10, np.uint64(31), gkey, gstart, gkey.size, rk, zs, pos, z, held) == \
        POSITION_OUT_OF_RANGE


def test_blocks_decline_keys_fewer_than_the_window() -> None:
    """Keys of 3 bits (8 of them, fewer than the window's TOP): the blocks decline and
    ctx_place counts word by word."""
    n = 2 * BLOCKS_FROM
    old = (np.arange(n) % 5).astype(np.uint8) << np.uint8(4)
    changed = np.array([3, 700, 701, n - 1], np.int64)
    keys = (old[changed] >> 4).astype(np.int64)
    order = np.argsort(keys, kind="stable")
    gkey, counts = np.unique(keys, return_counts=True)
    gstart = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    ranks = (changed // 5)[order]  # position p is element p // 5 of its key
    zs = changed[order].astype(np.uint64)
    pos, z = np.empty(4, np.int64), np.empty(4, np.uint64)
    held = np.empty(4, old.dtype)
    assert _place_blocks(old, 4, np.uint64(7), gkey, gstart, gkey.size, ranks, zs, pos, z, held,
                         np.empty(4, np.int32)) == -1
    assert ctx_place(old, 4, np.uint64(7), gkey, gstart, gkey.size, ranks, zs, pos, z, held) == 4
    assert np.array_equal(pos, changed) and np.array_equal(z.view(np.int64), changed)
    assert np.array_equal(held, old[changed])


@pytest.mark.parametrize("tail", [1, BLOCK - 1])
@pytest.mark.parametrize("blocks", [BLOCKS_FROM, 8 * BLOCKS_FROM])  # the latter: sparse
def test_a_count_restart_pending_at_the_last_block_carries_into_the_tail(tail: int,
                                                                         blocks: int) -> None:
    """The last whole block's one change hands its key's restart to the next block, and there
    is none: the tail, word by word, must start from it."""
    dtype = DTYPE_BY_NAME["BF16"]
    n = blocks + tail
    assert (n - n % BLOCK > 3 * BLOCK * SPARSE_BLOCKS) == (blocks > BLOCKS_FROM)  # sparse?
    old = np.full(n, 0x3C00, np.uint16)
    full = n - n % BLOCK
    changed = np.array([5, full - 1, n - 1], np.int64)  # one key: simple blocks, then the tail
    (word_count, word_pos, _), (block_count, block_pos, block_z) = _placed(old, dtype, changed)
    assert word_count == block_count == 3
    assert np.array_equal(word_pos, changed) and np.array_equal(block_pos, changed)
    assert np.array_equal(block_z.view(np.int64), changed)


def _both_ranks(old: np.ndarray, dtype: DType, pos: np.ndarray):
    """(done, keys, ranks) of the word-by-word and the block ranks of positions `pos`."""
    out = []
    for ranks_of in (word_ranks, group_ranks_blocks):
        keys, ranks = np.empty(pos.size, np.uint64), np.empty(pos.size, np.int64)
        done = ranks_of(old, pos, pos.size, dtype.exponent_shift, np.uint64(dtype.exponent_mask),
                        keys, ranks)
        out.append((done, keys, ranks))
    return out


@_CASES
def test_block_ranks_are_the_word_by_word_ranks(name: str, n: int, rate: float,
                                               wide: bool) -> None:
    dtype, old, pos = _case(name, n, rate, wide)
    pos = np.union1d(pos, [0, n - n % BLOCK - 1, n - 1])  # the first, the last block's, the last
    (wd, wk, wr), (bd, bk, br) = _both_ranks(old, dtype, pos)
    assert wd == bd == pos.size
    assert np.array_equal(wk, bk) and np.array_equal(wr, br)


@pytest.mark.parametrize("at,bad", [(2, "repeated"), (2, "decreasing"), (2, "past the end"),
                                    (0, "negative"), (3, "past the end")])
def test_block_ranks_stop_where_the_word_by_word_ones_do(at: int, bad: str) -> None:
    """Positions not strictly increasing within range: both stop at the same entry."""
    dtype = DTYPE_BY_NAME["BF16"]
    n = 2 * BLOCKS_FROM
    old = _words(dtype, n, False, np.random.default_rng(3))
    pos = np.array([5, 70, 700, 900], np.int64)
    pos[at] = {"repeated": pos[at - 1], "decreasing": pos[at - 1] - 10, "past the end": n,
               "negative": -1}[bad]
    (wd, wk, wr), (bd, bk, br) = _both_ranks(old, dtype, pos)
    assert wd == bd == at
    assert np.array_equal(wk[:wd], bk[:bd]) and np.array_equal(wr[:wd], br[:bd])


def test_ranks_of_changes_counts_word_by_word_where_blocks_do_not_fit() -> None:
    """fp64 keys (11 bits), a short range, keys of 3 bits: the word-by-word ranks."""
    rng = np.random.default_rng(5)
    for old, shift, gmask in ((_words(DTYPE_BY_NAME["F64"], 5000, False, rng), 52, 2047),
                              (_words(DTYPE_BY_NAME["BF16"], BLOCKS_FROM - 1, False, rng), 7, 255),
                              ((np.arange(4000) % 5).astype(np.uint8) << np.uint8(4), 4, 7)):
        pos = np.flatnonzero(rng.random(old.size) < 0.05)
        keys, ranks = np.empty(pos.size, np.uint64), np.empty(pos.size, np.int64)
        assert ranks_of_changes(old, pos, pos.size, shift, np.uint64(gmask), keys, ranks) == \
            pos.size
        want_k, want_r = np.empty(pos.size, np.uint64), np.empty(pos.size, np.int64)
        word_ranks(old, pos, pos.size, shift, np.uint64(gmask), want_k, want_r)
        assert np.array_equal(keys, want_k) and np.array_equal(ranks, want_r)


def _changed(old: np.ndarray, pos: np.ndarray, seed: int, ulps: int = 0) -> np.ndarray:
    """old with the words at `pos` changed: each by a random nonzero xor (of its low bits
    only, below `ulps`, as training steps change weights)."""
    rng = np.random.default_rng(seed)
    new = old.copy()
    new[pos] ^= rng.integers(1, ulps or 1 << (8 * old.itemsize), pos.size).astype(old.dtype)
    return new


def _assert_ranked_scan(old: np.ndarray, new: np.ndarray, dtype: DType) -> None:
    """scan_ranked gives scan_range's changes (same types) and group_ranks' keys and ranks."""
    assert ranked_scan_applies(old.size, dtype)
    got = scan_ranked(old, new, dtype, old.size)
    want = scan_range(old, new, old.size)
    assert got is not None and want is not None
    ch, keys, ranks = got
    want_keys, want_ranks = group_ranks(old, want.pos, dtype)
    for a, b in ((ch.pos, want.pos), (ch.old, want.old), (ch.new, want.new),
                 (keys, want_keys), (ranks, want_ranks)):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@_CASES
def test_the_ranked_scan_is_the_scan_and_its_ranks(name: str, n: int, rate: float,
                                                   wide: bool) -> None:
    dtype, old, pos = _case(name, n, rate, wide)
    pos = np.union1d(pos, [0, n - n % BLOCK - 1, n - 1])  # the first, the last block's, the last
    _assert_ranked_scan(old, _changed(old, pos, n), dtype)


@pytest.mark.parametrize("rate", [0.0, 0.5, 1.0])
def test_the_ranked_scan_grows_its_outputs_and_gives_up_past_its_limit(rate: float) -> None:
    """Past its first guess (~3%) the outputs grow, more than once at 100% changed; past the
    limit it gives up as scan_range does."""
    dtype, old, pos = _case("BF16", 20_000 + 37, rate, False)
    new = _changed(old, pos, 7)
    _assert_ranked_scan(old, new, dtype)
    assert scan_ranked(old, new, dtype, pos.size) is not None
    if pos.size:
        assert scan_ranked(old, new, dtype, pos.size - 1) is None
        assert scan_range(old, new, pos.size - 1) is None


def test_the_ranked_scan_takes_what_the_block_ranks_take() -> None:
    dtype = DTYPE_BY_NAME["BF16"]
    assert not ranked_scan_applies(BLOCKS_FROM - 1, dtype)
    assert not ranked_scan_applies(1 << 16, DTYPE_BY_NAME["F64"])  # 11-bit keys
    assert not ranked_scan_applies(1 << 16, DTYPE_BY_NAME["I32"])  # no exponent
    assert ranked_scan_applies(BLOCKS_FROM, dtype)


@pytest.mark.parametrize("rate", [0.003, 0.05])
def test_compact_segments_are_the_same_from_either_scan(rate: float, monkeypatch) -> None:
    """encode_segment(_tracked) codes the same segment and digest change whether the ranks
    came with the scan (nothing counts them again) or were counted after it."""
    dtype, old, pos = _case("BF16", 70_001, rate, False)
    new = _changed(old, pos, 11, ulps=4)
    policy = ENCODE_PROFILES["compact"]

    def counted_again(*args):
        raise AssertionError("the ranks the scan gave were counted again")

    with monkeypatch.context() as patch:
        patch.setattr(encode_module, "group_ranks", counted_again)
        fused = encode_segment_tracked(old, new, dtype, tensor=0, start=5, policy=policy)
    monkeypatch.setattr(encode_module, "ranked_scan_applies", lambda n, d: False)
    apart = encode_segment_tracked(old, new, dtype, tensor=0, start=5, policy=policy)
    assert fused[1] == apart[1]
    assert fused[0] is not None and apart[0] is not None
    assert fused[0].pos_bytes.tobytes() == apart[0].pos_bytes.tobytes()
    assert fused[0].val_bytes.tobytes() == apart[0].val_bytes.tobytes()
    assert (fused[0].op, fused[0].positions, fused[0].count) == \
        (apart[0].op, apart[0].positions, apart[0].count)


_CPUS = {  # NUMBA_CPU_NAME, NUMBA_CPU_FEATURES: the lowerings each gets
    "x86-64-v2": ("+popcnt,+sse4.2", {"counts": "compare", "nth_set_bit": "search"}),
    "x86-64-v3": ("+avx2,+bmi2,+popcnt", {"counts": "compare", "nth_set_bit": "pdep"}),
}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 CPU names")
@pytest.mark.parametrize("cpu", sorted(_CPUS))
def test_the_generic_lowerings_place_the_same(cpu: str, tmp_path: Path) -> None:
    """This file's placement checks again (`_checks`), in a process whose kernels numba
    compiles for an older CPU, into a cache of its own: the compare counts, and the popcount
    search or pdep. A plain process: the suite's warm-up of every kernel is not needed."""
    features, expected = _CPUS[cpu]
    env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES=features,
               NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import test_place; print(test_place._checks({cpu!r}))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == str(expected), run.stdout


def _checks(cpu: str) -> dict[str, str]:
    """The placement and rank tests above on bf16, run in this process; returns its
    lowerings."""
    got = place_vectors.lowering()
    assert got == _CPUS[cpu][1], got
    for n, (rate, wide) in itertools.product(
            [BLOCKS_FROM, BLOCKS_FROM + 1, 70_001],
            [(0.0005, True), (0.003, False), (0.05, False), (0.3, True)]):
        test_blocks_place_what_the_word_by_word_count_places("BF16", n, rate, wide)
    for place in (_place, _place_blocks, None):
        test_ranks_past_their_keys_elements_are_refused(place)
    for tail, blocks in itertools.product((1, BLOCK - 1), (BLOCKS_FROM, 8 * BLOCKS_FROM)):
        test_a_count_restart_pending_at_the_last_block_carries_into_the_tail(tail, blocks)
    test_ranks_for_every_key_past_the_few_present_are_refused()
    for n, (rate, wide) in itertools.product(
            [BLOCKS_FROM, 70_001], [(0.003, False), (0.3, True)]):
        test_block_ranks_are_the_word_by_word_ranks("BF16", n, rate, wide)
        test_the_ranked_scan_is_the_scan_and_its_ranks("BF16", n, rate, wide)
    return got


def test_the_lowering_is_one_of_the_known() -> None:
    """Which lowering this process compiles (the bench reports it)."""
    got = place_vectors.lowering()
    assert got["counts"] in ("gfni", "compare") and got["nth_set_bit"] in ("pdep", "search")


@njit(cache=False)
def _outside(kb, kbase):
    return place_vectors.outside_lanes(kb, kbase)


@pytest.mark.parametrize("kbase", [0, 1, 100, 255 - place_vectors.TOP])
def test_outside_lanes_are_the_keys_outside_the_window(kbase: int) -> None:
    """Keys just inside and just outside both ends of the window, and far from it (including
    keys below it, whose slot wraps around as a byte)."""
    rng = np.random.default_rng(kbase)
    top = place_vectors.TOP
    edges = np.array([kbase, kbase + top - 1, kbase + top, max(kbase - 1, 0), 0, 255], np.int64)
    kb = np.concatenate([edges, rng.integers(0, 256, BLOCK - edges.size)]).astype(np.uint8)
    want = sum(1 << lane for lane, k in enumerate(kb) if not kbase <= k < kbase + top)
    assert int(_outside(kb, kbase)) == want
