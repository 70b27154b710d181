"""Property tests of the delta codec: every dtype, every op and position coding, bit-exact.

Bits are compared through unsigned integer views only (never float equality: NaN, -0.0).
The reference encoder in tests/reference_codec.py (written from spec.md) builds segments with
each coding forced, so the decoder is tested against the spec independently of what the
encoder happens to choose.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bit_patterns import random_bits, special_patterns
from reference_codec import OP_FOR, leb128, make_pair, ref_segment, u8
from reference_ctx import ctx_fits
from weighthub.codec import (
    EncodePolicy,
    Op,
    Positions,
    Segment,
    UndoLog,
    Values,
    apply_segment,
    encode_segment,
)
from weighthub.codec import kernels as K
from weighthub.codec.segment import bitmap_positions
from weighthub.digest import digest_add, digest_affine, digest_sub, lanes_digest
from weighthub.errors import FormatError
from weighthub.format import decode_chunk, encode_chunk
from weighthub.tensors import DTYPES, DType

DTYPE_IDS = [d.name for d in DTYPES]
FLOATS = [d for d in DTYPES if d.is_float]
DENSITIES = [0.0, 1e-3, 0.01, 0.05, 0.2, 0.5, 0.9, 1.0]


# --- checks ----------------------------------------------------------------------------------


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and np.array_equal(a, b)


def roundtrip(seg: Segment | None, old: np.ndarray, new: np.ndarray, dtype: DType) -> None:
    """Apply seg to a copy of old: it must give new exactly; rollback must give old exactly."""
    if seg is None:
        assert same_bits(old, new)
        return
    dst = old.copy()
    undo = UndoLog()
    dnew, dold = np.zeros(2, np.uint64), np.zeros(2, np.uint64)
    apply_segment(seg, dst, dtype, undo, "test", dnew=dnew, dold=dold)
    assert same_bits(dst, new)
    # the digest change the kernel folded in as it wrote (spec §4) is exactly the range's
    change = digest_sub(lanes_digest(dnew), lanes_digest(dold))
    assert digest_add(digest_affine(old, seg.start, (1,)), change) == \
        digest_affine(new, seg.start, (1,))
    undo.rollback()
    assert same_bits(dst, old)
    undo.rollback()  # idempotent
    assert same_bits(dst, old)


pairs = st.builds(lambda seed, n, density: (seed, n, density),
                  st.integers(0, 2**32 - 1), st.integers(1, 3000), st.sampled_from(DENSITIES))


# --- encoder round trips ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@given(case=pairs, mask_ops=st.booleans(), groups=st.booleans())
def test_encode_apply_roundtrip(dtype: DType, case, mask_ops: bool, groups: bool) -> None:
    old, new = make_pair(dtype, *case)
    policy = EncodePolicy(mask_ops=mask_ops, groups=groups, min_group_count=1)
    seg = encode_segment(old, new, dtype, tensor=3, start=0, policy=policy)
    if seg is not None:
        assert (seg.tensor, seg.start, seg.stop) == (3, 0, old.size)
        if not mask_ops:
            assert seg.op in (Op.OVERWRITE, Op.DENSE)
        if not groups:
            assert seg.positions != Positions.GROUPS
        if seg.op != Op.DENSE:
            assert seg.count == int((old != new).sum())
    roundtrip(seg, old, new, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@given(case=pairs, offset=st.integers(0, 7))
def test_encoded_streams_match_the_spec(dtype: DType, case, offset: int) -> None:
    """Whatever coding the encoder picks, its streams are byte-identical to the spec's encoding."""
    old_full, new_full = make_pair(dtype, *case)
    old, new = old_full[offset:], new_full[offset:]  # unaligned slices too
    if old.size == 0:
        return
    seg = encode_segment(old, new, dtype, tensor=0, start=100,
                         policy=EncodePolicy(min_group_count=1))
    if seg is None or seg.op == Op.DENSE:
        if seg is not None:
            assert seg.positions == Positions.ALL and seg.values == Values.RAW
            assert seg.val_bytes.tobytes() == new.astype(np.dtype(dtype.uint).newbyteorder("<")).tobytes()
        return
    ref = ref_segment(old, new, dtype, seg.positions, seg.values, start=100, op=seg.op)
    if seg.values in (Values.CTX, Values.ANS):  # xor or add entries, whichever codes smaller
        assert seg.op in (Op.XOR, Op.ADD) and dtype.is_float
    else:
        assert seg.op == OP_FOR[seg.values]
    assert (seg.start, seg.stop, seg.count) == (ref.start, ref.stop, ref.count)
    assert seg.pos_bytes.tobytes() == ref.pos_bytes.tobytes()
    assert seg.val_bytes.tobytes() == ref.val_bytes.tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@given(case=pairs, positions=st.sampled_from([Positions.GAPS, Positions.GROUPS, Positions.BITMAP,
                                              Positions.CTX, Positions.ANS]),
       values=st.sampled_from([Values.RAW, Values.VARINT, Values.ZIGZAG]), add=st.booleans())
def test_every_forced_coding_decodes(dtype: DType, case, positions: Positions, values: Values,
                                     add: bool) -> None:
    old, new = make_pair(dtype, *case)
    if positions in (Positions.GROUPS, Positions.CTX, Positions.ANS) and not dtype.is_float:
        positions = Positions.GAPS
    if positions == Positions.ANS:  # both streams together, xor or add entries
        seg = ref_segment(old, new, dtype, positions, Values.ANS, op=Op.ADD if add else Op.XOR)
    elif positions == Positions.CTX:
        seg = ref_segment(old, new, dtype, positions, Values.CTX, op=Op.ADD if add else Op.XOR)
        if not ctx_fits(old, np.flatnonzero(old != new), dtype):  # f64 over many exponents:
            # refused, nothing applied
            dst = old.copy()
            with pytest.raises(FormatError, match="context-coded stream"):
                apply_segment(seg, dst, dtype, UndoLog(), "test")
            assert same_bits(dst, old)
            return
    else:
        seg = ref_segment(old, new, dtype, positions, values)
    roundtrip(seg, old, new, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@given(case=pairs)
def test_segments_survive_a_chunk_frame(dtype: DType, case) -> None:
    old, new = make_pair(dtype, *case)
    half = old.size // 2
    segs = [s for s in (
        encode_segment(old[:half], new[:half], dtype, tensor=0, start=0) if half else None,
        encode_segment(old[half:], new[half:], dtype, tensor=0, start=half),
    ) if s is not None]
    for compress in (False, True):
        frame = decode_chunk(encode_chunk(segs, compress=compress), where="mem")
        dst = old.copy()
        undo = UndoLog()
        for s in frame.segments:
            apply_segment(s, dst[s.start:s.stop], dtype, undo, "mem")
        assert same_bits(dst, new)
        undo.rollback()
        assert same_bits(dst, old)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_edge_shapes(dtype: DType) -> None:
    rng = np.random.default_rng(7)
    n = 50_000
    old = random_bits(rng, dtype, n)
    specials = special_patterns(dtype)
    cases = {
        "no change": old.copy(),
        "all changed": old ^ dtype.uint(1) if dtype.name != "BOOL" else 1 - old,
        "one element": old.copy(),
        "very sparse": old.copy(),
        "very dense": old.copy(),
        "last element": old.copy(),
    }
    cases["one element"][n // 3] ^= dtype.uint(1)
    cases["last element"][-1] ^= dtype.uint(1)
    cases["very sparse"][rng.choice(n, 5, replace=False)] ^= dtype.uint(1)
    dense_pos = rng.choice(n, int(0.45 * n), replace=False)
    cases["very dense"][dense_pos] = specials[rng.integers(0, specials.size, dense_pos.size)]
    for mask_ops in (True, False):
        for groups in (True, False):
            policy = EncodePolicy(mask_ops=mask_ops, groups=groups, min_group_count=1)
            for name, new in cases.items():
                seg = encode_segment(old, new, dtype, tensor=0, start=0, policy=policy)
                assert (seg is None) == (name == "no change"), name
                roundtrip(seg, old, new, dtype)
    # single-element and empty ranges
    one_old, one_new = old[:1].copy(), old[:1] ^ dtype.uint(1)
    roundtrip(encode_segment(one_old, one_new, dtype, tensor=0, start=0), one_old, one_new, dtype)
    empty = old[:0].copy()
    assert encode_segment(empty, empty.copy(), dtype, tensor=0, start=0) is None
    for positions in (Positions.GAPS, Positions.BITMAP):
        for values in (Values.RAW, Values.VARINT, Values.ZIGZAG):
            roundtrip(ref_segment(one_old, one_new, dtype, positions, values), one_old, one_new, dtype)
    if dtype.is_float:
        for op in (Op.XOR, Op.ADD):
            for coding in (Positions.CTX, Positions.ANS):
                roundtrip(ref_segment(one_old, one_new, dtype, coding, Values[coding.name], op=op),
                          one_old, one_new, dtype)



@pytest.mark.parametrize("n", [0, 1, 7, 8, 63, 64, 65, 1000, 4099])
@pytest.mark.parametrize("density", [0.0, 0.07, 0.5, 1.0])
def test_bitmap_positions_are_numpys_and_stop_at_capacity(n: int, density: float) -> None:
    """The bitmap kernel reads 8 bytes at a time and the tail bytes one by one: every set bit,
    in order, as numpy's unpackbits finds them; more set bits than `out` holds are reported as
    len(out) + 1 with nothing written past it. The encoder's kernel builds numpy's packbits."""
    rng = np.random.default_rng(n)
    bits = rng.random(n) < density
    bitmap = np.packbits(bits, bitorder="little")
    want = np.flatnonzero(bits)
    out = np.full(want.size + 1, -1, np.int64)
    assert K.bitmap_positions(bitmap, out[: want.size]) == want.size
    assert np.array_equal(out[: want.size], want) and out[-1] == -1
    if want.size:
        short = np.full(want.size, -1, np.int64)
        assert K.bitmap_positions(bitmap, short[: want.size - 1]) == want.size
        assert np.array_equal(short[: want.size - 1], want[:-1]) and short[-1] == -1
    built = np.zeros(bitmap.size, np.uint8)
    K.positions_bitmap(want, built)  # and back: the encoder's bitmap of the same positions
    assert np.array_equal(built, bitmap)


def test_a_bitmap_with_more_set_bits_than_its_count_says_how_many() -> None:
    """The kernel stops at the declared count; the refusal still names the true number of set
    bits, counted in the bitmap's own (little) bit order over a length not a multiple of 8."""
    bits = np.zeros(13, np.bool_)
    bits[[0, 1, 9, 12]] = True  # element 12 is bit 4 of the last, partial byte
    seg = Segment(0, 0, 13, Op.XOR, Positions.BITMAP, Values.VARINT, 2,
                  np.packbits(bits, bitorder="little"), np.ones(2, np.uint8))
    with pytest.raises(FormatError, match="bitmap has 4 positions, header says 2"):
        bitmap_positions(seg, "here")

def test_distinguishes_signed_zero_and_nan_payloads() -> None:
    """-0.0 vs +0.0 and two NaNs are equal or unordered as floats, but distinct bits must travel."""
    for dtype in FLOATS:
        bits = 8 * dtype.width
        sign = dtype.uint(1 << (bits - 1))
        nan_a = dtype.uint((dtype.exponent_mask << dtype.exponent_shift) | 1)
        nan_b = dtype.uint((dtype.exponent_mask << dtype.exponent_shift) | 2)
        old = np.array([0, nan_a, 0, 5], dtype.uint)
        new = np.array([sign, nan_b, 0, 5], dtype.uint)
        for mask_ops in (True, False):
            seg = encode_segment(old, new, dtype, tensor=0, start=0,
                                 policy=EncodePolicy(mask_ops=mask_ops))
            assert seg is not None
            roundtrip(seg, old, new, dtype)


# --- composition -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 2000),
       d1=st.sampled_from(DENSITIES), d2=st.sampled_from(DENSITIES))
def test_deltas_compose(dtype: DType, seed: int, n: int, d1: float, d2: float) -> None:
    v0, v1 = make_pair(dtype, seed, n, d1)
    _, step = make_pair(dtype, seed + 1, n, d2)
    rng = np.random.default_rng(seed + 2)
    v2 = np.where(rng.random(n) < d2, step, v1).astype(dtype.uint)
    dst = v0.copy()
    undo = UndoLog()
    for a, b in ((v0, v1), (v1, v2)):
        seg = encode_segment(a, b, dtype, tensor=0, start=0)
        if seg is not None:
            apply_segment(seg, dst, dtype, undo, "chain")
    assert same_bits(dst, v2)
    undo.rollback()
    assert same_bits(dst, v0)
    # on bit patterns, XORs and wrap-around differences compose exactly
    assert same_bits((v0 ^ v1) ^ (v1 ^ v2), v0 ^ v2)
    assert same_bits((v1 - v0) + (v2 - v1), v2 - v0)


# --- hostile streams -------------------------------------------------------------------------

DT = next(d for d in DTYPES if d.name == "BF16")
N = 100


def _base() -> np.ndarray:
    return np.random.default_rng(3).integers(0, 1 << 16, N, dtype=np.uint16)


def _seg(positions: Positions, pos_bytes: bytes, val_bytes: bytes, count: int,
         op: Op = Op.XOR, values: Values = Values.VARINT) -> Segment:
    return Segment(0, 0, N, op, positions, values, count, u8(pos_bytes), u8(val_bytes))


HOSTILE = {
    "truncated gap stream": _seg(Positions.GAPS, leb128(0) + leb128(1) + b"\x80", b"\x01" * 3, 3),
    "truncated value stream": _seg(Positions.GAPS, leb128(0) + leb128(1) + leb128(2), b"\x01\x01", 3),
    "position beyond range": _seg(Positions.GAPS, leb128(0) + leb128(5) + leb128(N), b"\x01" * 3, 3),
    "huge gap": _seg(Positions.GAPS, leb128(0) + leb128(2**64 - 1), b"\x01" * 2, 2),
    "trailing position bytes": _seg(Positions.GAPS, leb128(0) + leb128(1) + b"\x00", b"\x01" * 2, 2),
    "trailing value bytes": _seg(Positions.GAPS, leb128(0) + leb128(1), b"\x01" * 3, 2),
    "over-long varint gap": _seg(Positions.GAPS, leb128(0) + b"\x80" * 11 + b"\x00", b"\x01" * 2, 2),
    "over-long varint value": _seg(Positions.GAPS, leb128(0) + leb128(1),
                                   b"\x01" + b"\xff" * 11 + b"\x01", 2),
    "raw values short": _seg(Positions.GAPS, leb128(0) + leb128(1), b"\x01\x00\x01", 2,
                             Op.OVERWRITE, Values.RAW),
    "bitmap too short": _seg(Positions.BITMAP, b"\x01" * 12, b"\x01", 1),
    "bitmap too long": _seg(Positions.BITMAP, b"\x01" + b"\x00" * 13, b"\x01", 1),
    "bitmap count disagrees": _seg(Positions.BITMAP, b"\x03" + b"\x00" * 12, b"\x01", 1),
    "bitmap trailing values": _seg(Positions.BITMAP, b"\x03" + b"\x00" * 12, b"\x01" * 3, 2),
    "group keys repeated": _seg(Positions.GROUPS, leb128(2) + leb128(5) + leb128(1) + leb128(5)
                                + leb128(1) + leb128(0) + leb128(0), b"\x01" * 2, 2),
    "group key out of range": _seg(Positions.GROUPS, leb128(1) + leb128(256) + leb128(1) + leb128(0),
                                   b"\x01", 1),
    "group counts disagree": _seg(Positions.GROUPS, leb128(1) + leb128(5) + leb128(3) + leb128(0) * 3,
                                  b"\x01" * 2, 2),
    "group table truncated": _seg(Positions.GROUPS, leb128(3) + leb128(5), b"\x01", 1),
    "too many groups": _seg(Positions.GROUPS, leb128(300), b"\x01", 1),
    "group rank gaps trailing": _seg(Positions.GROUPS, leb128(1) + leb128(0) + leb128(1) + leb128(0)
                                     + b"\x00", b"\x01", 1),
    "group ranks beyond range": _seg(Positions.GROUPS, leb128(1) + leb128(0) + leb128(1)
                                     + leb128(10_000), b"\x01", 1),
    "positions ALL on a delta op": _seg(Positions.ALL, b"", b"\x01", 1),
    # codings the spec forbids (format/spec.md §2): refused before anything is applied
    "xor with zigzag values": _seg(Positions.GAPS, leb128(0), b"\x01", 1, Op.XOR, Values.ZIGZAG),
    "add with varint values": _seg(Positions.GAPS, leb128(0), b"\x01", 1, Op.ADD, Values.VARINT),
    "overwrite with varint values": _seg(Positions.GAPS, leb128(0), b"\x01", 1, Op.OVERWRITE,
                                         Values.VARINT),
    "dense with gap positions": _seg(Positions.GAPS, b"", b"\x00" * 2 * N, N, Op.DENSE, Values.RAW),
    "dense with varint values": _seg(Positions.ALL, b"", b"\x00" * 2 * N, N, Op.DENSE,
                                     Values.VARINT),
    "dense with a short count": _seg(Positions.ALL, b"", b"\x00" * 2 * N, N - 1, Op.DENSE,
                                     Values.RAW),
    "bitmap padding bit set": _seg(Positions.BITMAP, b"\x01" + b"\x00" * 11 + b"\x10", b"\x01", 1),
    "group keys not increasing": _seg(Positions.GROUPS, leb128(2) + leb128(5) + leb128(1) + leb128(3)
                                      + leb128(1) + leb128(0) + leb128(0), b"\x01" * 2, 2),
    "empty group": _seg(Positions.GROUPS, leb128(2) + leb128(3) + leb128(0) + leb128(5) + leb128(1)
                        + leb128(0), b"\x01", 1),
    "dense of wrong size": _seg(Positions.ALL, b"", b"\x00" * (2 * N - 1), N, Op.DENSE, Values.RAW),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_segment_is_refused_and_rolled_back(name: str) -> None:
    original = _base()
    dst = original.copy()
    undo = UndoLog()
    # a good segment first, so the log holds real changes when the bad one fails
    good_new = original.copy()
    good_new[[1, 50, 99]] ^= np.uint16(0x8001)
    apply_segment(ref_segment(original, good_new, DT, Positions.GAPS, Values.VARINT), dst, DT,
                  undo, "good")
    assert same_bits(dst, good_new)
    with pytest.raises(FormatError, match="hostile"):
        apply_segment(HOSTILE[name], dst, DT, undo, "hostile")
    undo.rollback()
    assert same_bits(dst, original)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if not d.is_float], ids=lambda d: d.name)
def test_grouped_positions_on_an_integer_dtype_are_refused(dtype: DType) -> None:
    dst = np.zeros(16, dtype.uint)
    seg = Segment(0, 0, 16, Op.XOR, Positions.GROUPS, Values.VARINT, 1,
                  u8(leb128(1) + leb128(0) + leb128(1) + leb128(0)), u8(b"\x01"))
    undo = UndoLog()
    with pytest.raises(FormatError, match="grp: exponent-grouped positions on an integer dtype"):
        apply_segment(seg, dst, dtype, undo, "grp")
    assert not undo.entries and not dst.any()


def test_partial_apply_is_rolled_back_exactly() -> None:
    """A stream that breaks after some elements were written leaves nothing behind after rollback."""
    original = _base()
    for bad_tail in (b"\x80", leb128(N)):  # truncated varint, then a position out of range
        gaps = b"".join(leb128(3) for _ in range(10)) + bad_tail
        seg = _seg(Positions.GAPS, gaps, b"\x7f" * 11, 11)
        dst = original.copy()
        undo = UndoLog()
        with pytest.raises(FormatError):
            apply_segment(seg, dst, DT, undo, "partial")
        undo.rollback()
        assert same_bits(dst, original)


def test_size_estimates_are_order0_entropy_plus_a_table() -> None:
    # what encode_segment compares its candidate streams by: bits of order-0 entropy as bytes,
    # plus a 16-byte table for any non-empty stream (zstd-1's Huffman header)
    assert K.stream_estimate(np.zeros(0, np.uint8)) == 0.0
    assert K.stream_estimate(np.full(9, 7, np.uint8)) == 16.0
    assert K.stream_estimate(np.array([0, 0, 1, 1], np.uint8)) == pytest.approx(16.5)
    old, new = np.zeros(2, np.uint16), np.ones(2, np.uint16)
    mask, sign_shift = np.uint64(0xFFFF), 15
    # zigzag(+1) = 2 and xor 1 are one-byte streams of one symbol; the raw words' bytes are
    # 1, 0, 1, 0 (one bit each), counted twice at scale 2
    zigzag, xor, raw = K.value_estimates(old, new, 2, 1, mask, sign_shift, 2.0)
    assert (zigzag, xor) == (16.0, 16.0) and raw == pytest.approx(17.0)
