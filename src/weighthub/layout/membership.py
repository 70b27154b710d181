"""Does a segment write only inside a shard box? (For chunks whose coverage is a box.)

A rank's shard of a column- or row-sharded tensor is strided in canonical flat order, so its
sparse segments span flat ranges that interleave other ranks' elements. Chunks are applied in
parallel and rolled back exactly only if what they write is disjoint, so a receiver must check,
before applying (while staging), that every position a box chunk's segment writes lies inside
the chunk's box. Positions are decoded with numpy (no apply kernel is involved).
"""

from __future__ import annotations

import numpy as np

from ..codec import Op, Positions, Segment
from .box import ShardBox

_MAX_VARINT = 10


def gap_positions(buf: np.ndarray, count: int) -> np.ndarray | None:
    """Positions (relative to the segment start) of a `gaps` stream, or None if malformed."""
    b = np.asarray(buf, np.uint8)
    if count == 0:
        return np.empty(0, np.int64) if b.size == 0 else None  # bytes after the last entry
    ends = np.flatnonzero(b < 0x80)
    if ends.size != count or ends[-1] != b.size - 1:
        return None
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    lengths = ends - starts + 1
    if int(lengths.max()) > _MAX_VARINT:
        return None
    k = np.arange(b.size, dtype=np.int64) - np.repeat(starts, lengths)
    parts = (b.astype(np.uint64) & np.uint64(0x7F)) << (np.uint64(7) * k.astype(np.uint64))
    gaps = np.add.reduceat(parts, starts)
    if int(gaps.max()) >= 1 << 48:  # no tensor has that many elements
        return None
    return np.cumsum(gaps.astype(np.int64) + 1) - 1


def segment_outside(seg: Segment, box: ShardBox) -> str | None:
    """Why `seg` would write outside `box` (None: it stays inside).

    Dense segments must lie in one contiguous run of the box; sparse ones must code positions
    as gaps or a bitmap (exponent-grouped positions rank elements of the whole flat range,
    other ranks' included, so a rank cannot produce them) and every position must be in it.
    """
    if seg.op == Op.DENSE:
        return None if box.run_holding(seg.start, seg.stop) else "a dense range not inside one run"
    first, end = box.span
    if not first <= seg.start < seg.stop <= end:
        return "a range outside the box's flat span"
    if seg.positions == Positions.GAPS:
        pos = gap_positions(seg.pos_bytes, seg.count)
        if pos is None:
            return "a corrupt gap stream"
    elif seg.positions == Positions.BITMAP:
        if seg.pos_bytes.size != -(-seg.numel // 8):
            return "a bitmap of the wrong size"
        pos = np.flatnonzero(np.unpackbits(seg.pos_bytes, count=seg.numel, bitorder="little"))
    else:
        return f"{seg.positions.name.lower()} positions (box segments use gaps or bitmap)"
    if pos.size and (int(pos[-1]) >= seg.numel or not box.contains(pos + seg.start).all()):
        return "positions outside the box"
    return None
