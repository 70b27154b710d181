"""codec/device.py against the numba host kernels, bit for bit.

Every device function is compared with integer equality against the kernel it stands in for
(scan.scan_range, kernels.group_ranks, kernels.apply_positions / _combine, kernels.restore), on
every word width and float bit layout, with slices made small so that every multi-slice path
runs at test sizes. The CUDA variants run the same comparisons with CUDA tensors.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bit_patterns import random_bits, special_patterns
from reference_codec import leb128, make_pair
from weighthub.codec import device as D
from weighthub.codec import device_words as W
from weighthub.codec import kernels as K
from weighthub.codec.scan import scan_range as _scan
from weighthub.errors import UsageError
from weighthub.tensors import DTYPES, DType, readonly

# deselected without CUDA (tests/conftest.py: the `gpu` marker), never reported as skipped
CUDA = pytest.mark.gpu
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
WORDS = [d for d in DTYPES if d.name in ("U8", "I16", "I32", "I64")]  # one per width
FLOATS = [d for d in DTYPES if d.is_float]
SCANNED = WORDS + FLOATS
_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_NO_SUM = np.zeros(0, np.uint64)
OPS = [D.OP_XOR, D.OP_ADD, D.OP_SUB, D.OP_OVERWRITE]
FEW = settings(max_examples=25, deadline=None)


def words(a: np.ndarray, device: str) -> torch.Tensor:
    """The torch word view (uint8/int16/int32/int64) of unsigned numpy bits, on device."""
    return torch.from_numpy(np.ascontiguousarray(a).view(_SIGNED[a.itemsize]).copy()).to(device)


def host(t: torch.Tensor) -> np.ndarray:
    """Unsigned numpy bits of a word tensor."""
    return t.cpu().numpy().view(f"u{t.element_size()}")


@contextmanager
def slices(n: int | None) -> Iterator[None]:
    """Run with device.SLICE = n (None: unchanged); hypothesis forbids monkeypatch fixtures."""
    saved = W.SLICE
    W.SLICE = saved if n is None else n
    try:
        yield
    finally:
        W.SLICE = saved


def flip(rng: np.random.Generator, old: np.ndarray, rate: float) -> np.ndarray:
    """old with a `rate` fraction of words changed (each by a nonzero XOR)."""
    new = old.copy()
    hit = rng.random(old.size) < rate
    bits = 8 * old.itemsize
    x = rng.integers(1, 1 << min(bits, 63), int(hit.sum()), dtype=np.uint64, endpoint=False)
    new[hit] ^= x.astype(old.dtype)
    return new


# --- constants and import -------------------------------------------------------------------


def test_op_ids_equal_the_kernels() -> None:
    assert (D.OP_XOR, D.OP_ADD, D.OP_SUB, D.OP_OVERWRITE) == \
        (K.OP_XOR, K.OP_ADD, K.OP_SUB, K.OP_OVERWRITE)


def test_import_does_not_load_numba() -> None:
    code = "import sys, weighthub.codec.device; sys.exit('numba' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


# --- scan -----------------------------------------------------------------------------------


def check_scan(old: np.ndarray, new: np.ndarray, limit: int, device: str) -> None:
    ref = _scan(old, new, limit)
    got = D.scan(words(old, device), words(new, device), limit)
    assert (got is None) == (ref is None)
    if ref is None or got is None:
        return
    pos, ov, nv = got.to_host()
    assert got.pos.device.type == device and got.old.dtype == words(old[:0], "cpu").dtype
    for a, b in ((pos, ref.pos), (ov, ref.old), (nv, ref.new)):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", SCANNED, ids=lambda d: d.name)
@pytest.mark.parametrize("n", [0, 1, 7, 1001])
@pytest.mark.parametrize("rate", [0.0, 0.01, 0.5, 1.0])
def test_scan_matches_host(device: str, dtype: DType, n: int, rate: float) -> None:
    rng = np.random.default_rng(n + int(rate * 100))
    old = random_bits(rng, dtype, n)
    new = flip(rng, old, rate)
    for slice_size in (None, 64):  # one slice, then 16 of them
        with slices(slice_size):
            check_scan(old, new, n, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", SCANNED, ids=lambda d: d.name)
@FEW
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 3000),
       rate=st.sampled_from([0.0, 0.001, 0.01, 0.2, 0.5, 1.0]), slice_size=st.integers(1, 700),
       slack=st.integers(-3, 3))
def test_scan_property(device: str, dtype: DType, seed: int, n: int, rate: float,
                       slice_size: int, slack: int) -> None:
    old, new = make_pair(dtype, seed, n, rate)
    limit = int((old != new).sum()) + slack  # around the give-up point, both sides of it
    with slices(slice_size):
        check_scan(old, new, limit, device)
        check_scan(old, new, n, device)


@pytest.mark.parametrize("device", DEVICES)
def test_scan_counts_signed_zero_and_nan_payloads(device: str) -> None:
    old = torch.tensor([0.0, -0.0, float("nan"), 1.0, float("inf"), -0.0], dtype=torch.bfloat16)
    new = old.clone()
    new[0], new[1] = -0.0, 0.0  # equal as floats, different bits
    raw = new.view(torch.int16)
    raw[2] = raw[2] | 1  # another NaN payload
    # index 5 keeps -0.0: NaN-aware float equality would be wrong at 0, 1 and 2
    got = D.scan(old.view(torch.int16).to(device), raw.to(device), 6)
    assert got is not None
    assert got.to_host()[0].tolist() == [0, 1, 2]
    ref = _scan(old.view(torch.int16).numpy().view(np.uint16), raw.numpy().view(np.uint16), 6)
    assert ref is not None and ref.pos.tolist() == [0, 1, 2]


@pytest.mark.parametrize("device", DEVICES)
def test_scan_gives_up_over_the_limit(device: str) -> None:
    old = torch.zeros(100, dtype=torch.int16, device=device)
    new = old.clone()
    new[::10] = 1
    with slices(16):
        assert D.scan(old, new, 9) is None
        got = D.scan(old, new, 10)
        assert got is not None and got.pos.tolist() == list(range(0, 100, 10))
    assert D.scan(old[:0], new[:0], -1) is None  # as _scan: 0 > -1
    assert _scan(np.zeros(0, np.uint16), np.zeros(0, np.uint16), -1) is None


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_to_host_gives_unsigned_words(width: int) -> None:
    old = words(np.arange(5, dtype=f"u{width}"), "cpu")
    got = D.scan(old, old + 1, 5)
    assert got is not None
    pos, ov, nv = got.to_host()
    assert pos.dtype == np.int64 and ov.dtype == nv.dtype == np.dtype(f"u{width}")
    assert nv.tolist() == [1, 2, 3, 4, 5]


def test_scan_refuses_bad_inputs() -> None:
    a = torch.zeros(8, dtype=torch.int16)
    with pytest.raises(UsageError, match="1-D"):
        D.scan(a.view(2, 4), a.view(2, 4), 8)
    with pytest.raises(UsageError):
        D.scan(a, a[:7], 8)
    with pytest.raises(UsageError):
        D.scan(a, torch.zeros(8, dtype=torch.int32), 8)
    with pytest.raises(UsageError, match="word tensor"):
        D.scan(a.view(torch.bfloat16), a.view(torch.bfloat16), 8)  # float compare: NaN, -0.0
    with pytest.raises(UsageError):
        D.scan(a, torch.zeros(8, dtype=torch.int16, device="meta"), 8)


# --- group_ranks ----------------------------------------------------------------------------


def ref_group_ranks(old: np.ndarray, pos: np.ndarray, shift: int, mask: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    keys = np.empty(pos.size, np.uint64)
    ranks = np.empty(pos.size, np.int64)
    done = K.group_ranks(readonly(old), readonly(pos), pos.size, shift, np.uint64(mask), keys,
                         ranks)
    assert done == pos.size
    return keys.astype(np.int64), ranks


def check_group_ranks(old: np.ndarray, pos: np.ndarray, shift: int, mask: int, device: str
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    rk, rr = ref_group_ranks(old, pos, shift, mask)
    keys, ranks = D.group_ranks(words(old, device), torch.from_numpy(pos).to(device), shift, mask)
    assert keys.dtype == ranks.dtype == torch.int64 and keys.device.type == device
    assert np.array_equal(keys.cpu().numpy(), rk) and np.array_equal(ranks.cpu().numpy(), rr)
    return keys, ranks


def random_positions(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    return np.flatnonzero(rng.random(n) < rate).astype(np.int64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@FEW
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 4000),
       rate=st.sampled_from([0.001, 0.015, 0.3, 1.0]), slice_size=st.integers(64, 900))
def test_group_ranks_match_host(device: str, dtype: DType, seed: int, n: int, rate: float,
                                slice_size: int) -> None:
    rng = np.random.default_rng(seed)
    old = random_bits(rng, dtype, n)
    pos = random_positions(rng, n, rate)
    with slices(slice_size):
        check_group_ranks(old, pos, dtype.exponent_shift, dtype.exponent_mask, device)
    check_group_ranks(old, pos, dtype.exponent_shift, dtype.exponent_mask, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("width", "shift", "mask"), [
    (2, 0, 0xFFFF),  # the whole word: past the int16 sign bit (an int32 key path)
    (2, 12, 0xFF),  # a mask wider than the bits left above the shift
    (8, 60, 0xFF),  # a logical shift of 64-bit words: arithmetic shifts bring in sign bits
    (8, 0, 0x7FF), (4, 31, 0x3), (1, 9, 0x7), (1, 0, 0xFF),  # shift past an 8-bit word: key 0
])
def test_group_ranks_any_field(device: str, width: int, shift: int, mask: int) -> None:
    rng = np.random.default_rng(width * 100 + shift)
    dtype = next(d for d in WORDS if d.width == width)
    old = random_bits(rng, dtype, 3000)
    pos = random_positions(rng, 3000, 0.05)
    with slices(257):
        check_group_ranks(old, pos, shift, mask, device)


@pytest.mark.parametrize("device", DEVICES)
def test_group_ranks_carry_across_slices_without_changes(device: str) -> None:
    rng = np.random.default_rng(5)
    dtype = DTYPES[0]  # BF16
    old = random_bits(rng, dtype, 10_000)
    pos = np.array([0, 4999, 5000, 5001, 9999], np.int64)  # slices 1-3 and 6-8 have none
    with slices(1000):
        check_group_ranks(old, pos, dtype.exponent_shift, dtype.exponent_mask, device)
        check_group_ranks(old, pos[:3], dtype.exponent_shift, dtype.exponent_mask, device)
    keys, ranks = D.group_ranks(words(old, device), torch.zeros(0, dtype=torch.int64), 7, 0xFF)
    assert keys.numel() == ranks.numel() == 0


def test_group_ranks_refuses_bad_positions() -> None:
    old = torch.zeros(10, dtype=torch.int16)
    for bad in ([3, 3], [4, 2], [10], [-1, 2]):
        with pytest.raises(UsageError, match="strictly increasing"):
            D.group_ranks(old, torch.tensor(bad), 7, 0xFF)
    with pytest.raises(UsageError, match="mask"):
        D.group_ranks(old, torch.tensor([1]), 7, 1 << 40)
    with pytest.raises(UsageError, match="shift"):
        D.group_ranks(old, torch.tensor([1]), 64, 0xFF)
    keys, ranks = D.group_ranks(old, np.array([1, 5]), 7, 0xFF)  # numpy positions are fine
    assert ranks.tolist() == [1, 5] and keys.tolist() == [0, 0]


# --- place_ranks ----------------------------------------------------------------------------


def group_major(keys: np.ndarray, ranks: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(order, gkey, gstart, ranks in group-major order) of group_ranks' output."""
    order = np.argsort(keys, kind="stable")
    gkey, counts = np.unique(keys, return_counts=True)
    gstart = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return order, gkey.astype(np.int64), gstart, ranks[order]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@FEW
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 4000),
       rate=st.sampled_from([0.001, 0.015, 0.3, 1.0]), slice_size=st.integers(64, 900),
       as_numpy=st.booleans())
def test_place_ranks_inverts_group_ranks(device: str, dtype: DType, seed: int, n: int,
                                         rate: float, slice_size: int, as_numpy: bool) -> None:
    rng = np.random.default_rng(seed)
    old = random_bits(rng, dtype, n)
    pos = random_positions(rng, n, rate)
    shift, mask = dtype.exponent_shift, dtype.exponent_mask
    keys, ranks = ref_group_ranks(old, pos, shift, mask)
    order, gkey, gstart, granks = group_major(keys, ranks)
    table = (gkey, gstart, granks) if as_numpy else \
        (torch.from_numpy(gkey), torch.from_numpy(gstart), torch.from_numpy(granks))
    base = words(old, device)
    for slice_size_now in (slice_size, None):  # several slices, then one
        with slices(slice_size_now):
            got = D.place_ranks(base, shift, mask, *table)
        assert got is not None and got.device.type == device and got.dtype == torch.int64
        assert np.array_equal(got.cpu().numpy(), pos[order])
    assert np.array_equal(host(base), old)  # read only


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slice_size", [None, 37])
def test_place_ranks_any_group_order(device: str, slice_size: int | None) -> None:
    rng = np.random.default_rng(1)
    dtype = DTYPES[0]
    old = random_bits(rng, dtype, 2000)
    pos = random_positions(rng, 2000, 0.1)
    keys, ranks = ref_group_ranks(old, pos, dtype.exponent_shift, dtype.exponent_mask)
    order, gkey, gstart, granks = group_major(keys, ranks)
    # groups in decreasing key order, ranks decreasing within each: still one position each
    rev_key, sizes = gkey[::-1], np.diff(gstart)[::-1]
    rev_start = np.concatenate([[0], np.cumsum(sizes)])
    rev_ranks, rev_pos = granks[::-1].copy(), pos[order][::-1].copy()
    with slices(slice_size):
        got = D.place_ranks(words(old, device), 7, 0xFF, rev_key, rev_start, rev_ranks)
    assert got is not None and np.array_equal(got.cpu().numpy(), rev_pos)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slice_size", [None, 3])
def test_place_ranks_refuses_out_of_range_ranks(device: str, slice_size: int | None) -> None:
    # bf16 words with exponent keys 0x7F (1.0) x 6 and 0x80 (2.0) x 4
    base = torch.tensor([1, 2, 1, 1, 2, 2, 1, 1, 2, 1], dtype=torch.bfloat16).view(torch.int16)
    base = base.to(device)
    with slices(slice_size):
        ok = D.place_ranks(base, 7, 0xFF, np.array([0x7F, 0x80]), np.array([0, 2, 4]),
                           np.array([0, 5, 0, 3]))
        assert ok is not None and ok.tolist() == [0, 9, 1, 8]
        for gkey, gstart, ranks in [
            ([0x7F], [0, 1], [6]),  # only 6 elements have key 0x7F
            ([0x80], [0, 2], [0, 4]),
            ([0x7F], [0, 1], [-1]),
            ([0x7F], [0, 1], [11]),  # key·(n+1) + rank = 0x80·(n+1): must not pass for (0x80, 0)
            ([0x10], [0, 1], [0]),  # a key no element has
            ([0x100], [0, 1], [0]),  # a key past the mask
            ([-1], [0, 1], [0]),
        ]:
            assert D.place_ranks(base, 7, 0xFF, np.array(gkey), np.array(gstart),
                                 torch.tensor(ranks)) is None
    empty = D.place_ranks(base, 7, 0xFF, np.zeros(0, np.int64), np.zeros(1, np.int64),
                          np.zeros(0, np.int64))
    assert empty is not None and empty.numel() == 0


def test_place_ranks_refuses_a_malformed_group_table() -> None:
    base = torch.zeros(10, dtype=torch.int16)
    for gkey, gstart, ranks in [([0], [0], [0]), ([0], [1, 1], [0]), ([0, 1], [0, 2, 1], [0, 1]),
                                ([0], [0, 2], [0])]:
        with pytest.raises(UsageError, match="group starts"):
            D.place_ranks(base, 7, 0xFF, np.array(gkey), np.array(gstart), np.array(ranks))
    with pytest.raises(UsageError, match="integer"):
        D.place_ranks(base, 7, 0xFF, np.array([0.0]), np.array([0, 1]), np.array([0]))


# --- combine, apply_sparse, restore ---------------------------------------------------------


def varints(z: np.ndarray) -> np.ndarray:
    return np.frombuffer(b"".join(leb128(v) for v in z.tolist()), np.uint8).copy()


def ref_apply(dst: np.ndarray, pos: np.ndarray, z: np.ndarray, op: int) -> np.ndarray:
    """kernels.apply_positions with varint values z (any uint64) at increasing pos: dst is
    changed in place; returns the undo words."""
    n = pos.size
    undo_pos, undo_val = np.empty(n, np.int64), np.empty(n, dst.dtype)
    mask = np.uint64((1 << (8 * dst.itemsize)) - 1)
    status, done = K.apply_positions(dst, readonly(pos), op, K.VAL_VARINT, readonly(varints(z)),
                                     n, mask, undo_pos, undo_val, 0, _NO_SUM, _NO_SUM)
    assert status == done == n
    return undo_val


def edge_cases(width: int) -> tuple[np.ndarray, np.ndarray]:
    """Every (old, z) pair of edge words and edge values of a width: wrap-around at 0 and
    2^B − 1, values past the mask, zigzag of ±1, ±2 and the extremes."""
    bits = 8 * width
    top, sign = (1 << bits) - 1, 1 << (bits - 1)
    olds = sorted({0, 1, 2, sign - 1, sign, sign + 1, top - 1, top})
    zs = sorted(v for v in {0, 1, 2, 3, 4, top - 1, top, top + 1, top + 2, 2 * top - 1, 1 << 63,
                            (1 << 63) + 1, (1 << 64) - 1, (1 << 64) - 2} if v < 1 << 64)
    o, z = np.meshgrid(np.array(olds, np.uint64), np.array(zs, np.uint64))
    return o.ravel().astype(f"u{width}"), z.ravel()


def check_combine(old: np.ndarray, z: np.ndarray, op: int, device: str) -> None:
    ref = old.copy()
    ref_apply(ref, np.arange(old.size, dtype=np.int64), z, op)
    got = D.combine(words(old, device), torch.from_numpy(z.view(np.int64)).to(device), op,
                    8 * old.itemsize)
    assert got.dtype == words(old[:0], "cpu").dtype and got.device.type == device
    assert np.array_equal(host(got), ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_combine_edge_values(device: str, op: int, width: int) -> None:
    check_combine(*edge_cases(width), op, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", WORDS + FLOATS, ids=lambda d: d.name)
@FEW
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 300))
def test_combine_matches_host(device: str, op: int, dtype: DType, seed: int, n: int) -> None:
    rng = np.random.default_rng(seed)
    old = random_bits(rng, dtype, n)
    small = rng.integers(0, 8, n, dtype=np.uint64)  # zigzag of small differences, small XORs
    full = rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)
    check_combine(old, np.where(rng.random(n) < 0.5, small, full), op, device)


def py_combine(o: int, z: int, op: int, bits: int) -> int:
    """kernels._combine in Python ints, for any mask width."""
    m = (1 << bits) - 1
    unzz = (z >> 1) ^ (m if z & 1 else 0)
    return {D.OP_XOR: (o ^ z) & m, D.OP_ADD: (o + unzz) & m, D.OP_SUB: (o - unzz) & m}.get(
        op, z & m)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("width", "bits"), [(1, 1), (2, 7), (2, 15), (4, 24), (8, 33), (8, 63)])
def test_combine_narrower_value_masks(op: int, width: int, bits: int) -> None:
    old, z = edge_cases(width)
    got = D.combine(words(old, "cpu"), torch.from_numpy(z.view(np.int64)), op, bits)
    want = [py_combine(o, v, op, bits) for o, v in zip(old.tolist(), z.tolist(), strict=True)]
    assert host(got).tolist() == want


def test_combine_refuses_bad_inputs() -> None:
    old = torch.zeros(4, dtype=torch.int16)
    z = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(UsageError, match="unknown op"):
        D.combine(old, z, 4, 16)  # DENSE is not a sparse op
    with pytest.raises(UsageError, match="value bits"):
        D.combine(old, z, D.OP_XOR, 32)
    with pytest.raises(UsageError, match="int64"):
        D.combine(old, z.to(torch.int32), D.OP_XOR, 16)
    with pytest.raises(UsageError, match="int64"):
        D.combine(old, z[:3], D.OP_XOR, 16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", WORDS + FLOATS, ids=lambda d: d.name)
@FEW
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 2000),
       rate=st.sampled_from([0.0, 0.01, 0.3, 1.0]))
def test_apply_sparse_and_restore_match_host(device: str, op: int, dtype: DType, seed: int,
                                             n: int, rate: float) -> None:
    rng = np.random.default_rng(seed)
    base = random_bits(rng, dtype, n)
    pos = random_positions(rng, n, rate)
    z = rng.integers(0, 2**64 - 1, pos.size, dtype=np.uint64, endpoint=True)
    z[rng.random(pos.size) < 0.7] &= np.uint64(7)  # mostly small values, as RL steps make
    ref = base.copy()
    ref_undo = ref_apply(ref, pos, z, op)
    dst = words(base, device)
    pos_t = torch.from_numpy(pos).to(device)
    undo = D.apply_sparse(dst, pos_t, torch.from_numpy(z.view(np.int64)).to(device), op,
                          8 * dtype.width)
    assert np.array_equal(host(dst), ref) and np.array_equal(host(undo), ref_undo)
    D.restore(dst, pos_t, undo)
    K.restore(ref, pos, ref_undo, pos.size)
    assert np.array_equal(host(dst), base) and np.array_equal(ref, base)
    D.restore(dst, pos_t, undo)  # idempotent
    assert np.array_equal(host(dst), base)


@pytest.mark.parametrize("device", DEVICES)
def test_apply_sparse_writes_into_the_tensors_storage(device: str) -> None:
    weight = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).to(
        torch.bfloat16).to(device)
    before = weight.clone()
    flat = weight.view(-1).view(torch.int16)  # the view a target hands the codec
    pos = torch.tensor([5, 0, 31], device=device)  # distinct, any order
    z = torch.tensor([1, 2, 0x8000], device=device)  # values: the uint64 XORs
    z16 = torch.tensor([1, 2, -0x8000], dtype=torch.int16, device=device)  # as int16 words
    undo = D.apply_sparse(flat, pos, z, D.OP_XOR, 16)
    seen = weight.view(torch.int16).reshape(-1)  # another view of the same storage
    old = before.view(torch.int16).reshape(-1)
    assert undo.tolist() == old[pos].tolist()
    want = old.clone()
    want[pos] = old[pos] ^ z16
    assert torch.equal(seen, want)
    if device == "cpu":  # and the numpy bit view the host codec uses sees it too
        from weighthub.tensors import bits
        assert np.array_equal(bits(weight), want.numpy().view(np.uint16))
    D.restore(flat, pos, undo)
    assert torch.equal(weight.view(torch.int16), before.view(torch.int16))


def test_apply_sparse_and_restore_refuse_bad_inputs() -> None:
    dst = torch.zeros(8, dtype=torch.int16)
    z = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(UsageError, match="int64"):
        D.apply_sparse(dst, torch.tensor([0, 1], dtype=torch.int32), z, D.OP_XOR, 16)
    with pytest.raises(UsageError, match="word tensor"):
        D.apply_sparse(dst.view(torch.float16), torch.tensor([0, 1]), z, D.OP_XOR, 16)
    with pytest.raises(UsageError, match="old words"):
        D.restore(dst, torch.tensor([0, 1]), torch.zeros(2, dtype=torch.int32))
    assert not dst.any()


def test_special_patterns_survive_a_round_trip_through_every_op() -> None:
    # ±0, inf, NaN payloads and subnormals of every float layout, xor'd/added and restored
    for dtype in FLOATS:
        words_np = special_patterns(dtype)
        dst = words(words_np, "cpu")
        pos = torch.arange(words_np.size)
        for op in (D.OP_XOR, D.OP_ADD, D.OP_SUB):
            undo = D.apply_sparse(dst, pos, torch.ones(words_np.size, dtype=torch.int64), op,
                                  8 * dtype.width)
            D.restore(dst, pos, undo)
            assert np.array_equal(host(dst), words_np)


# --- CUDA only: host syncs ------------------------------------------------------------------


def syncs(fn: Callable[[], object]) -> int:
    """Host syncs torch reports while fn runs (torch.cuda sync debug mode)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


@CUDA
def test_cuda_loops_sync_only_where_a_size_must_be_known() -> None:
    rng = np.random.default_rng(3)
    dtype = DTYPES[0]
    old = random_bits(rng, dtype, 4000)
    new = flip(rng, old, 0.05)
    a, b = words(old, "cuda"), words(new, "cuda")
    pos_h = np.flatnonzero(old != new).astype(np.int64)
    pos = torch.from_numpy(pos_h).cuda()
    _, gkey, gstart, granks = group_major(*ref_group_ranks(old, pos_h, 7, 0xFF))
    z = torch.ones(pos_h.size, dtype=torch.int64, device="cuda")
    calls = {
        "scan": (lambda: D.scan(a, b, 4000), 8),  # nonzero, once per slice
        "group_ranks": (lambda: D.group_ranks(a, pos, 7, 0xFF), 1),
        "place_ranks": (lambda: D.place_ranks(a, 7, 0xFF, gkey, gstart, granks), 8),
        "combine": (lambda: D.combine(a[pos], z, D.OP_ADD, 16), 0),
        "apply_sparse": (lambda: D.apply_sparse(a.clone(), pos, z, D.OP_XOR, 16), 0),
    }
    with slices(500):  # 8 slices
        for fn, _ in calls.values():
            fn()  # warm-up: lazy initialisation may sync once
        assert {name: syncs(fn) <= most for name, (fn, most) in calls.items()} == \
            dict.fromkeys(calls, True)
    assert syncs(lambda: D.place_ranks(a, 7, 0xFF, gkey, gstart, granks)) <= 1  # one slice
