"""Small ranges coded in bulk: one kernel call for every small range of a chunk.

A model of thousands of small tensors (MoE experts, norms) paid ~30 µs of Python and ~10 kernel
calls per range in `encode.encode_range`; `encode_small` codes a whole chunk's ranges of at most
SMALL_RANGE elements in one call (`small_kernels.code_small_ranges`), with the same segments,
bytes and digest changes: order-0 codings and the `ans` context coding (`codes_in_bulk`). A
range whose changes reach the grouped coding's minimum goes through `encode_range` as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..digest.sums import lanes_digest
from ..errors import UsageError
from ..tensors import DType
from .coding import CONTEXT_CODERS, EncodePolicy, Op, Positions, Values
from .encode import SMALL_RANGE, codes_in_context, encode_segment_tracked, width_masks
from .segment import Segment
from .small_kernels import DENSE, FALLBACK, INVERTIBLE_SLACK, NOTHING, code_small_ranges

_OPS = {int(o): o for o in Op}
_POSITIONS = {int(p): p for p in Positions}
_VALUES = {int(v): v for v in Values}
_ZERO_CHANGE = bytes(16)


@dataclass(frozen=True, slots=True)
class SmallRange:
    """Elements [start, start + new.size) of tensor `tensor`: its old and new words (1-D,
    C-contiguous, one dtype)."""

    tensor: int
    start: int
    old: np.ndarray
    new: np.ndarray


def codes_in_bulk(policy: EncodePolicy, dtype: DType) -> bool:
    """Does encode_small code small ranges of `dtype` under `policy` (as encode_range would)?
    All but those context-coded by another coder than `ans`."""
    return (not codes_in_context(policy, dtype, SMALL_RANGE)
            or CONTEXT_CODERS[policy.coder] == Positions.ANS)


def bulk_ready(old: np.ndarray, new: np.ndarray) -> bool:
    """Can a range with these words be coded in bulk (small, 1-D, contiguous, alike)?"""
    return (new.ndim == 1 and 0 < new.size <= SMALL_RANGE and old.shape == new.shape
            and old.dtype == new.dtype and old.flags.c_contiguous and new.flags.c_contiguous)


def encode_small(ranges: list[SmallRange], dtype: DType, policy: EncodePolicy
                 ) -> list[tuple[Segment | None, bytes]]:
    """Each range's segment (None: nothing changed) and digest change, as encode_segment_tracked
    gives them, for ranges that `bulk_ready` accepts of a dtype that `codes_in_bulk` codes."""
    if not codes_in_bulk(policy, dtype):
        raise UsageError(f"encode_small: small {dtype.name} ranges are context-coded by "
                         f"{policy.coder!r}, which only encode_range codes")
    m = len(ranges)
    if m == 0:
        return []
    words = np.dtype(dtype.uint)
    if any(r.new.dtype.itemsize != words.itemsize for r in ranges):
        raise UsageError(f"encode_small: words of another width than {dtype.name}'s")
    olds = np.fromiter((r.old.ctypes.data for r in ranges), np.int64, m)
    news = np.fromiter((r.new.ctypes.data for r in ranges), np.int64, m)
    sizes = np.fromiter((r.new.size for r in ranges), np.int64, m)
    starts = np.fromiter((r.start for r in ranges), np.int64, m)
    kinds = np.empty(m, np.int8)
    codings = np.empty((m, 3), np.int64)
    counts = np.empty(m, np.int64)
    lengths = np.empty((m, 2), np.int64)
    lanes = np.zeros((m, 2), np.uint64)
    out = np.empty(int(sizes.sum()) * words.itemsize + INVERTIBLE_SLACK, np.uint8)
    mask, sign_shift = width_masks(dtype)
    group_min = policy.min_group_count if policy.groups and dtype.is_float else -1
    context = codes_in_context(policy, dtype, SMALL_RANGE)
    code_small_ranges(olds, news, sizes, starts, np.empty(0, words), mask, sign_shift,
                      policy.mask_ops, policy.value_sample, group_min, context,
                      dtype.exponent_shift, np.uint64(dtype.exponent_mask), kinds, codings,
                      counts, lengths, lanes, out)
    changes = lanes_digest(lanes.reshape(-1))
    results: list[tuple[Segment | None, bytes]] = []
    at = 0
    # Python ints from here: numpy scalars cost ~10x as much per use
    codes, lens, counted = codings.tolist(), lengths.tolist(), counts.tolist()
    for i, (r, kind) in enumerate(zip(ranges, kinds.tolist(), strict=True)):
        change = changes[16 * i:16 * i + 16]
        if kind == NOTHING:
            results.append((None, _ZERO_CHANGE))
        elif kind == FALLBACK:  # the grouped coding is a candidate: encode_range decides
            seg, _ = encode_segment_tracked(r.old, r.new, dtype, tensor=r.tensor, start=r.start,
                                            policy=policy)
            results.append((seg, change))
        elif kind == DENSE:
            n = r.new.size
            results.append((Segment(r.tensor, r.start, r.start + n, Op.DENSE, Positions.ALL,
                                    Values.RAW, n, np.empty(0, np.uint8), r.new.view(np.uint8)),
                            change))
        else:
            op, pc, vc = codes[i]
            plen, vlen = lens[i]
            results.append((Segment(r.tensor, r.start, r.start + r.new.size, _OPS[op],
                                    _POSITIONS[pc], _VALUES[vc], counted[i],
                                    out[at:at + plen], out[at + plen:at + plen + vlen]), change))
            at += plen + vlen
    return results
