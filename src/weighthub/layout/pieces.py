"""Deterministic chunk pieces of a rank's shards, and the canonical runs each piece covers.

A piece is a local flat range [lo, hi) of one shard (any number of runs, or part of one).
Pieces are bucketed into chunks of about `span_bytes` of dense data, like `chunking.tile` does
for whole tensors. In canonical space a piece is a list of contiguous runs, each a flat range
[start, stop) that no other rank writes.

Tensors some rank holds strided (column / row-parallel shards) are *boxed*: their pieces are
cut at box boundaries (whole trailing dims, one block of the dim that is split, the outer dims
fixed), so a piece is itself a box: a chunk covers it with one box and one sparse segment over
its flat bounding range, instead of one cover and one segment per run (spec §3).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from ..chunking import MIN_SPAN
from ..errors import UsageError
from .box import ShardBox


@dataclass(frozen=True, slots=True)
class Run:
    """A contiguous stretch of a piece: local [lo, hi) is canonical [start, start + hi - lo)."""

    lo: int
    hi: int
    start: int

    @property
    def stop(self) -> int:
        return self.start + self.hi - self.lo


@dataclass(frozen=True, slots=True)
class Piece:
    """Local flat elements [lo, hi) of the shard of canonical tensor `tensor`."""

    tensor: int
    box: ShardBox
    lo: int
    hi: int

    def runs(self) -> list[Run]:
        n = self.box.run_len
        out = []
        for r in range(self.lo // n, -(-self.hi // n)):
            lo, hi = max(self.lo, r * n), min(self.hi, (r + 1) * n)
            out.append(Run(lo, hi, int(self.box.run_starts[r]) + lo - r * n))
        return out

    def covers(self) -> list[tuple[int, int, int]]:
        """(tensor, start, stop) canonical ranges of the piece, adjacent runs merged."""
        out: list[tuple[int, int, int]] = []
        for run in self.runs():
            if out and out[-1][2] == run.start:
                out[-1] = (self.tensor, out[-1][1], run.stop)
            else:
                out.append((self.tensor, run.start, run.stop))
        return out


    def region(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(canonical offset, shape) of a piece that is a box (see plan_pieces' `boxed`).

        Raises:
            ValueError: the piece is not a box of its shard.
        """
        shape = self.box.shape
        first = np.unravel_index(self.lo, shape)
        last = np.unravel_index(self.hi - 1, shape)
        extent = tuple(int(b) - int(a) + 1 for a, b in zip(first, last, strict=True))
        if math.prod(extent) != self.hi - self.lo:  # a box from first to last holds exactly these
            raise ValueError(f"piece [{self.lo}, {self.hi}) of a {list(shape)} shard is not a box")
        return tuple(o + int(a) for o, a in zip(self.box.offset, first, strict=True)), extent

    def sub_box(self) -> ShardBox:
        """The piece as a box of the canonical tensor (its own runs and flat span)."""
        offset, shape = self.region()
        return ShardBox(self.box.global_shape, offset, shape)


def _box_end(shape: tuple[int, ...], lo: int, room: int) -> int:
    """An end hi ≤ lo + room (at least lo + 1) such that local [lo, hi) is a box.

    The box is a block of whole indices of the outermost dim j that lo is aligned to and room
    allows, inside one index of the dims before j (so hi never crosses into the next one).
    """
    inner = math.prod(shape)
    for n in shape:
        outer, inner = inner, inner // n if n else 0
        if inner and lo % inner == 0:
            limit = min((lo // outer + 1) * outer, lo + room)
            hi = lo + (limit - lo) // inner * inner
            if hi > lo:
                return hi
    return lo + 1  # a 0-d shard: its single element


def plan_pieces(shards: Sequence[tuple[int, int, ShardBox]], span_bytes: int, *,
                boxed: Collection[int] = ()) -> list[list[Piece]]:
    """Chunks of pieces for (tensor index, element width, box) shards, in the order given.

    Args:
        boxed: tensor indices whose pieces must be boxes. Such a piece is closed off at a box
            boundary; when the chunk's remaining room holds less than a fresh chunk would, the
            chunk is closed first (chunks stay within span, boxes stay large).

    Raises:
        UsageError: span below chunking.MIN_SPAN.
    """
    if span_bytes < MIN_SPAN:
        raise UsageError(f"chunk span {span_bytes} bytes is below the minimum {MIN_SPAN}")
    chunks: list[list[Piece]] = []
    current: list[Piece] = []
    filled = 0
    for ti, width, box in shards:
        lo = 0
        while lo < box.numel:
            room = max(1, (span_bytes - filled) // width)
            hi = min(box.numel, lo + room)
            if ti in boxed:
                hi = _box_end(box.shape, lo, room)
                if current and hi - lo < _box_end(box.shape, lo, max(1, span_bytes // width)) - lo:
                    chunks.append(current)
                    current, filled = [], 0
                    hi = _box_end(box.shape, lo, max(1, span_bytes // width))
            current.append(Piece(ti, box, lo, hi))
            filled += (hi - lo) * width
            lo = hi
            if filled >= span_bytes - width + 1:
                chunks.append(current)
                current, filled = [], 0
    if current:
        chunks.append(current)
    return chunks
