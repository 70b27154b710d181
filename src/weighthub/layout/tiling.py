"""Check that the primary shard boxes of all ranks tile a canonical tensor exactly.

Every element must be published by exactly one rank: an overlap would make two chunks write the
same elements (the receiver applies chunks in parallel), a gap would leave elements no version
carries. Checked when a sharded publisher first sees a layout, before anything is written.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from ..errors import PlacementError
from .box import ShardBox

_MAX_GRID_CELLS = 1 << 16  # locating a gap on the compressed grid; beyond this, report the count


def check_tiling(name: str, global_shape: Sequence[int], boxes: Sequence[tuple[int, ShardBox]]
                 ) -> None:
    """Raise PlacementError unless the primary, non-empty boxes tile the tensor exactly.

    Args:
        name: the canonical tensor's name (for the message).
        global_shape: its shape.
        boxes: (rank, box) of every rank's shard of it; replicas (primary=False) are ignored.

    Raises:
        PlacementError: naming the tensor, the ranks and the region that overlaps or is missing.
    """
    shape = tuple(global_shape)
    live = [(r, b) for r, b in boxes if b.primary and b.numel > 0]
    for r, b in live:
        if b.global_shape != shape:
            raise PlacementError(f"tensor {name!r}: rank {r} places a shard of a {list(b.global_shape)} "
                                 f"tensor, the tensor is {list(shape)}; every rank must agree")
    for (ra, a), (rb, b) in itertools.combinations(live, 2):
        common = _intersect(a, b)
        if common is not None:
            raise PlacementError(
                f"tensor {name!r}: the shards of rank {ra} {a.describe()} and rank {rb} "
                f"{b.describe()} overlap in {_slices(common)}; each element must be published by "
                "exactly one rank (mark replicas primary=False)")
    covered = sum(b.numel for _r, b in live)
    numel = math.prod(shape)
    if covered != numel:  # no overlaps, so a shortfall is a gap
        raise PlacementError(f"tensor {name!r}: the shards cover {covered} of {numel} elements; "
                             f"{_first_gap(shape, [b for _r, b in live])} is held by no rank")


def _intersect(a: ShardBox, b: ShardBox) -> list[tuple[int, int]] | None:
    out = []
    for ao, asz, bo, bsz in zip(a.offset, a.shape, b.offset, b.shape, strict=True):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return out


def _slices(ranges: Sequence[tuple[int, int]]) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in ranges) + "]"


def _first_gap(shape: tuple[int, ...], boxes: list[ShardBox]) -> str:
    """A region no box covers, found on the grid of the boxes' edges (coordinate compression)."""
    edges = [sorted({0, n, *(b.offset[j] for b in boxes), *(b.offset[j] + b.shape[j] for b in boxes)})
             for j, n in enumerate(shape)]
    cells = math.prod(len(e) - 1 for e in edges)
    if cells > _MAX_GRID_CELLS:
        return "some region"
    for idx in itertools.product(*(range(len(e) - 1) for e in edges)):
        cell = [(edges[j][i], edges[j][i + 1]) for j, i in enumerate(idx)]
        if not any(all(b.offset[j] <= lo and hi <= b.offset[j] + b.shape[j]
                       for j, (lo, hi) in enumerate(cell)) for b in boxes):
            return _slices(cell)
    return "some region"  # unreachable when the volumes differ; kept total for safety
