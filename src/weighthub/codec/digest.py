"""Digest changes of applied segments, split so that half the work happens before the pause.

A receiver verifies a delta in O(changed) (format/spec.md §4): a tensor's new digest is the held
digest plus Σ mix(i, new) − mix(i, old) over the elements the delta rewrote. The old half only
needs the held bits and the segment's positions, so it is computed while staging
(`staged_old_digest`, from the target's read-only view); the new half is folded in by the apply
kernel as it writes each word (kernels.py; `apply_segment(dnew=...)`).
"""

from __future__ import annotations

import numpy as np

from ..errors import FormatError
from ..tensors import DType, digest_affine
from . import digest_kernels as DK
from .segment import Op, Positions, Segment, check_status, regap_segment


def lanes_digest(lanes: np.ndarray) -> bytes:
    """The digest bytes (spec §4) of the two uint64 lane sums a kernel accumulated."""
    return lanes.astype("<u8").tobytes()


def staged_old_digest(seg: Segment, base: np.ndarray, dtype: DType, where: str) -> bytes:
    """Σ mix(i, base word) over the elements `seg` will rewrite; base = held bits of its range.

    Raises FormatError for a corrupt position stream (the apply would refuse it too).
    """
    if base.size != seg.numel or base.dtype != dtype.uint:
        raise ValueError(f"{where}: base {base.dtype}[{base.size}] for {seg.numel} elements")
    if seg.op == Op.DENSE:
        return digest_affine(base, seg.start, (1,), threads=1)
    if not 0 <= seg.count <= seg.numel:
        raise FormatError(f"{where}: {seg.count} changes in a range of {seg.numel} elements")
    seg = regap_segment(seg, base, dtype, where)  # grouped positions: decode against the base
    out = np.zeros(2, np.uint64)
    if seg.positions == Positions.GAPS:
        check_status(DK.sum_at_gaps(base, seg.pos_bytes, seg.count, seg.start, out), where)
    elif seg.positions == Positions.BITMAP:
        if seg.pos_bytes.size != (seg.numel + 7) // 8:
            raise FormatError(f"{where}: bitmap of {seg.pos_bytes.size} bytes for {seg.numel} "
                              "elements")
        pos = np.flatnonzero(np.unpackbits(seg.pos_bytes, count=seg.numel, bitorder="little"))
        if pos.size != seg.count:
            raise FormatError(f"{where}: bitmap has {pos.size} positions, header says {seg.count}")
        DK.sum_at(base, pos, pos.size, seg.start, out)
    else:
        raise FormatError(f"{where}: positions {seg.positions.name} with op {seg.op.name}")
    return lanes_digest(out)
