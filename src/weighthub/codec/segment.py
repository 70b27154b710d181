"""Segments: one op over one flat element range of one tensor, and the undo log of applying them.

A segment is what a chunk frame carries per tensor range:
  op         xor | add | overwrite | dense
  positions  how the changed positions are coded: all (dense), gaps, groups, bitmap
  values     how the values are coded: raw words, varint (XOR), zigzag varint (difference)
plus the two byte streams (format/spec.md §2). `encode` chooses them, `apply` applies them in
place and records an `UndoLog` so a transaction can roll back exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..errors import FormatError, UsageError
from ..tensors import DType, readonly
from . import kernels as K
from .coding import Op, Positions, Values, check_coding, invertible


@dataclass(frozen=True, slots=True)
class Segment:
    """One op over elements [start, stop) of tensor `tensor` (index in the manifest's table)."""

    tensor: int
    start: int
    stop: int
    op: Op
    positions: Positions
    values: Values
    count: int  # number of elements the op touches
    pos_bytes: np.ndarray  # uint8
    val_bytes: np.ndarray  # uint8

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def invertible(self) -> bool:
        """Can `apply_segment(..., inverse=True)` undo this segment (see `invertible`)?"""
        return invertible(self.op, self.positions)


@dataclass(slots=True)
class UndoEntry:
    """What one apply changed in `dst`: the first `done` (position, old word) pairs, or a copy."""

    dst: np.ndarray
    positions: np.ndarray | None  # None: `old` is a copy of the whole of dst
    old: np.ndarray
    done: int

    def restore(self) -> None:
        if self.positions is None:
            np.copyto(self.dst, self.old)
        else:
            K.restore(self.dst, self.positions, self.old, int(self.done))

    @property
    def nbytes(self) -> int:
        return self.old.nbytes + (0 if self.positions is None else self.positions.nbytes)


class Undoable(Protocol):
    """An undo record: host words (`UndoEntry`) or device words (receive/device.py)."""

    def restore(self) -> None: ...

    @property
    def nbytes(self) -> int: ...


@dataclass(slots=True)
class UndoLog:
    """Old words of everything a transaction changed, to restore them exactly (idempotent).

    fresh: the destination holds nothing worth restoring (a target being materialized, which
    is discarded on failure), so dense segments skip the copy of the old bits.
    """

    entries: list[Undoable] = field(default_factory=list)
    fresh: bool = False

    def rollback(self) -> None:
        for e in reversed(self.entries):
            e.restore()
        self.entries.clear()

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


_STATUS = {
    K.STREAM_OVERRUN: "a stream ends before all its entries",
    K.POSITION_OUT_OF_RANGE: "a position is out of range or not increasing",
    K.TRAILING_BYTES: "a stream has bytes left after its last entry",
    K.BAD_VARINT: "a varint is longer than 10 bytes",
    K.BAD_CODE: "a context-coded stream decodes to a value the format forbids (a group table "
                "out of range, a bit length over 64, a gap past the range, a symbol out of "
                "range, or a final coder state that is not the initial one)",
}


def check_status(status: int, where: str) -> None:
    """Raise FormatError naming `where` for a kernel's negative status."""
    if status < 0:
        raise FormatError(f"{where}: corrupt segment: {_STATUS.get(status, status)}")


def check_sparse(seg: Segment, dtype: DType, words: np.ndarray, where: str) -> None:
    """`words` must be the segment's range in the dtype's words, and its coding and count legal."""
    if words.size != seg.numel or words.dtype != dtype.uint:
        raise UsageError(f"{where}: {words.dtype}[{words.size}] words for a segment of "
                         f"{seg.numel} {dtype.name} elements")
    check_coding(seg.op, seg.positions, seg.values, where, is_float=dtype.is_float)
    if not 0 <= seg.count <= seg.numel:
        raise FormatError(f"{where}: {seg.count} changes in a range of {seg.numel} elements")


def bitmap_positions(seg: Segment, where: str) -> np.ndarray:
    """The int64 positions of a bitmap-coded segment (spec §2), checked against its header.

    Raises FormatError for a bitmap of the wrong size, set padding bits or a popcount other
    than the segment's count.
    """
    n = seg.numel
    if seg.pos_bytes.size != (n + 7) // 8:
        raise FormatError(f"{where}: bitmap of {seg.pos_bytes.size} bytes for {n} elements")
    if n % 8 and int(seg.pos_bytes[-1]) >> (n % 8):
        raise FormatError(f"{where}: bitmap padding bits past element {n} are set")
    pos = np.empty(seg.count, np.int64)
    found = K.bitmap_positions(readonly(seg.pos_bytes), pos)
    if found != seg.count:
        if found > seg.count:  # the kernel stopped there: count them all for the message
            found = int(np.unpackbits(seg.pos_bytes, count=n, bitorder="little").sum())
        raise FormatError(f"{where}: bitmap has {found} positions, header says {seg.count}")
    return pos


def gap_positions(gaps: np.ndarray, count: int, numel: int) -> np.ndarray | None:
    """The positions of a gap-coded stream (varint gap − 1, the first from −1; spec §2), or
    None if it does not decode to `count` positions below `numel` (the apply kernels refuse
    it). Vectorized, O(stream): for checks made before any kernel runs (a shard box, a
    journal)."""
    if count == 0:
        return np.zeros(0, np.int64) if gaps.size == 0 else None
    ends = np.flatnonzero(gaps < 0x80)
    if ends.size != count or ends[-1] != gaps.size - 1:
        return None
    starts = np.empty(count, np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    if int((ends - starts).max()) >= 9:
        return None  # a varint over 9 bytes: more than 63 bits, which no position needs
    if gaps.size == count:  # one byte each: the common case at RL change rates
        g = gaps.astype(np.int64)
    else:
        shift = (np.arange(gaps.size) - np.repeat(starts, ends - starts + 1)) * 7
        g = np.bitwise_or.reduceat((gaps & 0x7F).astype(np.int64) << shift, starts)
    pos = np.cumsum(g + 1) - 1
    if int(pos[-1]) >= numel or int(g.min()) < 0:
        return None
    return pos
