"""Gap-coded segments of a chunk prepared in one kernel call (staging, `prepared.py`).

A model of thousands of small tensors paid ~10 µs of Python and a kernel call per segment to
stage its words (`prepare_segment`); `prepare_gap_segments` stages every gap-coded segment of a
chunk (of one dtype) in one call, with the same checks, arrays, digest lanes and seals. A
segment it refuses is returned as the error `prepare_segment` raises, for the caller to raise
when it reaches that segment: a chunk's refusals keep their order.
"""

from __future__ import annotations

import numpy as np

from ..errors import FormatError, UsageError
from ..kernel_cache import njit
from ..tensors import DType
from .coding import Op, Positions
from .encode import width_masks
from .prepared import PreparedSegment, check_gap_count, prepare_gap_segment
from .segment import Segment, check_sparse, check_status
from .small_kernels import words_at


def gap_coded(seg: Segment) -> bool:
    """Is `seg` one that prepare_segment decodes from a gap stream?"""
    return seg.positions == Positions.GAPS and seg.op != Op.DENSE


def prepare_gap_segments(segs: list[Segment], bases: list[np.ndarray], dtype: DType,
                         where: str) -> list[PreparedSegment | FormatError | UsageError]:
    """prepare_segment(segs[i], bases[i], dtype, where) for each gap-coded segment, or the
    error it raises; `bases[i]`: the held words of exactly segs[i]'s range, kept alive by the
    caller until this returns."""
    out: dict[int, PreparedSegment | FormatError | UsageError] = {}
    ok: list[int] = []
    for i, (seg, base) in enumerate(zip(segs, bases, strict=True)):
        try:
            check_sparse(seg, dtype, base, where)
            check_gap_count(seg, where)
            if not (base.flags.c_contiguous and seg.pos_bytes.flags.c_contiguous
                    and seg.val_bytes.flags.c_contiguous):
                raise UsageError(f"{where}: non-contiguous words or streams")
        except (FormatError, UsageError) as exc:
            out[i] = exc
            continue
        ok.append(i)
    m = len(ok)
    counts = np.fromiter((segs[i].count for i in ok), np.int64, m)
    offsets = np.zeros(m + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    total = int(offsets[-1])
    streams = np.array([(segs[i].pos_bytes.ctypes.data, segs[i].pos_bytes.size,
                         segs[i].val_bytes.ctypes.data, segs[i].val_bytes.size,
                         int(segs[i].values), segs[i].numel, int(segs[i].op), segs[i].start,
                         bases[i].ctypes.data) for i in ok], np.int64).reshape(m, 9)
    pos, z = np.empty(total, np.int64), np.empty(total, np.uint64)
    old, new = np.empty(total, dtype.uint), np.empty(total, dtype.uint)
    lanes = np.zeros((m, 4), np.uint64)
    seals = np.empty(m, np.uint64)
    statuses = np.empty(m, np.int64)
    mask, _ = width_masks(dtype)
    if m:
        stage_gap_segments(streams, counts, offsets, np.empty(0, np.uint8), np.empty(0, dtype.uint),
                           dtype.width, mask, pos, z, old, new, lanes, seals, statuses)
    for j, i in enumerate(ok):
        seg = segs[i]
        try:
            check_status(int(statuses[j]), where)
        except FormatError as exc:
            out[i] = exc
            continue
        a, b = int(offsets[j]), int(offsets[j + 1])
        out[i] = PreparedSegment(pos[a:b], old[a:b], new[a:b], lanes[j, :2], lanes[j, 2:],
                                 int(seals[j]), seg.start, seg.numel)
    return [out[i] for i in range(len(segs))]


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
