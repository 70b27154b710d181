"""The strategy of the context-coded segment target (targets.ctx): what the `ctx` and `ans`
encoders write for xor and add changes of every float dtype, then maybe edited."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from weighthub.codec.coding import Op, Positions

from .mutate import INTERESTING_INTS, apply_edits
from .strategies import edits
from .targets import CTX_ADD, CTX_ANS, CTX_HEADER, FLOAT_DTYPES, base_words


@st.composite
def ctx_input(draw: Any) -> bytes:
    """A context-coded segment as the encoder writes it, then maybe edited (see targets.ctx's
    layout)."""
    from weighthub.codec.ctx import ctx_streams

    di = draw(st.integers(0, len(FLOAT_DTYPES) - 1))
    dtype, op = FLOAT_DTYPES[di], draw(st.sampled_from([Op.XOR, Op.ADD]))
    coding = draw(st.sampled_from([Positions.ANS, Positions.CTX]))
    n = draw(st.one_of(st.integers(1, 64), st.integers(1, 4000)))
    old = base_words(n, dtype)
    rng = np.random.default_rng(draw(st.integers(0, (1 << 32) - 1)))
    pos = np.flatnonzero(rng.random(n) < draw(st.sampled_from([0.003, 0.05, 0.5, 1.0])))
    if pos.size == 0:
        pos = np.array([draw(st.integers(0, n - 1))])
    new = old.copy()
    new[pos] += rng.integers(1, 4, pos.size).astype(dtype.uint)  # small moves, as training makes
    coded = ctx_streams(old, pos, old[pos], new[pos], dtype, op, coding)
    if coded is None:  # f64 words spread over more exponents than ctx models: fewer changes
        pos = pos[:64]
        coded = ctx_streams(old, pos, old[pos], new[pos], dtype, op, coding)
        assert coded is not None
    streams = [coded[0].tobytes(), coded[1].tobytes()]
    count, pos_len = int(pos.size), len(streams[0])
    for _ in range(draw(st.integers(0, 2))):
        what = draw(st.sampled_from(["stream", "stream", "stream", "count", "n", "cut"]))
        if what == "stream":
            i = draw(st.integers(0, 1))
            streams[i] = apply_edits(streams[i], draw(edits))
        elif what == "count":
            count = draw(st.one_of(st.sampled_from([0, 1, count - 1, count + 1, 2 * count]),
                                   st.sampled_from([v for v in INTERESTING_INTS if 0 <= v < 1 << 32])))
        elif what == "n":
            n = draw(st.integers(1, 0xFFFF))
        else:  # move the boundary between the streams
            pos_len = draw(st.integers(0, len(streams[0]) + len(streams[1])))
    flags = (CTX_ADD if op == Op.ADD else 0) | (CTX_ANS if coding == Positions.ANS else 0)
    head = CTX_HEADER.pack(di, flags, max(0, count) & 0xFFFFFFFF, n, min(pos_len, 0xFFFF))
    return head + streams[0] + streams[1]
