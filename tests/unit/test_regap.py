"""Receivers re-code exponent-grouped positions as plain gaps while staging (off the pause)."""

from __future__ import annotations

import numpy as np
import pytest

from weighthub.codec import (
    EncodePolicy,
    Positions,
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
