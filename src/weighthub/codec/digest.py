"""Digest changes of applied segments, split so that half the work happens before the pause.

A receiver verifies a delta in O(changed) (format/spec.md §4): a tensor's new digest is the held
digest plus Σ mix(i, new) − mix(i, old) over the elements the delta rewrote. The old half only
needs the held bits and the segment's positions, so it is computed while staging
(`staged_old_digest`, from the target's read-only view); the new half is folded in by the apply
kernel as it writes each word (kernels.py; `apply_segment(dnew=...)`). The digest math itself
is `weighthub.digest`.
"""

from __future__ import annotations

import numpy as np

from ..digest import lanes_digest
from ..digest.linear import digest_affine, digest_at
from ..errors import FormatError, UsageError
from ..tensors import DType, readonly
from . import kernels as K
from .apply import regap_segment
from .coding import Op, Positions, check_coding
from .segment import Segment, bitmap_positions, check_status


def staged_old_digest(seg: Segment, base: np.ndarray, dtype: DType, where: str) -> bytes:
    """Σ mix(i, base word) over the elements `seg` will rewrite; base = held bits of its range.

    Raises:
        UsageError: `base` is not the segment's range in the dtype's words.
        FormatError: a coding the format forbids, or a corrupt position stream (the apply
            would refuse it too).
    """
    if base.size != seg.numel or base.dtype != dtype.uint:
        raise UsageError(f"{where}: base {base.dtype}[{base.size}] for {seg.numel} elements")
    check_coding(seg.op, seg.positions, seg.values, where, is_float=dtype.is_float)
    if seg.op == Op.DENSE:
        return digest_affine(base, seg.start, (1,), threads=1)
    if not 0 <= seg.count <= seg.numel:
        raise FormatError(f"{where}: {seg.count} changes in a range of {seg.numel} elements")
    seg = regap_segment(seg, base, dtype, where)  # grouped positions: decode against the base
    if seg.positions == Positions.GAPS:
        out = np.zeros(2, np.uint64)
        check_status(K.sum_at_gaps(readonly(base), readonly(seg.pos_bytes), seg.count, seg.start, out),
                     where)
        return lanes_digest(out)
    return digest_at(base, bitmap_positions(seg, where), seg.start)
