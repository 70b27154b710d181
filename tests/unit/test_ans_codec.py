"""The `ans` segment coding (format/spec.md §2, "ANS coding"), the writers' default context
coding: the kernels' bytes against the spec's reference encoder (tests/reference_ans.py), golden
bytes, the paths small tests rarely take (escapes, remainders wider than 16 bits, long values,
64-bit words), and every hostile stream the spec says a reader refuses, with the destination
restored bit for bit."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from numba import njit

from reference_ans import Context, code, code_positions, code_values, integer, raw, ref_ans
from weighthub.codec import Op, Positions, Segment, UndoLog, Values, apply_segment, encode_segment
from weighthub.codec.ans import _RECIPROCAL, TOTAL, _high_product, model_rebuild, models
from weighthub.codec.coding import EncodePolicy, check_coding
from weighthub.codec.ctx import (
    ANS_CHANGES_PER_POSITION_BYTE,
    ANS_CHANGES_PER_VALUE_BYTE,
    ctx_streams,
    decode_ctx,
)
from weighthub.codec.kernels import bit_length
from weighthub.errors import FormatError, UsageError
from weighthub.publish import Publisher
from weighthub.store import MemoryStore
from weighthub.tensors import DTYPES, DType

FLOATS = [d for d in DTYPES if d.is_float]
BF16 = next(d for d in DTYPES if d.name == "BF16")
F64 = next(d for d in DTYPES if d.name == "F64")
WHERE = "chunk c7 segment 2"


def _pair(dtype: DType, n: int, rate: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Words over many exponents, changes of a few ulps and some large ones (long values)."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 1 << (8 * dtype.width), n, dtype=np.uint64).astype(dtype.uint)
    pos = np.flatnonzero(rng.random(n) < rate)
    step = rng.choice(np.array([1, 2, 3, 40, 1000, 123456], np.uint64), pos.size,
                      p=[.5, .25, .13, .07, .03, .02])
    new = old.copy()
    new[pos] = (old[pos].astype(np.uint64) + step).astype(dtype.uint)
    pos = np.flatnonzero(old != new)
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
    return Segment(0, 0, n, op, Positions.ANS, Values.ANS, count,
                   np.frombuffer(pb, np.uint8).copy(), np.frombuffer(vb, np.uint8).copy())


def _round_trip(old: np.ndarray, new: np.ndarray, pos: np.ndarray, dtype: DType, op: Op) -> None:
    """The kernels write the reference's bytes, and what they write applies and rolls back."""
    coded = ctx_streams(old, pos, old[pos], new[pos], dtype, op, Positions.ANS)
    assert coded is not None
    pb, vb = coded
    rpb, rvb = ref_ans(old, pos, _entries(old, new, pos, op, dtype), dtype)
    assert pb.tobytes() == rpb and vb.tobytes() == rvb
    dst, undo = old.copy(), UndoLog()
    apply_segment(_seg(rpb, rvb, int(pos.size), old.size, op), dst, dtype, undo, WHERE)
    assert np.array_equal(dst, new)
    undo.rollback()
    assert np.array_equal(dst, old)


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
    _round_trip(old, new, pos, dtype, op)


def test_wide_remainders_and_escapes_round_trip() -> None:
    """A change a group's Rice exponent puts past 16 bits of remainder (a lone change deep in a
    large range: k = 17), and quotients past the escape (gaps far above their group's mean)."""
    n = 400_000
    old = np.full(n, 0x3F80, np.uint16)  # one exponent group
    pos = np.array([300_000])
    new = old.copy()
    new[pos] += 1
    _round_trip(old, new, pos, BF16, Op.ADD)
    pos = np.concatenate([np.arange(0, 2000, 2), [150_000, 399_999]])  # dense, then two far gaps
    new = old.copy()
    new[pos] += 1
    _round_trip(old, new, pos, BF16, Op.XOR)


def test_golden_bytes() -> None:
    """A fixed delta's streams, pinned: any change to the coder's arithmetic, its models or the
    writer's Rice choice shows here (and would break every stored ans frame)."""
    old = (np.arange(64, dtype=np.uint16) * 0x0123 + 0x3C00).astype(np.uint16)
    pos = np.array([1, 2, 5, 17, 40, 41, 63])
    new = old.copy()
    new[pos] += np.array([1, 1, 2, 1, 300, 1, 7], np.uint16)
    coded = ctx_streams(old, pos, old[pos], new[pos], BF16, Op.ADD, Positions.ANS)
    assert coded is not None
    pb, vb = coded
    assert (pb.tobytes().hex(), vb.tobytes().hex()) == (GOLDEN_POS, GOLDEN_VAL)
    assert ref_ans(old, pos, _entries(old, new, pos, Op.ADD, BF16), BF16) == \
        (bytes.fromhex(GOLDEN_POS), bytes.fromhex(GOLDEN_VAL))


GOLDEN_POS = "f5e0ae000f0074002ed0f255468035633a317701"
GOLDEN_VAL = "8ac6e9034a36041a4c3e"


@pytest.mark.parametrize("alphabet", [4, 8, 21, 65])
def test_tables_match_the_integer_formula_at_every_weight_extreme(alphabet: int) -> None:
    """model_rebuild floors cnt·avail/total with a float product; the tables must equal the
    spec's integer formula (the reference's) bit for bit, including quotients that are exact
    integers (where a float a hair low would floor one short) and the largest totals."""
    rng = np.random.default_rng(alphabet)
    avail = 4096 - 4 * alphabet
    cases = [[4] * alphabet, [1] + [0] * (alphabet - 1), [(1 << 20) // alphabet] * alphabet,
             [(1 << 20) + 8192] + [0] * (alphabet - 1)]  # the most a table ever sees (halved)
    for _ in range(300):  # totals that divide cnt·avail: every quotient an exact integer
        unit = int(rng.integers(1, 64))
        cases.append([unit * int(x) * avail for x in rng.integers(0, 3, alphabet)]
                     if unit * avail * alphabet * 2 < 1 << 20 else [unit] * alphabet)
        cases[-1][0] += unit * avail  # never all zero
    for _ in range(300):
        cases.append([int(x) for x in rng.integers(0, 1 << int(rng.integers(1, 21)), alphabet)])
        cases[-1][int(rng.integers(alphabet))] += 1
    cum, cnt = models(1, alphabet)
    for weights in cases:
        cnt[0, :alphabet] = weights
        model_rebuild(cum, cnt, 0, alphabet)
        ref = Context(alphabet)
        ref.w = list(weights)
        ref.rebuild()
        assert cum[0, :alphabet].tolist() == ref.start, weights
        assert cnt[0, :alphabet].tolist() == ref.w  # halved alike past the limit
        assert cum[0, alphabet] == 4096
    assert avail > 0


def test_the_encoders_reciprocals_divide_exactly_at_every_frequency() -> None:
    """code_ops divides a state (< 2^32) by a symbol's frequency (2..TOTAL) with a multiply by
    _RECIPROCAL: exact at the quotients' edges (multiples of f and one below, the largest
    state) for every f, on the compiled high product as on Python's integers."""
    freqs = np.arange(2, TOTAL + 1, dtype=np.uint64)
    top = np.uint64((1 << 32) - 1)
    for x in (freqs * (top // freqs), freqs * (top // freqs) - np.uint64(1), np.full_like(freqs, top),
              freqs, freqs - np.uint64(1), freqs * np.uint64(1 << 19) + np.uint64(3)):
        rcp = _RECIPROCAL[2:]
        want = x // freqs
        assert [(int(a) * int(r)) >> 64 for a, r in zip(x, rcp, strict=True)] == want.tolist()
        assert np.array_equal(_high_products(x, rcp), want)


@njit
def _high_products(x, rcp):
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = _high_product(x[i], rcp[i])
    return out


def test_bit_length_is_pythons() -> None:
    values = [0, 1, 2, 3, 7, 8, 255, 256, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
    values += [(1 << k) + d for k in range(1, 63) for d in (-1, 0, 1)]
    got = _bit_lengths(np.array(values, np.uint64))
    assert got.tolist() == [v.bit_length() for v in values]


@njit
def _bit_lengths(v):
    out = np.empty(v.size, np.int64)
    for i in range(v.size):
        out[i] = bit_length(v[i])
    return out


def test_encoder_picks_ans_for_float_deltas_and_never_for_integers() -> None:
    # an optimizer step on N(0, 0.02) weights: a bf16 word changes where the step crosses a
    # rounding boundary, so small weights change more, by more ulps (the context ans models)
    rng = np.random.default_rng(5)
    w = rng.normal(0, 0.02, 50_000).astype(np.float32)
    old = (w.view(np.uint32) >> 16).astype(np.uint16)
    w_new = (w + rng.choice([-1e-6, 1e-6], w.size).astype(np.float32)).view(np.uint32)
    new = (w_new >> 16).astype(np.uint16)
    assert 0.005 < np.mean(old != new) < 0.05
    seg = encode_segment(old, new, BF16, tensor=0, start=0)
    assert seg is not None and (seg.positions, seg.values) == (Positions.ANS, Values.ANS)
    grouped = encode_segment(old, new, BF16, tensor=0, start=0, policy=EncodePolicy(ctx=False))
    assert grouped is not None and grouped.positions == Positions.GROUPS
    assert seg.pos_bytes.size + seg.val_bytes.size < grouped.pos_bytes.size + grouped.val_bytes.size
    ints = encode_segment(old.view(np.int16), new.view(np.int16),
                          next(d for d in DTYPES if d.name == "I16"), tensor=0, start=0)
    assert ints is not None and ints.positions not in (Positions.ANS, Positions.CTX)


def test_an_unknown_coder_is_refused_before_anything_is_written() -> None:
    store = MemoryStore()
    with pytest.raises(UsageError, match=r"coder='zstd'.*'ans', or 'range'"):
        Publisher(store, policy=EncodePolicy(coder="zstd"))
    assert store.children("") == []


# --- hostile streams ---------------------------------------------------------------------------

N = 64
BASE = np.full(N, 0x3F80, np.uint16)  # every element in group 0x7F
OK_POS = code_positions([(0x7F, 2, 1)], [[3, 10]])  # ranks 3 and 14 (Rice k = 1)
OK_VAL = code_values([[1, 2]], 16)


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


def _positions(ngroups: int, table: list[tuple[int, int, int]], gaps: list[list[tuple[int, int]]]
               ) -> bytes:
    """A positions stream coded as the spec says, whatever its contents: a declared ngroups,
    the table [(key delta, count − 1, k)] and per group its (quotient, remainder) pairs."""
    ints = [Context(65) for _ in range(5)]
    ops = integer(ints[0], ngroups)
    for dk, c, k in table:
        ops += integer(ints[1], dk) + integer(ints[2], c) + integer(ints[3], k)
    quotient = Context(8)
    for j, ((_, _, k), group) in enumerate(zip(table, gaps, strict=True)):
        for q, rem in group:
            ops.append(quotient.op(min(q, 7), j))
            if q >= 7:
                ops += integer(ints[4], q - 7)
            ops += raw(rem, k)
    return code(ops)


def _values(entries: list[tuple[int, list[int]]], bits: int = 16) -> bytes:
    """A values stream of one group: per entry its head symbol and chunk symbols as given, each
    in the context a reader decodes it with (no raw bits: the entries are short)."""
    head = Context(bits + 5)
    first: dict[int, Context] = {}
    second: dict[tuple[int, int], Context] = {}
    ops = []
    for h, chunks in entries:
        ops.append(head.op(h, 0))
        n = h - 4
        if chunks:
            ops.append(first.setdefault(n, Context(16)).op(chunks[0], 0))
        if len(chunks) > 1:
            ops.append(second.setdefault((n, chunks[0]), Context(16)).op(chunks[1], 0))
    return code(ops)


def test_handmade_streams_decode() -> None:
    """The hostile cases below are edits of these, which decode: ranks 3 and 14 of the only
    group are positions 3 and 14."""
    assert _positions(1, [(0x7F, 1, 1)], [[(1, 1), (5, 0)]]) == OK_POS
    dst, undo = BASE.copy(), UndoLog()
    apply_segment(_seg(OK_POS, OK_VAL, 2, N), dst, BF16, undo, WHERE)
    assert np.flatnonzero(dst != BASE).tolist() == [3, 14]
    assert (dst[[3, 14]] ^ BASE[[3, 14]]).tolist() == [1, 2]


def _state(value: int) -> bytes:
    return value.to_bytes(4, "little")


@pytest.mark.parametrize(("pb", "vb", "count", "match"), [
    (OK_POS[:-2], OK_VAL, 2, "ends before|context-coded stream"),
    (OK_POS + b"\0\0", OK_VAL, 2, "bytes left"),
    (OK_POS + b"\0", OK_VAL, 2, "context-coded stream"),  # an odd byte after the states
    (OK_POS, OK_VAL + b"\0\0", 2, "bytes left"),
    (OK_POS[:7], OK_VAL, 2, "ends before"),  # shorter than the two states
    (_state(0xFFFF) + OK_POS[4:], OK_VAL, 2, "context-coded stream"),  # a state below 2^16
    (OK_POS[:4] + _state(1 << 17) + OK_POS[8:], OK_VAL, 2, "context-coded stream|ends|left|range"),
    (b"", OK_VAL, 2, "declares 2 changes"),
    (OK_POS, b"", 2, "declares 2 changes"),
    (_positions(257, [(0x7F, 1, 1)], [[(1, 1), (5, 0)]]), OK_VAL, 2, "context-coded stream"),
    (_positions(0, [], []), OK_VAL, 2, "context-coded stream"),  # no group with 2 changes
    (_positions(1, [(256, 1, 1)], [[(1, 1), (5, 0)]]), OK_VAL, 2, "context-coded stream"),  # key
    (_positions(2, [(0x7F, 1, 1), (0, 0, 1)], [[(1, 1), (5, 0)], [(0, 0)]]), OK_VAL, 2,
     "context-coded stream"),  # the second key is 0x80: counts sum past count
    (_positions(1, [(0x7F, 0, 1)], [[(1, 1)]]), OK_VAL, 2, "context-coded stream"),  # Σ ≠ count
    (_positions(2, [(0x10, 0, 0), (0x6E, 0, 0)], [[(0, 0)], [(0, 0)]]), OK_VAL, 2,
     "out of range"),  # no element has key 0x10
    (_positions(1, [(0x7F, 1, 8)], [[(0, 3), (0, 10)]]), OK_VAL, 2, "context-coded stream"),  # k > 7
    (_positions(1, [(0x7F, 1, 1)], [[(1, 1), (30, 1)]]), OK_VAL, 2, "out of range"),  # rank 65
    (_positions(1, [(0x7F, 1, 1)], [[(1, 1), (40, 0)]]), OK_VAL, 2, "context-coded stream"),  # q·2^k ≥ n
    (_positions(1, [(0x7F, 1, 1)], [[(1, 1), (7 + N, 0)]]), OK_VAL, 2, "context-coded stream"),  # escape ≥ n
    (OK_POS, _values([(1, []), (8, [8])]), 2, "context-coded stream"),  # length 4: 3 chunk bits
    (OK_POS, _values([(1, []), (10, [0, 4])]), 2, "context-coded stream"),  # length 6: 1 bit more

])
def test_hostile_streams_are_refused_and_nothing_changes(pb: bytes, vb: bytes, count: int,
                                                         match: str) -> None:
    _refused(_seg(pb, vb, count, N), BASE, match)


def test_a_count_the_streams_cannot_hold_is_refused_before_allocation() -> None:
    n = 1 << 28  # a range a chunk could declare; the streams are a few bytes
    seg = _seg(OK_POS, OK_VAL, ANS_CHANGES_PER_VALUE_BYTE * len(OK_VAL) + 1, n)
    base = np.zeros(1, np.uint16)  # decode_ctx must refuse before it even looks at the base
    tracemalloc.start()
    with pytest.raises(FormatError, match=f"{WHERE}: a ans segment declares .* changes"):
        decode_ctx(seg, base, BF16, WHERE)
    _cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20


def test_the_count_limit_admits_the_densest_valid_streams() -> None:
    """The limit is a bound, not a guess: a segment of changes the models code at their
    cheapest (one exponent group, every element changed by the same entry) stays under it."""
    n = 200_000
    old = np.full(n, 0x3F80, np.uint16)
    new = old + np.uint16(1)
    pos = np.arange(n)
    coded = ctx_streams(old, pos, old, new, BF16, Op.ADD, Positions.ANS)
    assert coded is not None
    seg = _seg(coded[0].tobytes(), coded[1].tobytes(), n, n, Op.ADD)
    decoded = decode_ctx(seg, old, BF16, WHERE)  # not refused
    assert decoded.count == n
    assert n / seg.val_bytes.size < ANS_CHANGES_PER_VALUE_BYTE
    assert n / seg.pos_bytes.size < ANS_CHANGES_PER_POSITION_BYTE


@pytest.mark.parametrize(("op", "positions", "values", "is_float", "match"), [
    (Op.XOR, Positions.ANS, Values.VARINT, True, "together"),
    (Op.XOR, Positions.GAPS, Values.ANS, True, "together"),
    (Op.XOR, Positions.ANS, Values.CTX, True, "together"),
    (Op.XOR, Positions.CTX, Values.ANS, True, "together"),
    (Op.OVERWRITE, Positions.ANS, Values.ANS, True, "xor or add only"),
    (Op.ADD, Positions.ANS, Values.ANS, False, "integer dtype"),
    (Op.XOR, Positions.CTX, Values.VARINT, True, "together"),
    (Op.XOR, Positions.GAPS, Values.CTX, True, "together"),
    (Op.OVERWRITE, Positions.CTX, Values.CTX, True, "xor or add only"),
    (Op.ADD, Positions.CTX, Values.CTX, False, "integer dtype"),
])
def test_context_codings_the_format_forbids(op: Op, positions: Positions, values: Values, is_float: bool,
                                    match: str) -> None:
    with pytest.raises(FormatError, match=f"{WHERE}: .*{match}"):
        check_coding(op, positions, values, WHERE, is_float=is_float)


def test_ans_is_not_applied_inversely() -> None:
    """ans ranks by the old exponent, which a holder of the new words does not know."""
    seg = _seg(OK_POS, OK_VAL, 2, N)
    assert not seg.invertible
    dst = BASE.copy()
    with pytest.raises(FormatError, match="cannot be applied inversely"):
        apply_segment(seg, dst, BF16, UndoLog(), WHERE, inverse=True)
    assert np.array_equal(dst, BASE)


def test_a_bad_segment_after_good_ones_rolls_the_whole_range_back() -> None:
    old, new, _ = _pair(BF16, 4000, 0.05, 9)
    good = encode_segment(old[:2000], new[:2000], BF16, tensor=0, start=0)
    bad = encode_segment(old[2000:], new[2000:], BF16, tensor=0, start=2000)
    assert good is not None and bad is not None and bad.positions == Positions.ANS
    bad_bytes = bad.val_bytes.copy()
    bad_bytes[len(bad_bytes) // 2] ^= 0x10  # caught by the end checks (final states, length)
    bad = Segment(bad.tensor, bad.start, bad.stop, bad.op, bad.positions, bad.values, bad.count,
                  bad.pos_bytes, bad_bytes)
    dst, undo = old.copy(), UndoLog()
    apply_segment(good, dst[:2000], BF16, undo, WHERE)
    with pytest.raises(FormatError, match=WHERE):
        apply_segment(bad, dst[2000:], BF16, undo, WHERE)
    undo.rollback()
    assert np.array_equal(dst, old)


def test_f64_over_every_exponent_is_ans_coded() -> None:
    """ans has no per-segment context limit: f64 changes over all 2048 exponent groups code
    (ctx would have fallen back to another coding)."""
    rng = np.random.default_rng(3)
    old = rng.integers(0, 1 << 63, 50_000, dtype=np.uint64)
    new = old.copy()
    new[::7] ^= np.uint64(1)
    seg = encode_segment(old, new, F64, tensor=0, start=0)
    assert seg is not None and seg.positions == Positions.ANS
    dst, undo = old.copy(), UndoLog()
    apply_segment(seg, dst, F64, undo, WHERE)
    assert np.array_equal(dst, new)
