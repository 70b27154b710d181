"""ShardBox: the block of a canonical tensor that one rank holds, as a fixed affine map.

A rank's local shard of a canonical tensor of shape G is the box `offset + [0, shape)`: local
element (a_0 … a_k) is canonical element (offset_0 + a_0, …, offset_k + a_k), whose flat
(row-major) index is `first + Σ a_j · strides_j` with `strides` the canonical row-major strides.
Sharding on any dim but the first makes the box strided in canonical flat order; it is still a
sequence of equal contiguous *runs*: the innermost dims the box does not cut, times the extent of
the innermost dim it does cut. Local flat position p lies in run p // run_len at p % run_len, so
mapping local changes to canonical positions costs one gather from the (small) run-start table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..errors import PlacementError


@dataclass(frozen=True)
class ShardBox:
    """Where a local shard sits in its canonical tensor.

    Args:
        global_shape: the canonical tensor's shape.
        offset: canonical coordinates of the shard's first element.
        shape: the local shard's shape (same rank as global_shape; a dim may be 0).
        primary: False for a replica whose copy another rank publishes (Replicate placements):
            it contributes no chunks and no digest, and does not count in the tiling check.

    Raises:
        PlacementError: if the box does not fit inside the tensor.
    """

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    primary: bool = True

    def __post_init__(self) -> None:
        g, o, s = self.global_shape, self.offset, self.shape
        if not len(g) == len(o) == len(s):
            raise PlacementError(f"shard box offset {list(o)} / shape {list(s)} does not have the "
                                 f"rank of the tensor's shape {list(g)}")
        if any(x < 0 for x in (*g, *o, *s)) or any(oj + sj > gj for oj, sj, gj in zip(o, s, g,
                                                                                    strict=True)):
            raise PlacementError(f"shard box offset {list(o)} shape {list(s)} does not fit in a "
                                 f"tensor of shape {list(g)}")

    @cached_property  # the box is frozen; read ~10 times per piece and publish
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def strides(self) -> tuple[int, ...]:
        """Canonical row-major strides of the tensor, in elements."""
        out = [1] * len(self.global_shape)
        for j in range(len(out) - 2, -1, -1):
            out[j] = out[j + 1] * self.global_shape[j + 1]
        return tuple(out)

    @property
    def first(self) -> int:
        """Canonical flat index of local element (0, …, 0)."""
        return sum(o * st for o, st in zip(self.offset, self.strides, strict=True))

    @property
    def span(self) -> tuple[int, int]:
        """The flat bounding range [first, last + 1) of the box in canonical order."""
        last = sum((o + n - 1) * st for o, n, st in zip(self.offset, self.shape, self.strides,
                                                         strict=True))
        return self.first, last + 1

    @cached_property
    def cut(self) -> int:
        """The innermost dim the box does not span whole (-1: the box is the whole tensor)."""
        for j in range(len(self.shape) - 1, -1, -1):
            if self.shape[j] != self.global_shape[j]:
                return j
        return -1

    @cached_property
    def run_len(self) -> int:
        """Elements per contiguous canonical run (the whole box when nothing is cut)."""
        return math.prod(self.shape[max(self.cut, 0):]) if self.cut >= 0 else self.numel

    @cached_property
    def run_starts(self) -> np.ndarray:
        """Canonical flat index of each run's first element, in local order (int64)."""
        if self.numel == 0:
            return np.empty(0, np.int64)
        starts = np.full((), self.first, np.int64)
        for j in range(max(self.cut, 0)):  # the dims outside the run, outer to inner
            starts = starts[..., None] + np.arange(self.shape[j], dtype=np.int64) * self.strides[j]
        return starts.reshape(-1)

    def canonical(self, local: np.ndarray) -> np.ndarray:
        """Canonical flat indexes of local flat positions (int64 array in, int64 array out)."""
        local = np.asarray(local, np.int64)
        return self.run_starts[local // self.run_len] + local % self.run_len

    @property
    def slices(self) -> tuple[slice, ...]:
        """The box as an index into the canonical tensor (an n-D view, no copy)."""
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape, strict=True))

    def contains(self, canonical: np.ndarray) -> np.ndarray:
        """Which canonical flat indexes (int64 array) lie inside the box (bool array)."""
        flat = np.asarray(canonical, np.int64)
        inside = (flat >= 0) & (flat < math.prod(self.global_shape))
        for o, s, st, g in zip(self.offset, self.shape, self.strides, self.global_shape, strict=True):
            c = (flat // st) % g
            inside &= (c >= o) & (c < o + s)
        return inside

    def run_holding(self, start: int, stop: int) -> bool:
        """Does canonical [start, stop) lie inside one contiguous run of the box?"""
        if not 0 <= start < stop or self.numel == 0:
            return False
        if not self.contains(np.asarray([start]))[0]:
            return False
        r = int(np.searchsorted(self.run_starts, start, side="right")) - 1
        return r >= 0 and stop <= int(self.run_starts[r]) + self.run_len

    def describe(self) -> str:
        """`[0:3, 4:8]`-style slice notation of the box."""
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offset, self.shape,
                                                               strict=True)) + "]"
