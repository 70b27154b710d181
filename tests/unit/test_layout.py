"""Shard boxes (affine shard → canonical maps), their tiling check and chunk pieces.

The canonical positions a box maps to are checked against numpy slicing of an index array; the
digest contributions of a tiling must add up to the digest of the whole tensor.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from weighthub.codec import EncodePolicy, Segment, encode_segment
from weighthub.codec.segment import gap_positions
from weighthub.digest import ZERO_DIGEST, digest_add, digest_affine, digest_bits, digest_change
from weighthub.errors import PlacementError, UsageError
from weighthub.layout import Piece, ShardBox, check_tiling, plan_pieces, segment_outside
from weighthub.tensors import DTYPE_BY_NAME


def shard_boxes(shape: tuple[int, ...], dim: int, world: int) -> list[ShardBox]:
    """torch.chunk-style (DTensor Shard(dim)) boxes, uneven and possibly empty."""
    size = -(-shape[dim] // world)
    out = []
    for r in range(world):
        lo, hi = min(r * size, shape[dim]), min((r + 1) * size, shape[dim])
        offset = tuple(lo if j == dim else 0 for j in range(len(shape)))
        local = tuple(hi - lo if j == dim else n for j, n in enumerate(shape))
        out.append(ShardBox(shape, offset, local))
    return out


CASES = [((7, 10), 0, 3), ((7, 10), 1, 3), ((10, 11), 1, 2), ((13,), 0, 3), ((5, 7, 6), 1, 3),
         ((5, 7, 6), 2, 4), ((4, 3, 2, 5), 2, 2), ((2, 16), 0, 3), ((6, 4), 1, 1)]


@pytest.mark.parametrize("shape,dim,world", CASES)
def test_canonical_positions_match_numpy_slicing(shape: tuple[int, ...], dim: int, world: int) -> None:
    index = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    for box in shard_boxes(shape, dim, world):
        expect = index[tuple(slice(o, o + n) for o, n in zip(box.offset, box.shape, strict=True))]
        got = box.canonical(np.arange(box.numel))
        assert np.array_equal(got, expect.reshape(-1))
        if box.numel:
            assert box.first == int(expect.reshape(-1)[0])
            assert box.run_starts.size * box.run_len == box.numel
            # every run is contiguous in canonical order
            assert np.array_equal(np.diff(got.reshape(-1, box.run_len), axis=1),
                                  np.ones((box.run_starts.size, box.run_len - 1), np.int64))


def test_a_whole_tensor_is_one_run() -> None:
    box = ShardBox((4, 5, 6), (0, 0, 0), (4, 5, 6))
    assert (box.cut, box.run_len, box.run_starts.tolist()) == (-1, 120, [0])
    rows = ShardBox((4, 5, 6), (1, 0, 0), (2, 5, 6))  # FSDP dim-0: a single contiguous run
    assert (rows.run_len, rows.run_starts.tolist()) == (60, [30])


@pytest.mark.parametrize("shape,dim,world", CASES)
def test_digest_contributions_of_a_tiling_add_up(shape: tuple[int, ...], dim: int, world: int) -> None:
    rng = np.random.default_rng(0)
    words = rng.integers(0, 1 << 16, math.prod(shape), dtype=np.uint16).reshape(shape)
    total = ZERO_DIGEST
    for box in shard_boxes(shape, dim, world):
        local = np.ascontiguousarray(
            words[tuple(slice(o, o + n) for o, n in zip(box.offset, box.shape, strict=True))])
        if box.numel:
            total = digest_add(total, digest_affine(local, box.first, box.strides))
    assert total == digest_bits(words)


def test_incremental_digest_of_a_shard_follows_its_changes() -> None:
    """What a rank does per delta: contribution += change at the canonical positions."""
    rng = np.random.default_rng(1)
    shape = (9, 13)
    old = rng.integers(0, 1 << 16, math.prod(shape), dtype=np.uint16).reshape(shape)
    new = old.copy()
    boxes = shard_boxes(shape, 1, 3)
    for box in boxes:
        sl = tuple(slice(o, o + n) for o, n in zip(box.offset, box.shape, strict=True))
        local_old = np.ascontiguousarray(old[sl]).reshape(-1)
        local_new = local_old.copy()
        pos = np.sort(rng.choice(box.numel, 5, replace=False))
        local_new[pos] ^= 1
        new[sl] = local_new.reshape(box.shape)
        before = digest_affine(local_old.reshape(box.shape), box.first, box.strides)
        after = digest_add(before, digest_change(box.canonical(pos), local_old[pos], local_new[pos]))
        assert after == digest_affine(local_new.reshape(box.shape), box.first, box.strides)


@pytest.mark.parametrize("shape,dim,world", CASES)
def test_shard_boxes_tile(shape: tuple[int, ...], dim: int, world: int) -> None:
    check_tiling("t", shape, list(enumerate(shard_boxes(shape, dim, world))))


def test_overlap_names_the_tensor_ranks_and_region() -> None:
    boxes = [ShardBox((8, 4), (0, 0), (5, 4)), ShardBox((8, 4), (4, 0), (4, 4))]
    with pytest.raises(PlacementError, match=r"'w'.*rank 0 \[0:5, 0:4\].*rank 1 \[4:8, 0:4\]"
                                             r".*overlap in \[4:5, 0:4\]"):
        check_tiling("w", (8, 4), list(enumerate(boxes)))


def test_gap_names_the_missing_region() -> None:
    boxes = [ShardBox((8, 6), (0, 0), (8, 3)), ShardBox((8, 6), (0, 4), (8, 2))]  # column 3
    with pytest.raises(PlacementError, match=r"'w'.*cover 40 of 48.*\[0:8, 3:4\] is held by no rank"):
        check_tiling("w", (8, 6), list(enumerate(boxes)))


def test_replicas_do_not_count_but_a_missing_primary_does() -> None:
    whole = (3, 3)
    primary = ShardBox(whole, (0, 0), whole)
    replica = ShardBox(whole, (0, 0), whole, primary=False)
    check_tiling("r", whole, [(0, primary), (1, replica), (2, replica)])
    with pytest.raises(PlacementError, match="cover 0 of 9"):
        check_tiling("r", whole, [(0, replica), (1, replica)])
    with pytest.raises(PlacementError, match="overlap"):
        check_tiling("r", whole, [(0, primary), (1, primary)])


def test_ranks_disagreeing_on_the_global_shape_are_refused() -> None:
    with pytest.raises(PlacementError, match=r"rank 1 places a shard of a \[4, 4\] tensor"):
        check_tiling("w", (4, 3), [(0, ShardBox((4, 3), (0, 0), (2, 3))),
                                   (1, ShardBox((4, 4), (2, 0), (2, 4)))])


@pytest.mark.parametrize("offset,shape", [((0, 2), (3, 3)), ((-1, 0), (2, 4)), ((0,), (4,))])
def test_boxes_outside_the_tensor_are_refused(offset: tuple[int, ...], shape: tuple[int, ...]) -> None:
    with pytest.raises(PlacementError):
        ShardBox((4, 4), offset, shape)


@pytest.mark.parametrize("span", [4096, 5000, 1 << 20])
@pytest.mark.parametrize("shape,dim,world", [((300, 70), 1, 3), ((5000,), 0, 2), ((9, 40, 30), 1, 4)])
def test_pieces_cover_every_rank_s_shard_exactly_once(span: int, shape: tuple[int, ...], dim: int,
                                                      world: int) -> None:
    covers = []
    for box in shard_boxes(shape, dim, world):
        chunks = plan_pieces([(0, 2, box)] if box.numel else [], span)
        assert chunks == plan_pieces([(0, 2, box)] if box.numel else [], span)  # deterministic
        pieces = [p for c in chunks for p in c]
        assert [(p.lo, p.hi) for p in pieces] == list(itertools.pairwise(
            [0, *itertools.accumulate(p.hi - p.lo for p in pieces)]))  # local ranges in order
        assert all(sum((p.hi - p.lo) * 2 for p in c) <= span for c in chunks)
        for p in pieces:
            mapped = np.concatenate([np.arange(s, e) for _t, s, e in p.covers()])
            assert np.array_equal(mapped, box.canonical(np.arange(p.lo, p.hi)))
            covers += p.covers()
    covers.sort()
    assert all(a[2] <= b[1] for a, b in itertools.pairwise(covers))  # no overlap
    assert sum(e - s for _t, s, e in covers) == math.prod(shape)  # no gap


@pytest.mark.parametrize("span", [4096, 5000, 1 << 20])
@pytest.mark.parametrize("shape,dim,world", [((300, 70), 1, 3), ((9, 40, 30), 1, 4), ((9, 40, 30), 2, 3),
                                             ((3000, 7), 1, 2), ((13,), 0, 3)])
def test_boxed_pieces_are_boxes_that_tile_each_shard(span: int, shape: tuple[int, ...], dim: int,
                                                     world: int) -> None:
    """Boxed pieces: each a box (its canonical elements are exactly its local range's), within
    span, in local order, together every element of the shard once."""
    for box in shard_boxes(shape, dim, world):
        if not box.numel:
            continue
        small = (0, 4, ShardBox((5,), (0,), (5,)))  # a tensor before it: the chunk is part-filled
        chunks = plan_pieces([small, (1, 2, box)], span, boxed={1})
        assert chunks == plan_pieces([small, (1, 2, box)], span, boxed={1})
        assert all(sum((p.hi - p.lo) * (4 if p.tensor == 0 else 2) for p in c) <= span for c in chunks)
        pieces = [p for c in chunks for p in c if p.tensor == 1]
        assert [(p.lo, p.hi) for p in pieces] == list(itertools.pairwise(
            [0, *itertools.accumulate(p.hi - p.lo for p in pieces)]))
        assert pieces[-1].hi == box.numel
        for p in pieces:
            sub = p.sub_box()
            assert np.array_equal(sub.canonical(np.arange(sub.numel)), box.canonical(np.arange(p.lo, p.hi)))
            assert sub.span == (int(box.canonical(np.asarray([p.lo]))[0]),
                                int(box.canonical(np.asarray([p.hi - 1]))[0]) + 1)
        # big boxes: a piece is cut short only by the span, never left as a sliver for its room
        rows = math.prod(box.shape[1:])
        if rows * 2 <= span:
            assert all(p.hi - p.lo >= rows for p in pieces[:-1])


def test_a_piece_that_is_not_a_box_says_so() -> None:
    box = ShardBox((8, 10), (0, 5), (8, 5))
    assert Piece(0, box, 5, 15).region() == ((1, 5), (2, 5))
    with pytest.raises(ValueError, match="not a box"):
        Piece(0, box, 3, 8).region()


def test_span_below_the_minimum_is_refused() -> None:
    with pytest.raises(UsageError):
        plan_pieces([(0, 2, ShardBox((4,), (0,), (4,)))], 100)


# -- membership: what a receiver checks for chunks whose coverage is a box -----------------------
def _sparse_segment(start: int, n: int, changed: np.ndarray, codec: str) -> Segment:
    """A sparse segment over canonical [start, start + n) changing `changed` (absolute)."""
    old = np.zeros(n, np.uint16)
    new = old.copy()
    new[changed - start] = 1
    seg = encode_segment(old, new, DTYPE_BY_NAME["BF16"], tensor=0, start=start,
                         policy=EncodePolicy(groups=False))
    assert seg is not None and seg.positions.name.lower() == codec, seg.positions
    return seg


def test_gap_positions_decode_what_the_encoder_wrote() -> None:
    rng = np.random.default_rng(3)
    pos = np.sort(rng.choice(1 << 20, 500, replace=False)).astype(np.int64)
    seg = _sparse_segment(0, 1 << 20, pos, "gaps")
    assert np.array_equal(gap_positions(seg.pos_bytes, seg.count, 1 << 20), pos)
    assert gap_positions(seg.pos_bytes[:-1], seg.count, 1 << 20) is None  # truncated
    assert gap_positions(seg.pos_bytes, seg.count - 1, 1 << 20) is None  # bytes after the last
    assert gap_positions(seg.pos_bytes, seg.count, int(pos[-1])) is None  # past the range
    assert gap_positions(np.asarray([0x80] * 10 + [1], np.uint8), 1, 1 << 20) is None  # 11 bytes
    assert gap_positions(np.asarray([5], np.uint8), 0, 1 << 20) is None


def test_sparse_segments_must_stay_inside_the_box() -> None:
    box = ShardBox((8, 10), (0, 5), (8, 5))  # columns 5..9: strided in canonical order
    start, stop = box.first, box.first + (8 - 1) * 10 + 5
    inside = box.canonical(np.array([0, 7, 12, 39]))
    assert segment_outside(_sparse_segment(start, stop - start, inside, "gaps"), box) is None
    outside = np.sort(np.concatenate([inside, [10]]))  # row 1, column 0: another rank's
    assert segment_outside(_sparse_segment(start, stop - start, outside, "gaps"), box) == \
        "positions outside the box"
    dense_ish = box.canonical(np.arange(0, 40, 2))
    bitmap = _sparse_segment(start, stop - start, dense_ish, "bitmap")
    assert segment_outside(bitmap, box) is None
    # a bitmap that does not match its header is refused as the codec refuses it
    why = segment_outside(dataclasses.replace(bitmap, count=bitmap.count + 1), box)
    assert why is not None and why.startswith("a corrupt bitmap") and "header says 21" in why
    short = dataclasses.replace(bitmap, pos_bytes=bitmap.pos_bytes[:-1])
    assert "bitmap of" in (segment_outside(short, box) or "")


def test_dense_segments_must_lie_in_one_run() -> None:
    box = ShardBox((8, 10), (0, 5), (8, 5))
    words = np.zeros(5, np.uint16)
    run = encode_segment(None, words, DTYPE_BY_NAME["BF16"], tensor=0, start=15)
    assert run is not None and segment_outside(run, box) is None
    across = encode_segment(None, np.zeros(10, np.uint16), DTYPE_BY_NAME["BF16"], tensor=0, start=15)
    assert across is not None and segment_outside(across, box) == "a dense range not inside one run"
