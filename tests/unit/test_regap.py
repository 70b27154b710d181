"""Receivers re-code exponent-grouped positions as plain gaps while staging (off the pause)."""

from __future__ import annotations

import numpy as np
import pytest

from weighthub.codec import (
    EncodePolicy,
    Op,
    Positions,
    Segment,
    UndoLog,
    Values,
    apply_segment,
    encode_segment,
    regap_segment,
)
from weighthub.errors import FormatError
from weighthub.tensors import DTYPE_BY_NAME

BF16 = DTYPE_BY_NAME["BF16"]


def _grouped_pair(n: int = 200_000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """bf16-like words whose change probability depends on the exponent, so groups win."""
    rng = np.random.default_rng(seed)
    exp = rng.integers(110, 125, n, dtype=np.uint16)
    old = (exp << 7) | rng.integers(0, 128, n, dtype=np.uint16)
    p = np.where(exp < 116, 0.2, 0.002)
    new = old.copy()
    changed = rng.random(n) < p
    new[changed] += np.uint16(1)
    return old, new


def _applies_exactly(seg, old: np.ndarray, new: np.ndarray) -> None:
    dst = old.copy()
    undo = UndoLog()
    apply_segment(seg, dst, BF16, undo, "test")
    assert np.array_equal(dst, new)
    undo.rollback()
    assert np.array_equal(dst, old)


def test_regap_applies_bit_exact_and_uses_gaps() -> None:
    old, new = _grouped_pair()
    seg = encode_segment(old, new, BF16, tensor=0, start=0, policy=EncodePolicy(groups=True, ctx=False))
    assert seg is not None and seg.positions == Positions.GROUPS
    fast = regap_segment(seg, old, BF16, "test")
    assert fast.positions == Positions.GAPS and fast.count == seg.count
    _applies_exactly(fast, old, new)


@pytest.mark.parametrize(("coder", "coding"), [("ans", Positions.ANS), ("range", Positions.CTX)])
def test_regap_decodes_a_context_coded_segment_to_gaps_while_staging(coder: str,
                                                                     coding: Positions) -> None:
    """The default profile's context-coded segment (ans, or ctx from older writers) is decoded
    against the held words before the pause, so the pause runs the same gap kernel as for
    `fast` segments."""
    old, new = _grouped_pair()
    seg = encode_segment(old, new, BF16, tensor=0, start=0, policy=EncodePolicy(coder=coder))
    assert seg is not None and seg.positions == coding
    fast = regap_segment(seg, old, BF16, "test")
    assert (fast.positions, fast.op, fast.count) == (Positions.GAPS, seg.op, seg.count)
    assert fast.values in (Values.VARINT, Values.ZIGZAG)
    _applies_exactly(fast, old, new)


def test_regap_of_a_corrupt_group_stream_fails_before_anything_is_applied() -> None:
    old, new = _grouped_pair()
    seg = encode_segment(old, new, BF16, tensor=0, start=0, policy=EncodePolicy(groups=True, ctx=False))
    assert seg is not None
    broken = seg.pos_bytes.copy()
    broken[-1] ^= 0x80  # the last varint now claims a continuation byte that is not there
    from dataclasses import replace

    with pytest.raises(FormatError):
        regap_segment(replace(seg, pos_bytes=broken), old, BF16, "test")


def test_regap_leaves_other_codings_alone() -> None:
    old, new = _grouped_pair()
    seg = encode_segment(old, new, BF16, tensor=0, start=0, policy=EncodePolicy(groups=False))
    assert seg is not None and regap_segment(seg, old, BF16, "test") is seg


def _leb(v: int) -> bytes:
    out = bytearray()
    while True:
        out.append((v & 0x7F) | (0x80 if v >> 7 else 0))
        v >>= 7
        if not v:
            return bytes(out)


def _grouped(groups: list[tuple[int, list[int]]], tail: bytes = b"") -> bytes:
    """A GROUPS position stream: the table (groups, then each one's key and count), then each
    group's rank gaps (spec §2)."""
    table = _leb(len(groups)) + b"".join(_leb(k) + _leb(len(g)) for k, g in groups)
    return table + b"".join(_leb(v) for _, g in groups for v in g) + tail


def _with_positions(stream: bytes, count: int):
    old, new = _grouped_pair()
    seg = encode_segment(old, new, BF16, tensor=0, start=0, policy=EncodePolicy(groups=True, ctx=False))
    assert seg is not None and seg.positions == Positions.GROUPS
    from dataclasses import replace

    return replace(seg, pos_bytes=np.frombuffer(stream, np.uint8), count=count), old


@pytest.mark.parametrize("dtype,n", [("BF16", 100), ("BF16", 70_001), ("F32", 70_001),
                                     ("F16", 5_000), ("F8_E4M3", 70_001)])
def test_regap_places_grouped_ranks_where_they_were_taken(dtype: str, n: int) -> None:
    """Grouped positions decode (by the block placement, or word by word for short ranges and
    keys wider than a byte) to exactly the changed positions, which then apply bit-exactly."""
    dt = DTYPE_BY_NAME[dtype]
    rng = np.random.default_rng(n)
    words = rng.integers(0, 1 << (8 * dt.width - 1), n).astype(dt.uint)  # any bits will do
    keys = (words >> dt.exponent_shift) & dt.exponent_mask
    changed = np.flatnonzero(rng.random(n) < np.where(keys % 3 == 0, 0.2, 0.01))
    groups = []
    for k in np.unique(keys[changed]):
        of_key = np.flatnonzero(keys == k)
        ranks = np.searchsorted(of_key, changed[keys[changed] == k])
        groups.append((int(k), np.diff(ranks, prepend=-1).astype(int) - 1))
    seg = Segment(0, 0, n, Op.XOR, Positions.GROUPS, Values.VARINT, changed.size,
                  np.frombuffer(_grouped(groups), np.uint8), np.ones(changed.size, np.uint8))
    fast = regap_segment(seg, words, dt, "test")
    assert fast.positions == Positions.GAPS and fast.count == changed.size
    dst = words.copy()
    apply_segment(fast, dst, dt, UndoLog(), "test")
    assert np.array_equal(np.flatnonzero(dst != words), changed)
    assert np.array_equal(dst[changed], words[changed] ^ dt.uint(1))


def test_regap_places_the_last_element_of_a_key_and_refuses_one_past_it() -> None:
    old, _ = _grouped_pair()
    key = 110
    of_key = np.flatnonzero((old >> 7) == key)
    seg, _ = _with_positions(_grouped([(key, [of_key.size - 1])]), 1)
    fast = regap_segment(seg, old, BF16, "test")
    assert fast.pos_bytes.tobytes() == _leb(int(of_key[-1]))
    seg, _ = _with_positions(_grouped([(key, [of_key.size])]), 1)
    with pytest.raises(FormatError, match="out of range"):
        regap_segment(seg, old, BF16, "test")


@pytest.mark.parametrize("why,groups,tail,count,match", [
    ("a rank gap past any range", [(110, [200_000])], b"", 1, "out of range"),
    ("rank gaps summing past the range", [(110, [100_000, 100_000])], b"", 2, "out of range"),
    ("a trailing byte", [(110, [3])], b"\x00", 1, "bytes left"),
    ("a truncated varint", [(110, [3, 1 << 40])], b"", 2, "ends before"),
    ("more changes than gap bytes", [(110, [3]), (111, [4] * 3)], b"", 4, "4 grouped positions in 1"),
])
def test_regap_refuses_hostile_grouped_ranks(why: str, groups, tail: bytes, count: int,
                                             match: str) -> None:
    """Refused with the kernels' reasons; the last before anything is allocated for the
    declared count."""
    stream = _grouped(groups, tail)
    if why == "a truncated varint":
        stream = stream[:-1]
    if why == "more changes than gap bytes":
        stream = stream[:-3]  # the table still says 4 changes: 1 gap byte left for 3
    seg, old = _with_positions(stream, count)
    with pytest.raises(FormatError, match=match):
        regap_segment(seg, old, BF16, "test")
