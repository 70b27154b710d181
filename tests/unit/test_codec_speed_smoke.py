"""Smoke tests of the codec's fast paths: bit-exact round trips, exact rollback, corrupt input.

No timing here: benchmarks are machine-dependent. Each case forces one fast path on ~100k
elements (chunked word scan with its unaligned head/tail and output growth, grouped positions
with the sampling probe, specialised apply loops).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from weighthub.codec import (
    EncodePolicy,
    Op,
    Positions,
    Segment,
    UndoLog,
    apply_segment,
    changed_positions,
    encode_segment,
)
from weighthub.codec import encode as S
from weighthub.codec.scan import scan_range
from weighthub.errors import FormatError
from weighthub.tensors import DTYPE_BY_NAME, bits

BF16 = DTYPE_BY_NAME["BF16"]
N = 100_003  # odd: word scan has a tail


def _pair(rate: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    old = bits((torch.randn(N, generator=g) * 0.02).to(torch.bfloat16)).copy()
    rng = np.random.default_rng(seed)
    new = old.copy()
    idx = np.flatnonzero(rng.random(N) < rate)
    new[idx] += rng.choice(np.array([1, 65535, 2, 65534, 0x8000], np.uint16), size=idx.size)
    return old, new


def _round_trip(seg: Segment, old: np.ndarray, new: np.ndarray) -> None:
    dst = old.copy()
    undo = UndoLog()
    apply_segment(seg, dst, BF16, undo, "t")
    assert np.array_equal(dst, new)
    undo.rollback()
    assert np.array_equal(dst, old)


@pytest.mark.parametrize("offset", [0, 1, 3])
@pytest.mark.parametrize("rate", [0.001, 0.03, 0.2])  # 0.2 outgrows the initial scan buffer
def test_changed_positions_matches_numpy(offset: int, rate: float) -> None:
    old, new = _pair(rate)
    a, b = old[offset:], new[offset:]
    assert np.array_equal(changed_positions(a, b), np.flatnonzero(a != b))
    # differently aligned inputs take the copying path
    assert np.array_equal(changed_positions(old[offset:-1], new[offset + 1 :]),
                          np.flatnonzero(old[offset:-1] != new[offset + 1 :]))


@pytest.mark.parametrize("policy", [EncodePolicy(groups=False), EncodePolicy(mask_ops=False),
                                    EncodePolicy(value_sample=0), EncodePolicy(value_sample=64)])
@pytest.mark.parametrize("rate", [0.01, 0.1])
def test_encode_apply_round_trip(policy: EncodePolicy, rate: float) -> None:
    old, new = _pair(rate, seed=1)
    seg = encode_segment(old[1:], new[1:], BF16, tensor=0, start=1, policy=policy)
    assert seg is not None and seg.op != Op.DENSE
    if not policy.mask_ops:
        assert seg.op == Op.OVERWRITE
    _round_trip(seg, old[1:], new[1:])


@pytest.mark.parametrize("op", [Op.ADD, Op.XOR, Op.OVERWRITE])
@pytest.mark.parametrize("positions", [Positions.GAPS, Positions.GROUPS, Positions.BITMAP])
def test_every_position_coding_and_op(op: Op, positions: Positions) -> None:
    old, new = _pair(0.03, seed=2)
    ch = scan_range(old, new, N)
    assert ch is not None
    codec = {Op.ADD: S.Values.ZIGZAG, Op.XOR: S.Values.VARINT, Op.OVERWRITE: S.Values.RAW}[op]
    pos_bytes = {
        Positions.GAPS: lambda: S.encode_gaps(ch.pos),
        Positions.GROUPS: lambda: S._encode_groups(old, ch.pos, BF16),
        Positions.BITMAP: lambda: np.packbits(old != new, bitorder="little"),
    }[positions]()
    seg = Segment(0, 0, N, op, positions, codec, ch.pos.size, pos_bytes,
                  S._encode_vals(ch, codec, BF16))
    _round_trip(seg, old, new)


V1 = EncodePolicy(ctx=False)


def test_group_probe_on_small_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    # magnitude-dependent changes (small weights change more): the probe must let groups win
    # (groups as `compact` codes them with the context coding off; ctx needs no probe)
    old, _ = _pair(0.0, seed=3)
    rng = np.random.default_rng(3)
    exp = (old >> 7) & 0xFF
    new = old.copy()
    hit = rng.random(N) < np.where(exp < 118, 0.3, 0.002)
    new[hit] += 1
    monkeypatch.setattr(S, "_PROBE_WINDOW", 4096)
    seg = encode_segment(old, new, BF16, tensor=0, start=0, policy=V1)
    assert seg is not None and seg.positions == Positions.GROUPS
    _round_trip(seg, old, new)
    # uniform changes: the probe skips the grouped pass
    old, new = _pair(0.01, seed=4)
    seg = encode_segment(old, new, BF16, tensor=0, start=0, policy=V1)
    assert seg is not None and seg.positions == Positions.GAPS
    _round_trip(seg, old, new)


@pytest.mark.parametrize("positions", [Positions.GAPS, Positions.GROUPS])
def test_corrupt_streams_refused_and_rolled_back(positions: Positions) -> None:
    old, new = _pair(0.02, seed=5)
    ch = scan_range(old, new, N)
    assert ch is not None
    pos_bytes = (S.encode_gaps(ch.pos) if positions == Positions.GAPS
                 else S._encode_groups(old, ch.pos, BF16))
    vals = S._encode_vals(ch, S.Values.ZIGZAG, BF16)
    rng = np.random.default_rng(5)
    variants = [(pos_bytes[:-1], vals), (pos_bytes, vals[:-1]), (pos_bytes, vals[:10])]
    for _ in range(20):  # random byte flips, including into huge varints
        pb, vb = pos_bytes.copy(), vals.copy()
        pb[rng.integers(pb.size)] = rng.integers(256)
        vb[rng.integers(vb.size)] = 0xFF
        variants.append((pb, vb))
    variants.append((np.full(pos_bytes.size, 0xFF, np.uint8), vals))
    for pb, vb in variants:
        for count in (ch.pos.size, ch.pos.size + 1, ch.pos.size - 1):
            seg = Segment(0, 0, N, Op.ADD, positions, S.Values.ZIGZAG, count, pb, vb)
            dst = old.copy()
            undo = UndoLog()
            with contextlib.suppress(FormatError):
                apply_segment(seg, dst, BF16, undo, "t")
            undo.rollback()
            assert np.array_equal(dst, old)
