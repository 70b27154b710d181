"""Gap-coded segments of a chunk prepared in one kernel call while staging, and their small
ones scattered in one call in the pause (`prepared.py` does both one segment at a time).

A model of thousands of small tensors paid ~10 µs of Python and a kernel call per segment to
stage its words (`prepare_segment`); `prepare_gap_segments` stages every gap-coded segment of a
chunk (of one dtype) in one call, with the same checks, arrays, digest lanes and seals. A
segment it refuses is returned as the error `prepare_segment` raises, for the caller to raise
when it reaches that segment: a chunk's refusals keep their order.

The segments it stages are rows of one `PreparedGroup`. In the pause, `apply_prepared_rows`
scatters many rows in one call, with the checks `apply_prepared` makes per segment: every word
overwritten must be the one staged (BaseMismatch), the words written must give the staged seals
(IntegrityError), and what was written is one undo entry (`RowsUndo`), restored exactly on a
rollback. That pause paid ~5 µs of Python per segment (the seam, the undo entry, the digest
lanes), 8000 tensors ~45 ms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import BaseMismatch, FormatError, IntegrityError, UsageError
from ..kernel_cache import njit
from ..tensors import DType
from . import kernels as K
from .coding import Op, Positions, Values, check_coding
from .encode import width_masks
from .prepared import PreparedSegment, check_gap_count, prepare_gap_segment, scatter_sealed
from .segment import Segment, UndoLog, check_sparse, check_status
from .small_kernels import words_at


@dataclass(frozen=True, slots=True, eq=False)
class PreparedGroup:
    """The arrays a chunk's gap-coded segments of one dtype were staged into: row j is
    pos/old/new[offsets[j]:offsets[j + 1]] (each a `PreparedSegment`'s arrays), its digest
    lanes (old half, new half), seal, first canonical element and range size."""

    pos: np.ndarray
    old: np.ndarray
    new: np.ndarray
    offsets: np.ndarray  # int64[m + 1]
    lanes: np.ndarray  # uint64[m, 4]
    seals: np.ndarray  # uint64[m]
    firsts: np.ndarray  # int64[m]
    numels: np.ndarray  # int64[m]


def gap_coded(seg: Segment) -> bool:
    """Is `seg` one that prepare_segment decodes from a gap stream?"""
    return seg.positions == Positions.GAPS and seg.op != Op.DENSE


def prepare_gap_segments(segs: list[Segment], bases: list[np.ndarray], dtype: DType,
                         where: str, *, addresses: np.ndarray | None = None
                         ) -> list[PreparedSegment | FormatError | UsageError]:
    """prepare_segment(segs[i], bases[i], dtype, where) for each gap-coded segment, or the
    error it raises; `bases[i]`: the held words of exactly segs[i]'s range, kept alive by the
    caller until this returns. `addresses` (int64 [len(segs), 3]), where the caller knows them
    cheaper than reading them: row i the addresses of segs[i]'s position and value streams and
    of bases[i]."""
    out: dict[int, PreparedSegment | FormatError | UsageError] = {}
    # what prepare_segment checks, on all of them at once; the per-segment checks run only
    # where these fail, to raise what prepare_segment raises
    info = np.array([(seg.count, seg.stop - seg.start, seg.pos_bytes.size, seg.val_bytes.size,
                      int(seg.values), int(seg.op), seg.start, base.size)
                     for seg, base in zip(segs, bases, strict=True)], np.int64).reshape(-1, 8)
    count, numel, plen, vlen, values, op, start, size = info.T
    uint = np.dtype(dtype.uint)
    laid_out = np.fromiter((base.dtype == uint and base.flags.c_contiguous
                            and seg.pos_bytes.flags.c_contiguous and seg.val_bytes.flags.c_contiguous
                            for seg, base in zip(segs, bases, strict=True)), np.bool_, len(segs))
    legal = np.zeros(len(segs), np.bool_)
    for o, v in {(int(o), int(v)) for o, v in zip(op, values, strict=True)}:
        legal[(op == o) & (values == v)] = _legal(o, v, dtype.is_float)
    fine = laid_out & legal & (size == numel) & (count >= 0) & (count <= numel) & (count <= plen)
    for i in np.flatnonzero(~fine).tolist():
        seg, base = segs[i], bases[i]
        try:
            check_sparse(seg, dtype, base, where)
            check_gap_count(seg, where)
            raise UsageError(f"{where}: non-contiguous words or streams")
        except (FormatError, UsageError) as exc:
            out[i] = exc
    ok = np.flatnonzero(fine)
    m = ok.size
    counts = count[ok]
    offsets = np.zeros(m + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    total = int(offsets[-1])
    at = (addresses[ok] if addresses is not None else
          np.array([(segs[i].pos_bytes.ctypes.data, segs[i].val_bytes.ctypes.data,
                     bases[i].ctypes.data) for i in ok.tolist()], np.int64).reshape(m, 3))
    streams = np.stack([at[:, 0], plen[ok], at[:, 1], vlen[ok], values[ok], numel[ok], op[ok],
                        start[ok], at[:, 2]], axis=1)  # the rows stage_gap_segments reads
    pos, z = np.empty(total, np.int64), np.empty(total, np.uint64)
    old, new = np.empty(total, dtype.uint), np.empty(total, dtype.uint)
    lanes = np.zeros((m, 4), np.uint64)
    seals = np.empty(m, np.uint64)
    statuses = np.empty(m, np.int64)
    mask, _ = width_masks(dtype)
    if m:
        stage_gap_segments(streams, counts, offsets, np.empty(0, np.uint8), np.empty(0, dtype.uint),
                           dtype.width, mask, pos, z, old, new, lanes, seals, statuses)
    group = PreparedGroup(pos, old, new, offsets, lanes, seals, streams[:, 7].copy(),
                          streams[:, 5].copy())
    for j, i in enumerate(ok.tolist()):
        seg = segs[i]
        try:
            check_status(int(statuses[j]), where)
        except FormatError as exc:
            out[i] = exc
            continue
        a, b = int(offsets[j]), int(offsets[j + 1])
        out[i] = PreparedSegment(pos[a:b], old[a:b], new[a:b], lanes[j, :2], lanes[j, 2:],
                                 int(seals[j]), seg.start, seg.numel, group, j)
    return [out[i] for i in range(len(segs))]


def _legal(op: int, values: int, is_float: bool) -> bool:
    """Would check_coding pass a gap-coded segment of this op and value coding?"""
    try:
        check_coding(Op(op), Positions.GAPS, Values(values), "", is_float=is_float)
    except (FormatError, ValueError):
        return False
    return True


@njit(cache=True, nogil=True, boundscheck=False)
def stage_gap_segments(streams, counts, offsets, u8, proto, width, mask, pos, z, old, new, lanes,
                       seals, statuses):
    """prepare_gap_segment for each row of `streams` (position stream address and length, value
    stream address and length, value coding, numel, op, first element, held words' address),
    into pos/z/old/new[offsets[j]:offsets[j + 1]], lanes[j], seals[j] and statuses[j]."""
    for j in range(streams.shape[0]):
        a, b = offsets[j], offsets[j + 1]
        numel = streams[j, 5]
        statuses[j], seals[j] = prepare_gap_segment(
            words_at(streams[j, 0], streams[j, 1], u8), streams[j, 4],
            words_at(streams[j, 2], streams[j, 3], u8), counts[j], numel, width,
            words_at(streams[j, 8], numel, proto), streams[j, 6], mask, streams[j, 7],
            pos[a:b], z[a:b], old[a:b], new[a:b], lanes[j])


@dataclass(frozen=True, slots=True, eq=False)
class RowsUndo:
    """What `apply_prepared_rows` wrote: rows[:done] in full and `partial` words of rows[done]
    (an `Undoable`). `keep` holds the arrays the addresses point into."""

    group: PreparedGroup
    rows: np.ndarray
    dsts: np.ndarray
    done: int
    partial: int
    keep: Sequence[object]

    def restore(self) -> None:
        restore_rows(self.dsts, self.rows, self.group.offsets, self.group.numels,
                     self.group.pos, self.group.old, self.done, self.partial)

    @property
    def nbytes(self) -> int:
        ends = self.group.offsets[self.rows[:self.done] + 1]
        words = int((ends - self.group.offsets[self.rows[:self.done]]).sum()) + self.partial
        return words * (self.group.pos.itemsize + self.group.old.itemsize)


def apply_prepared_rows(group: PreparedGroup, rows: np.ndarray, dsts: np.ndarray,
                        keep: Sequence[object], undo: UndoLog, where: str) -> None:
    """`apply_prepared` of group rows `rows` (increasing) into the words at `dsts` (int64
    addresses, one a row: the held words of exactly its segment's range, C-contiguous, of the
    group's word type, alive in `keep`), in one kernel call; what it wrote is one undo entry.

    Raises:
        BaseMismatch: a word is not the one staged (the target changed since staging); the
            words written before it are in `undo`.
        IntegrityError: the words written are not the staged ones (a row's seal differs);
            every word written is in `undo`.
    """
    seals = np.empty(rows.size, np.uint64)
    done, partial = scatter_rows(dsts, rows, group.offsets, group.numels, group.firsts,
                                 group.pos, group.old, group.new, seals)
    undo.entries.append(RowsUndo(group, rows, dsts, int(done), int(partial), keep))
    if done != rows.size:
        row = int(rows[done])
        raise BaseMismatch(f"{where}: element {int(group.pos[group.offsets[row] + partial])} of "
                           f"the segment at element {int(group.firsts[row])} no longer holds the "
                           "word it held when the version was staged: the target was changed "
                           "outside this receiver; nothing kept, stage it again")
    bad = np.flatnonzero(seals != group.seals[rows])
    if bad.size:
        raise IntegrityError(f"{where}: the words the apply wrote at element "
                             f"{int(group.firsts[rows[bad[0]]])} are not the ones staged (their "
                             "seal differs: the staged arrays changed in memory since staging); "
                             "rolled back, stage it again")


def row_changes(group: PreparedGroup, rows: np.ndarray) -> list[bytes]:
    """The digest change Σ mix(new) − Σ mix(old) of each row (the staged lanes; wraps)."""
    lanes = group.lanes[rows]
    out = (lanes[:, 2:] - lanes[:, :2]).astype("<u8").tobytes()
    return [out[16 * k: 16 * (k + 1)] for k in range(rows.size)]


@njit(cache=True, nogil=True, boundscheck=False)
def scatter_rows(dsts, rows, offsets, numels, firsts, pos, old, new, seals):
    """`scatter_sealed` of each row rows[i] into the words at dsts[i]; its seal into seals[i].
    Returns (rows done, words of the row after them written): it stops at the first word that
    is not the staged one."""
    for i in range(rows.shape[0]):
        j = rows[i]
        a, b = offsets[j], offsets[j + 1]
        done, seals[i] = scatter_sealed(words_at(dsts[i], numels[j], old), pos[a:b], old[a:b],
                                        new[a:b], firsts[j])
        if done != b - a:
            return i, done
    return rows.shape[0], 0


@njit(cache=True, nogil=True, boundscheck=False)
def restore_rows(dsts, rows, offsets, numels, pos, old, done, partial):
    """Write back the old words of what `scatter_rows` wrote, last first (idempotent)."""
    last = done if done < rows.shape[0] else done - 1  # rows[done]: its first `partial` words
    for i in range(last, -1, -1):
        j = rows[i]
        a, b = offsets[j], offsets[j + 1]
        K.restore(words_at(dsts[i], numels[j], old), pos[a:b], old[a:b],
                  partial if i == done else b - a)
