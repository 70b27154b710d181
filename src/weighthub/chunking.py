"""Deterministic chunk boundaries from the tensor table.

Tensors are taken in canonical (name) order; big tensors are split into ranges of at most
`span_bytes`, small ones are bucketed together until a chunk covers about `span_bytes` of
dense data. Every rank and every receiver computes the same tiling from the same table.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import UsageError
from .tensors import TensorSpec

Range = tuple[int, int, int]  # (tensor index, start element, stop element)

MIN_SPAN = 4096


def tile(specs: Sequence[TensorSpec], span_bytes: int) -> list[list[Range]]:
    if span_bytes < MIN_SPAN:
        raise UsageError(f"chunk span {span_bytes} bytes is below the minimum {MIN_SPAN}")
    chunks: list[list[Range]] = []
    current: list[Range] = []
    filled = 0
    for ti, spec in enumerate(specs):
        width = spec.dtype.width
        start = 0
        while start < spec.numel:
            room = max(1, (span_bytes - filled) // width)
            stop = min(spec.numel, start + room)
            current.append((ti, start, stop))
            filled += (stop - start) * width
            start = stop
            if filled >= span_bytes - width + 1:
                chunks.append(current)
                current, filled = [], 0
    if current:
        chunks.append(current)
    return chunks
