"""Does a segment write only inside a shard box? (For chunks whose coverage is a box.)

A rank's shard of a column- or row-sharded tensor is strided in canonical flat order, so its
sparse segments span flat ranges that interleave other ranks' elements. Chunks are applied in
parallel and rolled back exactly only if what they write is disjoint, so a receiver must check,
before applying (while staging), that every position a box chunk's segment writes lies inside
the chunk's box, with the codec's position decoders (no apply kernel is involved).
"""

from __future__ import annotations

from ..codec import Op, Positions, Segment
from ..codec.segment import bitmap_positions, gap_positions
from ..errors import FormatError
from .box import ShardBox


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
        pos = gap_positions(seg.pos_bytes, seg.count, seg.numel)
        if pos is None:
            return "a corrupt gap stream"
    elif seg.positions == Positions.BITMAP:
        try:
            pos = bitmap_positions(seg, "a box segment")
        except FormatError as exc:
            return f"a corrupt bitmap ({exc})"
    else:
        return f"{seg.positions.name.lower()} positions (box segments use gaps or bitmap)"
    if pos.size and not box.contains(pos + seg.start).all():  # both decoders stop at numel
        return "positions outside the box"
    return None
