"""The shape arithmetic of placing a block of words in canonical space (format/spec.md §4),
shared by the host (`digest.linear`) and device (`digest.device`) digests: plain Python."""

from __future__ import annotations


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides, in elements, of a block of this shape."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def coalesce(shape: tuple[int, ...], mem: tuple[int, ...], canon: tuple[int, ...]
             ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Drop unit dims and merge neighbours that are contiguous in memory and in canonical space."""
    if 0 in shape:
        return (0,), (1,), (1,)
    dims = [(n, m, c) for n, m, c in zip(shape, mem, canon, strict=True) if n != 1]
    merged: list[tuple[int, int, int]] = []
    for n, m, c in dims:
        if merged:
            pn, pm, pc = merged[-1]
            if pm == n * m and pc == n * c:
                merged[-1] = (pn * n, m, c)
                continue
        merged.append((n, m, c))
    if not merged:
        return (1,), (1,), (1,)
    return (tuple(d[0] for d in merged), tuple(d[1] for d in merged),
            tuple(d[2] for d in merged))
