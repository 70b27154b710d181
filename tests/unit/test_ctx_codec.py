"""The context-coded segment coding `ctx` (format/spec.md §2, "Context coding"), written with
`EncodePolicy(coder="range")` (the default is `ans`: test_ans_codec.py): the kernels' bytes
against the spec's reference encoder (tests/reference_ctx.py), golden bytes, and every hostile
stream the spec says a reader refuses, with the destination restored bit for bit."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from reference_ctx import code_positions, code_values, ref_ctx
from weighthub.codec import Op, Positions, Segment, UndoLog, Values, apply_segment, encode_segment
from weighthub.codec.coding import EncodePolicy
from weighthub.codec.ctx import MAX_CHANGES_PER_VALUE_BYTE, ctx_streams, decode_ctx
from weighthub.errors import FormatError
from weighthub.tensors import DTYPE_BY_NAME, DTYPES, DType

FLOATS = [d for d in DTYPES if d.is_float]
BF16 = next(d for d in DTYPES if d.name == "BF16")
WHERE = "chunk c7 segment 2"
RANGE = EncodePolicy(coder="range")  # writers' ctx (the default context coder is ans)


def _pair(dtype: DType, n: int, rate: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Words spread over many exponents (at most 256: ctx models no more in a segment of f64),
    changes of a few ulps and a few large ones."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 1 << (8 * dtype.width), n, dtype=np.uint64)
    if dtype.exponent_mask > 255:
        field = np.uint64(dtype.exponent_mask << dtype.exponent_shift)
        exps = rng.integers(900, 1156, n, dtype=np.uint64) << np.uint64(dtype.exponent_shift)
        old = (old & ~field) | exps
    old = old.astype(dtype.uint)
    pos = np.flatnonzero(rng.random(n) < rate)
    step = rng.choice(np.array([1, 2, 3, 40, 1000], np.uint64), pos.size, p=[.5, .25, .15, .07, .03])
    new = old.copy()
    new[pos] = (old[pos].astype(np.uint64) + step).astype(dtype.uint)
    return old, new, pos


def _entries(old: np.ndarray, new: np.ndarray, pos: np.ndarray, op: Op, dtype: DType) -> dict[int, int]:
    bits = 8 * dtype.width
    out = {}
    for p in pos.tolist():
        o, n = int(old[p]), int(new[p])
        if op == Op.XOR:
            out[p] = o ^ n
        else:
            d = (n - o) % (1 << bits)
            s = d - (1 << bits) if d >> (bits - 1) else d
            out[p] = (2 * s if s >= 0 else -2 * s - 1) % (1 << bits)
    return out


def _seg(pb: bytes, vb: bytes, count: int, n: int, op: Op = Op.XOR) -> Segment:
    return Segment(0, 0, n, op, Positions.CTX, Values.CTX, count, np.frombuffer(pb, np.uint8).copy(),
                   np.frombuffer(vb, np.uint8).copy())


def _refused(seg: Segment, base: np.ndarray, match: str, dtype: DType = BF16) -> None:
    """decode_ctx and apply_segment both refuse, naming the chunk; nothing is left changed."""
    held = base.copy()
    with pytest.raises(FormatError, match=match) as err:
        decode_ctx(seg, held, dtype, WHERE)
    assert WHERE in str(err.value)
    dst, undo = base.copy(), UndoLog()
    with pytest.raises(FormatError, match=match):
        apply_segment(seg, dst, dtype, undo, WHERE)
    undo.rollback()
    assert np.array_equal(dst, base) and np.array_equal(held, base)


# --- the kernels write what the spec says --------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS, ids=[d.name for d in FLOATS])
@pytest.mark.parametrize("op", [Op.XOR, Op.ADD], ids=["xor", "add"])
@pytest.mark.parametrize(("n", "rate", "seed"), [(1, 1.0, 0), (700, 0.02, 1), (3000, 0.3, 2),
                                                 (2000, 1.0, 3)])
def test_kernel_bytes_match_the_reference_and_round_trip(dtype: DType, op: Op, n: int, rate: float,
                                                          seed: int) -> None:
    old, new, pos = _pair(dtype, n, rate, seed)
    if pos.size == 0:
        pos = np.array([n - 1])
        new[-1] ^= dtype.uint(1)
    coded = ctx_streams(old, pos, old[pos], new[pos], dtype, op)
    assert coded is not None
    pb, vb = coded
    rpb, rvb = ref_ctx(old, pos, _entries(old, new, pos, op, dtype), dtype)
    assert pb.tobytes() == rpb and vb.tobytes() == rvb
    seg = _seg(rpb, rvb, int(pos.size), n, op)
    dst, undo = old.copy(), UndoLog()
    apply_segment(seg, dst, dtype, undo, WHERE)
    assert np.array_equal(dst, new)
    undo.rollback()
    assert np.array_equal(dst, old)


def test_golden_bytes() -> None:
    """A fixed delta's streams, pinned: any change to the coder's arithmetic, its models or the
    writer's Golomb choice shows here (and would break every stored ctx frame)."""
    old = (np.arange(64, dtype=np.uint16) * 0x0123 + 0x3C00).astype(np.uint16)
    pos = np.array([1, 2, 5, 17, 40, 41, 63])
    new = old.copy()
    new[pos] += np.array([1, 1, 2, 1, 300, 1, 7], np.uint16)
    coded = ctx_streams(old, pos, old[pos], new[pos], BF16, Op.ADD)
    assert coded is not None
    pb, vb = coded
    assert (pb.tobytes().hex(), vb.tobytes().hex()) == (GOLDEN_POS, GOLDEN_VAL)
    assert ref_ctx(old, pos, _entries(old, new, pos, Op.ADD, BF16), BF16) == \
        (bytes.fromhex(GOLDEN_POS), bytes.fromhex(GOLDEN_VAL))


GOLDEN_POS = "000783b8004fe482dff693678034dc8000"
GOLDEN_VAL = "0026127e844dfe988658"


def test_encoder_picks_ctx_for_float_deltas_and_never_for_integers() -> None:
    # an optimizer step on N(0, 0.02) weights: a bf16 word changes where the step crosses a
    # rounding boundary, so small weights change more, by more ulps (the context ctx models)
    rng = np.random.default_rng(5)
    w = rng.normal(0, 0.02, 50_000).astype(np.float32)
    old = (w.view(np.uint32) >> 16).astype(np.uint16)
    w_new = (w + rng.choice([-1e-6, 1e-6], w.size).astype(np.float32)).view(np.uint32)
    new = (w_new >> 16).astype(np.uint16)
    assert 0.005 < np.mean(old != new) < 0.05
    seg = encode_segment(old, new, BF16, tensor=0, start=0, policy=RANGE)
    assert seg is not None and (seg.positions, seg.values) == (Positions.CTX, Values.CTX)
    v1 = encode_segment(old, new, BF16, tensor=0, start=0, policy=EncodePolicy(ctx=False))
    assert v1 is not None and v1.positions == Positions.GROUPS
    assert seg.pos_bytes.size + seg.val_bytes.size < v1.pos_bytes.size + v1.val_bytes.size
    ints = encode_segment(old.view(np.int16), new.view(np.int16),
                          next(d for d in DTYPES if d.name == "I16"), tensor=0, start=0)
    assert ints is not None and ints.positions != Positions.CTX


# --- hostile streams ---------------------------------------------------------------------------


def _positions(table: list[tuple[int, int, int]], gaps: list[list[int]], ngroups: int | None = None
               ) -> bytes:
    return code_positions(table, gaps, ngroups=ngroups)


def _values(zs: list[int]) -> bytes:
    return code_values([zs], 16)  # one group of bf16 entries


N = 64
BASE = np.full(N, 0x3F80, np.uint16)  # every element in group 0x7F
OK_POS = _positions([(0x7F, 2, 1)], [[3, 10]])  # ranks 3 and 14
OK_VAL = _values([1, 2])


def test_handmade_streams_decode() -> None:
    """The hostile cases below are edits of this one, which decodes: ranks 3 and 14 of the
    only group are positions 3 and 14."""
    dst, undo = BASE.copy(), UndoLog()
    apply_segment(_seg(OK_POS, OK_VAL, 2, N), dst, BF16, undo, WHERE)
    assert np.flatnonzero(dst != BASE).tolist() == [3, 14]
    assert (dst[[3, 14]] ^ BASE[[3, 14]]).tolist() == [1, 2]


@pytest.mark.parametrize(("pb", "vb", "count", "match"), [
    (OK_POS[:-1], OK_VAL, 2, "ends before"),
    (OK_POS + b"\0", OK_VAL, 2, "bytes left"),
    (OK_POS, OK_VAL[:-2], 2, "ends before"),
    (OK_POS, OK_VAL + b"\x00\x00", 2, "bytes left"),
    (b"\x01" + OK_POS[1:], OK_VAL, 2, "context-coded stream"),  # first byte must be 0
    (b"\0\xff\xff\xff\xff", OK_VAL, 2, "context-coded stream"),  # initial code ≥ range
    (b"", OK_VAL, 2, "declares 2 changes"),
    (OK_POS, b"", 2, "declares 2 changes"),
    (_positions([(0x7F, 2, 1)], [[3, 10]], ngroups=257), OK_VAL, 2, "context-coded stream"),
    (_positions([(0x7F, 2, 1)], [[3, 10]], ngroups=0), OK_VAL, 2, "context-coded stream"),
    (_positions([(256, 2, 1)], [[3, 10]]), OK_VAL, 2, "context-coded stream"),  # key > mask
    (_positions([(0x7F, 3, 1)], [[3, 10, 1]]), _values([1, 2, 3]), 2, "context-coded stream"),
    (_positions([(0x7F, 1, 1)], [[3]]), _values([1]), 2, "context-coded stream"),  # Σ ≠ count
    (_positions([(0x10, 1, 1), (0x7F, 1, 1)], [[0], [0]]), OK_VAL, 2, "out of range"),  # no 0x10
    (_positions([(0x7F, 2, N + 1)], [[3, 10]]), OK_VAL, 2, "context-coded stream"),  # m > n
    (_positions([(0x7F, 2, 1)], [[3, 60]]), OK_VAL, 2, "out of range"),  # rank 64 ≥ n
    (_positions([(0x7F, 2, 1)], [[3, 100]]), OK_VAL, 2, "context-coded stream"),  # q·m ≥ n
    (OK_POS, _values([1, 1 << 16]), 2, "context-coded stream"),  # 17 bits: wider than bf16
    (OK_POS, code_values([[1, 2]], 32), 2, "context-coded stream|ends before|bytes left"),
])
def test_hostile_streams_are_refused_and_nothing_changes(pb: bytes, vb: bytes, count: int,
                                                         match: str) -> None:
    _refused(_seg(pb, vb, count, N), BASE, match)


def test_a_count_the_streams_cannot_hold_is_refused_before_allocation() -> None:
    n = 1 << 28  # a range a chunk could declare; the streams are 10 bytes
    seg = _seg(OK_POS, OK_VAL, MAX_CHANGES_PER_VALUE_BYTE * len(OK_VAL) + 1, n)
    base = np.zeros(1, np.uint16)  # decode_ctx must refuse before it even looks at the base
    tracemalloc.start()
    with pytest.raises(FormatError, match=f"{WHERE}: a ctx segment declares .* changes"):
        decode_ctx(seg, base, BF16, WHERE)
    _cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20


def test_ctx_is_not_applied_inversely() -> None:
    """ctx ranks by the old exponent, which a holder of the new words does not know."""
    seg = _seg(OK_POS, OK_VAL, 2, N)
    assert not seg.invertible
    dst = BASE.copy()
    with pytest.raises(FormatError, match="cannot be applied inversely"):
        apply_segment(seg, dst, BF16, UndoLog(), WHERE, inverse=True)
    assert np.array_equal(dst, BASE)


def test_a_bad_segment_after_good_ones_rolls_the_whole_range_back() -> None:
    """A receiver applies a chunk's segments in turn: a corrupt ctx segment after a good one
    must leave the undo log able to restore every bit."""
    old, new, _ = _pair(BF16, 4000, 0.05, 9)
    good = encode_segment(old[:2000], new[:2000], BF16, tensor=0, start=0, policy=RANGE)
    bad = encode_segment(old[2000:], new[2000:], BF16, tensor=0, start=2000, policy=RANGE)
    assert good is not None and bad is not None and bad.positions == Positions.CTX
    bad_bytes = bad.val_bytes.copy()
    bad_bytes[len(bad_bytes) // 2] ^= 0x10  # caught here by the end checks (length, final code);
    # in general a chunk's checksum catches corruption first and the tensor digests after
    bad = Segment(bad.tensor, bad.start, bad.stop, bad.op, bad.positions, bad.values, bad.count,
                  bad.pos_bytes, bad_bytes)
    dst, undo = old.copy(), UndoLog()
    apply_segment(good, dst[:2000], BF16, undo, WHERE)
    with pytest.raises(FormatError, match=WHERE):
        apply_segment(bad, dst[2000:], BF16, undo, WHERE)
    undo.rollback()
    assert np.array_equal(dst, old)


F64 = next(d for d in DTYPES if d.name == "F64")


def test_f64_over_too_many_exponents_is_coded_otherwise_and_refused_as_ctx() -> None:
    """ctx models at most 2^22 value contexts per segment: f64 changes over more than 284
    exponent groups are coded otherwise by the writer, and a ctx table claiming them is
    refused before the value models are allocated."""
    rng = np.random.default_rng(3)
    old = rng.integers(0, 1 << 63, 5000, dtype=np.uint64)  # exponents all over 11 bits
    new = old ^ np.uint64(1)
    pos = np.arange(old.size)
    assert ctx_streams(old, pos, old, new, F64, Op.XOR) is None
    seg = encode_segment(old, new, F64, tensor=0, start=0, policy=RANGE)
    assert seg is not None and seg.positions != Positions.CTX
    table = code_positions([(k, 1, 1) for k in range(300)], [[0]] * 300)
    hostile = _seg(table, code_values([[1]] * 300, 64), 300, 5000)
    with pytest.raises(FormatError, match="context-coded stream"):  # checked as ngroups is read
        decode_ctx(hostile, np.zeros(5000, np.uint64), F64, WHERE)


def test_placement_tables_of_either_width_place_alike() -> None:
    """ctx_place counts in int32 tables below 2^31 elements and int64 ones above: a segment that
    large cannot be built here, so the int64 pass runs on a small one and must place the same,
    word by word and in blocks."""
    from weighthub.codec.kernels import group_ranks
    from weighthub.codec.place import _place, _place_blocks

    rng = np.random.default_rng(5)
    dtype = DTYPE_BY_NAME["BF16"]
    base = (rng.standard_normal(50_000).astype(np.float32) * 0.02).view(np.uint32) >> 16
    base = base.astype(np.uint16)
    pos = np.sort(rng.choice(base.size, 1_500, replace=False)).astype(np.int64)
    mask = np.uint64(dtype.exponent_mask)
    keys, ranks = np.empty(pos.size, np.int64), np.empty(pos.size, np.int64)
    assert group_ranks(base, pos, pos.size, dtype.exponent_shift, mask, keys, ranks) == pos.size
    order = np.argsort(keys, kind="stable")  # group-major, ranks increasing within a group
    gkey, counts = np.unique(keys, return_counts=True)
    gstart = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    zs = np.arange(pos.size, dtype=np.uint64)[order]
    placed = []
    for table in (np.int32, np.int64):
        for place in (_place, _place_blocks):
            out_pos, out_z = np.empty(pos.size, np.int64), np.empty(pos.size, np.uint64)
            held = np.empty(pos.size, base.dtype)
            t = place(base, dtype.exponent_shift, mask, gkey.astype(np.int64), gstart,
                      gkey.size, ranks[order], zs, out_pos, out_z, held, np.empty(pos.size, table))
            assert t == pos.size
            assert np.array_equal(held, base[pos])
            placed.append((out_pos, out_z))
    for out_pos, out_z in placed:
        assert np.array_equal(out_pos, pos)
        assert np.array_equal(out_z, np.arange(pos.size, dtype=np.uint64))
