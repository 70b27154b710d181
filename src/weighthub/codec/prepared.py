"""Prepared segments: a delta's words computed while staging, so the pause is a checked scatter.

The first delta of a receiver's route applies to the bits the target holds now, and they do not
change before the pause (the receiver's lock, and `held` checked under it). So while staging a
gap-coded sparse segment (every grouped or context-coded one is re-coded to gaps there,
`regap_segment`) is decoded against those bits: its positions, the words there now, the words
it writes, and the old half of the digest change Σ mix(new) − Σ mix(old) (spec §4). The pause
then only writes the new words (`apply_prepared`), comparing each word it overwrites with the
one staged (any difference means the target was changed outside the receiver: the segment is
refused and rolled back like any failed apply) and folding the new half from the words as it
writes them, as the fused kernels do, so verification checks what was written. The undo log
is the staged positions and old words themselves: the pause allocates nothing per word.

Measured on SmolLM2-135M at 2.6% of bf16 words changed (3.5M), one core: the fused decode +
apply kernel (`apply_gap_stream`, with undo record and digest fold) ~30 ns per changed word in
the pause, this scatter with its fold ~14 (the whole step's pause ~60 -> ~40 ms, 2 threads).
The price is host memory from staging until the apply: 12 bytes per changed bf16 word (int64
position, old and new word; 8 more per word of a segment while it is being decoded), where the
undo log of the fused kernel takes 10 in the pause.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from ..digest.mix import fold
from ..errors import BaseMismatch, FormatError, UsageError
from ..tensors import DType, readonly
from .coding import Op, Positions
from .encode import width_masks
from .kernels import _combine, decode_gap_stream
from .segment import Segment, UndoEntry, UndoLog, check_sparse, check_status


@dataclass(frozen=True, slots=True)
class PreparedSegment:
    """A sparse segment decoded against the held words of its range (see module doc)."""

    pos: np.ndarray  # int64, strictly increasing, in [0, numel)
    old: np.ndarray  # the held words there (the dtype's uint)
    new: np.ndarray  # the words the segment writes there
    old_lanes: np.ndarray  # uint64[2]: Σ mix(first + p, old word), the digest's old half
    first: int  # the canonical index of the range's element 0 (the segment's start)
    numel: int


def prepare_segment(seg: Segment, base: np.ndarray, dtype: DType,
                    where: str) -> PreparedSegment | None:
    """`seg` decoded against `base` (the held words of exactly its range, read only); None for
    what is not prepared (dense segments, bitmap positions: they apply as before).

    Raises:
        UsageError: `base` is not the segment's range in the dtype's words.
        FormatError: as the apply kernels would in the pause; a count the gap stream cannot
            hold is refused before anything is allocated.
    """
    if seg.op == Op.DENSE or seg.positions != Positions.GAPS:
        return None
    check_sparse(seg, dtype, base, where)
    if seg.count > seg.pos_bytes.size:  # every gap takes at least one byte
        raise FormatError(f"{where}: {seg.count} changes in a {seg.pos_bytes.size}-byte gap stream")
    mask, _ = width_masks(dtype)
    pos = np.empty(seg.count, np.int64)
    z = np.empty(seg.count, np.uint64)  # the values as coded: transient, off the pause
    status = decode_gap_stream(readonly(seg.pos_bytes), int(seg.values), readonly(seg.val_bytes),
                               seg.count, seg.numel, dtype.width, pos, z)
    check_status(status, where)
    old = np.empty(seg.count, dtype.uint)
    new = np.empty(seg.count, dtype.uint)
    old_lanes = np.zeros(2, np.uint64)
    combine_prepared(readonly(base), pos, z, int(seg.op), mask, seg.start, old, new, old_lanes)
    return PreparedSegment(pos, old, new, old_lanes, seg.start, seg.numel)


def apply_prepared(prep: PreparedSegment, dst: np.ndarray, undo: UndoLog,
                   where: str) -> tuple[UndoEntry, np.ndarray]:
    """Write `prep`'s new words into `dst` (the segment's range), recording them in `undo`;
    the undo entry and the digest lanes of the words written (uint64[2], Σ mix(i, new)).

    Raises:
        UsageError: `dst` is not a range of the prepared size and word type.
        BaseMismatch: a word of `dst` is not the one staged (the target changed since
            staging); the words written before it are in `undo`, for the caller's rollback.
    """
    if dst.size != prep.numel or dst.dtype != prep.old.dtype:
        raise UsageError(f"{where}: destination {dst.dtype}[{dst.size}] for a segment prepared "
                         f"as {prep.old.dtype}[{prep.numel}]")
    written = np.zeros(2, np.uint64)
    done = int(scatter_prepared(dst, prep.pos, prep.old, prep.new, prep.first, written))
    entry = UndoEntry(dst, prep.pos, prep.old, done)
    undo.entries.append(entry)
    if done != prep.pos.size:
        raise BaseMismatch(f"{where}: element {int(prep.pos[done])} of the segment no longer "
                           "holds the word it held when the version was staged: the target was "
                           "changed outside this receiver; nothing kept, stage it again")
    return entry, written


@njit(cache=True, nogil=True, boundscheck=False)
def combine_prepared(base, pos, z, op, mask, first, out_old, out_new, old_lanes):
    """out_old/out_new = the words of `base` at `pos` (decoded and checked: in range,
    increasing) and what `op` makes of them with the decoded values `z`; adds
    Σ mix(first + p, old word) to old_lanes."""
    f1 = np.uint64(first) + np.uint64(1)
    o0 = o1 = np.uint64(0)
    for t in range(pos.shape[0]):
        p = pos[t]
        o = base[p]
        out_old[t] = o
        out_new[t] = _combine(np.uint64(o), z[t], op, mask)
        o0, o1 = fold(o0, o1, f1 + np.uint64(p), np.uint64(o))
    old_lanes[0] += o0
    old_lanes[1] += o1


@njit(cache=True, nogil=True, boundscheck=False)
def scatter_prepared(dst, pos, old, new, first, lanes):
    """dst[pos[t]] = new[t] in order while dst[pos[t]] == old[t], folding mix(first + p, new)
    into lanes (on success only); how many were written."""
    f1 = np.uint64(first) + np.uint64(1)
    n0 = n1 = np.uint64(0)
    for t in range(pos.shape[0]):
        p = pos[t]
        if dst[p] != old[t]:
            return t
        w = new[t]
        dst[p] = w
        n0, n1 = fold(n0, n1, f1 + np.uint64(p), np.uint64(w))
    lanes[0] += n0
    lanes[1] += n1
    return pos.shape[0]
