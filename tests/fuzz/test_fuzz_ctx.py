"""Fuzz the context-coded segment decoders (staging's codec.prepared over
codec.ctx.decode_changes, and the pause's codec.ctx.decode_ctx: the ctx and ans kernels)
directly: streams a writer emits for xor and add changes of every float dtype, then truncated,
extended, bit-flipped or byte-edited, with counts and ranges edited. A refusal must be a
FormatError before anything is written, a success must apply and roll back bit for bit
(targets.ctx); the segments target fuzzes the same coding inside chunk frames."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given

from weighthub.codec.coding import Op, Positions

from .strategies import ci_settings
from .strategies_ctx import ctx_input
from .targets import CTX_ADD, CTX_ANS, CTX_HEADER, FLOAT_DTYPES, base_words, check


@pytest.mark.parametrize("coding", [Positions.ANS, Positions.CTX], ids=["ans", "ctx"])
def test_unedited_inputs_apply(coding: Positions) -> None:
    """The target really decodes and applies: an unedited writer's segment applies."""
    from weighthub.codec.ctx import ctx_streams

    dtype = FLOAT_DTYPES[0]
    old = base_words(300, dtype)
    pos = np.array([3, 50, 299])
    new = old.copy()
    new[pos] += 1
    coded = ctx_streams(old, pos, old[pos], new[pos], dtype, Op.ADD, coding)
    assert coded is not None
    pb, vb = coded
    flags = CTX_ADD | (CTX_ANS if coding == Positions.ANS else 0)
    data = CTX_HEADER.pack(0, flags, 3, 300, pb.size) + pb.tobytes() + vb.tobytes()
    assert check("ctx", data) == 3


@pytest.mark.slow
@ci_settings(1500)
@given(ctx_input())
def test_ctx_decode_refuses_or_applies_and_rolls_back_exactly(data: bytes) -> None:
    check("ctx", data)
