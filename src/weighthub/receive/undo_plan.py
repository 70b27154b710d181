"""Which words a step may change, known before it changes any: for a target's crash journal.

A file target updated in place must have the old words of a step on disk (fsynced) before the
step writes the first of them, so that a process killed mid-apply can be rolled back without
the network. The chunks of a staged step are decoded already; their position streams say where
each segment writes: gap-coded positions and bitmaps are decoded by the codec (vectorized,
O(changed) and O(bitmap)), and a dense, exponent-grouped or undecodable segment counts as its whole range (a
superset is safe: words it does not change are journaled at the value they keep).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..codec import Positions
from ..codec.segment import Segment, bitmap_positions, gap_positions
from ..errors import FormatError
from ..targets.base import host_views
from ..tensors import Words
from .inputs import Step

# (words of one range of a view, positions in it or None for all of them)
Planned = list[tuple[np.ndarray, np.ndarray | None]]


def _positions(seg: Segment) -> np.ndarray | None:
    if seg.positions == Positions.GAPS:
        return gap_positions(seg.pos_bytes, seg.count, seg.numel)
    if seg.positions == Positions.BITMAP:
        try:
            return bitmap_positions(seg, "journal")
        except FormatError:
            return None
    return None


def plan_step(step: Step, all_views: Mapping[str, Words], alias: dict[str, str]) -> Planned | None:
    """Every range (and positions in it) `step` may write through `views`, or None when its
    chunks are a stream that cannot be read ahead (then the caller journals all it maps).
    Journaling targets (files) hold host memory."""
    if not isinstance(step.chunks, Sequence):
        return None
    views = host_views(all_views, "a journaling target")
    specs = step.specs
    out: Planned = []
    for chunk in step.chunks:
        if step.full:  # rewrites whole ranges (and boxes: their whole tensors)
            for ti, a, b in chunk.ref.covers:
                out.append((views[specs[ti].name][a:b], None))
            for ti, _offset, _shape in chunk.ref.boxes:
                out.append((views[specs[ti].name], None))
        for seg in chunk.frame.segments:
            spec = specs[seg.tensor]
            if alias[spec.name] != spec.name:
                continue  # tied: written through the first name
            dst = views[spec.name][seg.start: seg.stop]
            if not step.full:
                out.append((dst, _positions(seg)))
            elif not chunk.ref.covers and not chunk.ref.boxes:
                out.append((dst, None))
    return out


__all__ = ["Planned", "plan_step"]
