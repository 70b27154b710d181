"""Linear tensor digests: the spec formula, composition over any tiling, incremental updates."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bit_patterns import random_bits
from weighthub.digest import (
    ZERO_DIGEST,
    digest_add,
    digest_affine,
    digest_bits,
    digest_change,
    digest_sub,
    tensor_digest,
)
from weighthub.errors import UsageError
from weighthub.tensors import DTYPES, bits

M64 = (1 << 64) - 1
WIDTHS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & M64
    return x ^ (x >> 33)


def _mix13(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def reference_digest(words: np.ndarray) -> bytes:
    """format/spec.md §4 written out in plain Python integers (independent of the kernels)."""
    s0 = s1 = 0
    for i, w in enumerate(int(x) for x in words.reshape(-1)):
        rot = ((w << 32) | (w >> 32)) & M64
        s0 += _fmix64((((i + 1) * 0x9E3779B97F4A7C15) & M64) ^ w)
        s1 += _mix13((((i + 1) * 0xD1B54A32D192ED03) & M64) ^ rot)
    return (s0 & M64).to_bytes(8, "little") + (s1 & M64).to_bytes(8, "little")


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_kernel_matches_the_spec_formula(width: int) -> None:
    rng = np.random.default_rng(width)
    w = rng.integers(0, 256, 37 * width, dtype=np.uint8).view(WIDTHS[width])
    assert digest_bits(w) == reference_digest(w)


def test_golden_digest() -> None:
    """Pins the bytes: changing a constant or the serialization is a format change."""
    assert digest_bits(np.arange(8, dtype=np.uint16)).hex() == reference_digest(
        np.arange(8, dtype=np.uint16)).hex() == "f94d729b321b82f08aa3f0aa6080111d"
    assert digest_bits(np.zeros(0, np.uint16)) == ZERO_DIGEST


def _tile_sum(pieces: list[bytes]) -> bytes:
    total = ZERO_DIGEST
    for p in pieces:
        total = digest_add(total, p)
    return total


@given(rows=st.integers(1, 9), cols=st.integers(1, 9), width=st.sampled_from([1, 2, 4, 8]),
       data=st.data())
def test_row_and_column_tilings_sum_to_the_whole(rows: int, cols: int, width: int,
                                                 data: st.DataObject) -> None:
    rng = np.random.default_rng(rows * 100 + cols)
    a = rng.integers(0, 256, rows * cols * width, dtype=np.uint8).view(WIDTHS[width])
    a = a.reshape(rows, cols)
    whole = digest_bits(a.reshape(-1))
    rcuts = sorted(set([*data.draw(st.lists(st.integers(1, rows), max_size=3)), 0, rows]))
    ccuts = sorted(set([*data.draw(st.lists(st.integers(1, cols), max_size=3)), 0, cols]))
    pieces = []
    for r0, r1 in itertools.pairwise(rcuts):
        for c0, c1 in itertools.pairwise(ccuts):
            block = a[r0:r1, c0:c1]  # a strided view: digest_affine must not need a copy
            pieces.append(digest_affine(block, r0 * cols + c0, (cols, 1)))
    assert _tile_sum(pieces) == whole
    assert digest_affine(a, 0, (cols, 1)) == whole
    assert digest_affine(a.T, 0, (1, cols)) == whole  # a transposed placement (column-major)


@given(shape=st.tuples(st.integers(1, 5), st.integers(1, 5), st.integers(1, 6)), data=st.data())
def test_three_d_uneven_shards(shape: tuple[int, int, int], data: st.DataObject) -> None:
    rng = np.random.default_rng(sum(shape))
    a = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    strides = (shape[1] * shape[2], shape[2], 1)
    whole = digest_bits(a)
    dim = data.draw(st.integers(0, 2))
    cut = data.draw(st.integers(0, shape[dim]))
    lo = [slice(None)] * 3
    hi = [slice(None)] * 3
    lo[dim], hi[dim] = slice(0, cut), slice(cut, None)
    first_hi = cut * strides[dim]
    parts = [digest_affine(a[tuple(lo)], 0, strides), digest_affine(a[tuple(hi)], first_hi, strides)]
    assert _tile_sum(parts) == whole
    # a non-contiguous middle-dim shard of a 3-D tensor, and its complement element by element
    mid = a[:, 1:, ::2]
    rest = digest_sub(whole, digest_affine(mid, strides[1], (strides[0], strides[1], 2)))
    mask = np.ones(shape, bool)
    mask[:, 1:, ::2] = False
    idx = np.flatnonzero(mask.reshape(-1))
    assert rest == _digest_at(a.reshape(-1), idx)


def _digest_at(flat: np.ndarray, idx: np.ndarray) -> bytes:
    """Digest of the elements at idx only: each one as a 1-element block."""
    return _tile_sum([digest_affine(flat[i: i + 1], int(i), (1,)) for i in idx])


@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
def test_incremental_update_equals_full_digest(dtype) -> None:
    rng = np.random.default_rng(DTYPES.index(dtype) + 1)
    old = random_bits(rng, dtype, 4000)
    new = old.copy()
    pos = np.sort(rng.choice(old.size, 150, replace=False))
    new[pos] = random_bits(rng, dtype, pos.size)
    changed = digest_change(pos, old[pos], new[pos])
    assert digest_bits(new) == digest_add(digest_bits(old), changed)
    assert digest_bits(old) == digest_sub(digest_bits(new), changed)
    # positions that did not change contribute nothing
    assert digest_change(pos, old[pos], old[pos]) == ZERO_DIGEST
    # a range inside a bigger tensor: indices offset by `first`
    assert digest_change(pos, old[pos], new[pos], first=10) == digest_sub(
        digest_affine(new, 10, (1,)), digest_affine(old, 10, (1,)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_signed_zero_nan_payloads_swaps_and_moves_are_seen(dtype: torch.dtype) -> None:
    t = torch.zeros(16, dtype=dtype)
    u = t.clone()
    u[5] = -0.0
    assert tensor_digest(t) != tensor_digest(u)
    a = torch.full((16,), float("nan"), dtype=dtype)
    b = a.clone()
    bits(b)[2] ^= 1
    assert tensor_digest(a) != tensor_digest(b)
    x = torch.arange(16, dtype=dtype)
    swapped = x.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    moved = torch.roll(x, 1)
    assert len({tensor_digest(x), tensor_digest(swapped), tensor_digest(moved)}) == 3


@given(st.integers(0, 63), st.integers(0, 255))
def test_every_bit_flip_of_a_u64_word_changes_both_lanes(bit: int, i: int) -> None:
    w = np.random.default_rng(i).integers(0, 1 << 63, 256, dtype=np.uint64)
    v = w.copy()
    v[i] ^= np.uint64(1 << bit)
    a, b = digest_bits(w), digest_bits(v)
    assert a[:8] != b[:8] and a[8:] != b[8:]


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_reversed_unaligned_and_read_only_views_digest_as_their_elements(width: int) -> None:
    """Blocks reach the kernels as one contiguous span (digest.linear._span): memory strides
    that run backwards, unaligned words and read-only memory must not change a digest."""
    rng = np.random.default_rng(width)
    rows, cols = 7, 9
    a = rng.integers(0, 2**63, rows * cols, dtype=np.uint64).astype(WIDTHS[width]).reshape(rows, cols)
    whole = reference_digest(a)
    assert digest_affine(a[::-1, ::-1], a.size - 1, (-cols, -1)) == whole
    assert digest_affine(a[:, ::-1], cols - 1, (cols, -1)) == whole
    assert digest_affine(a[::-1].T, (rows - 1) * cols, (1, -cols)) == whole
    buf = np.zeros(a.nbytes + 1, np.uint8)
    odd = buf[1:].view(WIDTHS[width])  # unaligned words for widths > 1
    odd[:] = a.reshape(-1)
    odd.flags.writeable = False
    assert digest_bits(odd.reshape(rows, cols)) == whole
    column = odd.reshape(rows, cols)[:, 2:5]  # unaligned, strided and read-only at once
    assert digest_affine(column, 2, (cols, 1)) == digest_affine(a[:, 2:5].copy(), 2, (cols, 1))


def test_two_threads_equal_one_and_errors_are_clear() -> None:
    w = np.random.default_rng(0).integers(0, 1 << 16, (1 << 22) + 7, dtype=np.uint16)
    assert digest_bits(w, threads=1) == digest_bits(w, threads=2)
    with pytest.raises(UsageError, match="2 strides for a 1-D block"):
        digest_affine(w, 0, (1, 1))
    with pytest.raises(UsageError, match="16 bytes"):
        digest_add(b"x", ZERO_DIGEST)
    with pytest.raises(UsageError, match="equal 1-D shapes"):
        digest_change(np.arange(3), w[:3], w[:2])


# --- segments: the receiver's two halves and the publisher's tracked encode ---------------------


@pytest.mark.parametrize(("frac", "ctx"), [(0.002, ""), (0.03, ""), (0.3, ""), (1.0, ""),
                                           (0.03, "range"), (0.03, "ans")],
                         ids=["gaps", "groups", "bitmap", "dense", "ctx", "ans"])
def test_segment_digest_halves_add_up(frac: float, ctx: str) -> None:
    from weighthub.codec import EncodePolicy, Positions, UndoLog, apply_segment, encode_segment_tracked
    from weighthub.codec.digest import staged_old_digest
    from weighthub.digest import lanes_digest
    from weighthub.tensors import DTYPE_BY_NAME

    bf16 = DTYPE_BY_NAME["BF16"]
    rng = np.random.default_rng(int(frac * 1000))
    old = random_bits(rng, bf16, 20_000, special_frac=0.0)
    # two exponents; changes only among one of them, so grouped positions pay off
    exps = rng.choice(np.array([100, 120], np.uint16), old.size)
    old = (old & np.uint16(0x807F)) | (exps << np.uint16(7))
    new = old.copy()
    pool = np.flatnonzero(exps == 120) if frac == 0.03 else np.arange(old.size)
    pos = np.sort(rng.choice(pool, max(1, int(frac * old.size)), replace=False))
    new[pos] ^= np.uint16(1) if frac < 1 else np.uint16(0x5555)
    start = 1000
    seg, change = encode_segment_tracked(old, new, bf16, tensor=0, start=start,
                                         policy=EncodePolicy(ctx=bool(ctx), coder=ctx or "ans"))
    assert seg is not None
    assert digest_affine(new, start, (1,)) == digest_add(digest_affine(old, start, (1,)), change)
    want = {"range": Positions.CTX, "ans": Positions.ANS}[ctx] if ctx else {
        0.002: Positions.GAPS, 0.03: Positions.GROUPS, 0.3: Positions.BITMAP, 1.0: Positions.ALL}[frac]
    assert seg.positions == want
    before = staged_old_digest(seg, old, bf16, "t")
    dst = old.copy()
    dnew, dold = np.zeros(2, np.uint64), np.zeros(2, np.uint64)
    entry = apply_segment(seg, dst, bf16, UndoLog(), "t", dnew=dnew, dold=dold)
    assert entry is not None and np.array_equal(dst, new)
    # folded by the kernel as it wrote: new half, and old half both staged and folded
    assert digest_sub(lanes_digest(dnew), before) == change == \
        digest_sub(lanes_digest(dnew), lanes_digest(dold))
    assert before == lanes_digest(dold)
    # into a fresh destination (a dense write records no undo): the new half alone
    if frac == 1.0:
        fresh_new = np.zeros(2, np.uint64)
        undo = UndoLog(fresh=True)
        assert apply_segment(seg, np.zeros_like(old), bf16, undo, "t", dnew=fresh_new) is None
        assert lanes_digest(fresh_new) == digest_affine(new, start, (1,))


@pytest.mark.parametrize("op", ["xor", "add", "overwrite"])
def test_folded_digest_follows_every_op_and_is_untouched_on_failure(op: str) -> None:
    from weighthub.codec import EncodePolicy, Op, UndoLog, apply_segment, encode_segment_tracked
    from weighthub.digest import lanes_digest
    from weighthub.errors import FormatError
    from weighthub.tensors import DTYPE_BY_NAME

    bf16 = DTYPE_BY_NAME["BF16"]
    rng = np.random.default_rng(7)
    old = random_bits(rng, bf16, 5_000, special_frac=0.05)
    new = old.copy()
    pos = np.sort(rng.choice(old.size, 100, replace=False))
    # ±1 ulp favours add, a random low bit xor, random words overwrite (mask_ops off forces it)
    if op == "add":
        new[pos] += np.uint16(1)
    elif op == "xor":
        new[pos] ^= rng.integers(1, 4, pos.size, dtype=np.uint16)
    else:
        new[pos] = rng.integers(0, 1 << 16, pos.size, dtype=np.uint16)
    policy = EncodePolicy(mask_ops=op != "overwrite", groups=False)
    seg, change = encode_segment_tracked(old, new, bf16, tensor=0, start=77, policy=policy)
    assert seg is not None and seg.op == Op[op.upper()]
    dst, dnew, dold = old.copy(), np.zeros(2, np.uint64), np.zeros(2, np.uint64)
    apply_segment(seg, dst, bf16, UndoLog(), "t", dnew=dnew, dold=dold)
    assert np.array_equal(dst, new)
    assert digest_sub(lanes_digest(dnew), lanes_digest(dold)) == change
    # a stream cut short: refused, rolled back, and the sums untouched
    cut = replace(seg, val_bytes=seg.val_bytes[:-1])
    dst, undo = old.copy(), UndoLog()
    dnew, dold = np.zeros(2, np.uint64), np.zeros(2, np.uint64)
    with pytest.raises(FormatError):
        apply_segment(cut, dst, bf16, undo, "t", dnew=dnew, dold=dold)
    undo.rollback()
    assert np.array_equal(dst, old) and not dnew.any() and not dold.any()


def test_staged_old_digest_refuses_a_corrupt_stream() -> None:
    from weighthub.codec import Op, Positions, Segment, Values
    from weighthub.codec.digest import staged_old_digest
    from weighthub.errors import FormatError
    from weighthub.tensors import DTYPE_BY_NAME

    base = np.zeros(16, np.uint16)
    past_end = Segment(0, 0, 16, Op.XOR, Positions.GAPS, Values.VARINT, 1,
                       np.array([16], np.uint8), np.array([1], np.uint8))
    with pytest.raises(FormatError, match="out of range"):
        staged_old_digest(past_end, base, DTYPE_BY_NAME["BF16"], "c7")
    short = Segment(0, 0, 16, Op.XOR, Positions.GAPS, Values.VARINT, 2,
                    np.array([1], np.uint8), np.array([1, 1], np.uint8))
    with pytest.raises(FormatError, match="c7: corrupt segment"):
        staged_old_digest(short, base, DTYPE_BY_NAME["BF16"], "c7")
