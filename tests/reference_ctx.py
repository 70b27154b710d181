"""A reference encoder and decoder of the `ctx` segment coding, written from format/spec.md §2
("Context coding") in plain Python, independently of the numba kernels (codec.rangecoder,
codec.ctx_kernels). The codec tests check the kernels' bytes against it, byte for byte, and
the kernels' decoder on what it writes; it is slow (pure Python), so tests keep it to small
segments.
"""

from __future__ import annotations

import math

import numpy as np

from weighthub.tensors import DType


class _Context:
    __slots__ = ("c", "p")

    def __init__(self) -> None:
        self.p, self.c = 2048, 0

    def update(self, bit: int) -> None:
        s = min(1 + math.floor(math.log2(self.c + 1)), 6)
        self.p = self.p - (self.p >> s) if bit else self.p + ((4096 - self.p) >> s)
        self.p = min(max(self.p, 16), 4080)
        self.c = min(self.c + 1, 63)


class Contexts(dict[int, _Context]):
    def __missing__(self, key: int) -> _Context:
        self[key] = _Context()
        return self[key]


class Encoder:
    """The spec's range encoder, with modelled bits, direct bits, trees and coded integers."""

    def __init__(self) -> None:
        self.low, self.range, self.cache, self.pending = 0, 0xFFFFFFFF, 0, 1
        self.out = bytearray()

    def _shift_low(self) -> None:
        if self.low < 0xFF000000 or self.low >= 1 << 32:
            carry = self.low >> 32
            self.out.append((self.cache + carry) & 0xFF)
            self.out += bytes([(0xFF + carry) & 0xFF]) * (self.pending - 1)
            self.pending, self.cache = 0, (self.low >> 24) & 0xFF
        self.pending += 1
        self.low = (self.low & 0xFFFFFF) << 8

    def _normalize(self) -> None:
        while self.range < 1 << 24:
            self.range <<= 8
            self._shift_low()

    def bit(self, ctx: _Context, b: int) -> None:
        bound = (self.range >> 12) * ctx.p
        if b:
            self.low += bound
            self.range -= bound
        else:
            self.range = bound
        ctx.update(b)
        self._normalize()

    def direct(self, v: int, nbits: int) -> None:
        for i in range(nbits - 1, -1, -1):
            self.range >>= 1
            if (v >> i) & 1:
                self.low += self.range
            self._normalize()

    def tree(self, ctxs: Contexts, base: int, sym: int, levels: int) -> None:
        node = 1
        for i in range(levels - 1, -1, -1):
            b = (sym >> i) & 1
            self.bit(ctxs[base + node], b)
            node = 2 * node + b

    def integer(self, slot: Contexts, v: int) -> None:
        n = v.bit_length()
        self.tree(slot, 0, n, 7)
        if n >= 2:
            self.direct(v, n - 1)

    def finish(self) -> bytes:
        for _ in range(5):
            self._shift_low()
        return bytes(self.out)


def golomb_m(total_gap: int, count: int) -> int:
    """The writer's Golomb parameter (spec: from the group's mean gap)."""
    mean = total_gap / count
    if mean < 0.5:
        return 1
    p = 1.0 / (mean + 1.0)
    return max(1, math.ceil(-math.log(2.0 - p) / math.log(1.0 - p)))


def group_ranks(old: np.ndarray, pos: np.ndarray, dtype: DType) -> dict[int, list[tuple[int, int]]]:
    """key → [(rank, position)] of the changed positions, in position order."""
    keys = ((old.astype(np.uint64) >> np.uint64(dtype.exponent_shift))
            & np.uint64(dtype.exponent_mask)).astype(np.int64).tolist()
    changed, seen = set(pos.tolist()), {}
    groups: dict[int, list[tuple[int, int]]] = {}
    for i, k in enumerate(keys):
        r = seen.get(k, 0)
        if i in changed:
            groups.setdefault(k, []).append((r, i))
        seen[k] = r + 1
    return groups


def ctx_fits(old: np.ndarray, pos: np.ndarray, dtype: DType) -> bool:
    """Whether a ctx segment over these changes stays within the value contexts a reader
    models (spec: at most 2^22 per segment; only 64-bit floats can exceed it)."""
    bits = 8 * dtype.width
    per_group = (1 << bits.bit_length()) + sum(1 << min(n - 1, 8) for n in range(2, bits + 1))
    keys = (old[pos].astype(np.uint64) >> np.uint64(dtype.exponent_shift)) & np.uint64(dtype.exponent_mask)
    return len(set(keys.tolist())) * per_group <= 1 << 22


def ref_ctx(old: np.ndarray, pos: np.ndarray, z: dict[int, int], dtype: DType) -> tuple[bytes, bytes]:
    """(positions, values) streams of the changes at `pos` with entries z[position]."""
    groups = group_ranks(old, pos, dtype)
    table, gaps = [], []
    for key in sorted(groups):
        ranks = [r for r, _ in groups[key]]
        table.append((key, len(ranks), golomb_m(ranks[-1] + 1 - len(ranks), len(ranks))))
        gaps.append(list(np.diff(ranks, prepend=-1) - 1))
    values = [[z[p] for _, p in groups[key]] for key in sorted(groups)]
    return code_positions(table, gaps), code_values(values, 8 * dtype.width)


def code_positions(table: list[tuple[int, int, int]], gaps: list[list[int]], *,
                   ngroups: int | None = None) -> bytes:
    """The positions stream of a group table [(key, count, m)] and each group's rank gaps,
    coded as the spec says whatever they are (`ngroups` overrides the table's length)."""
    enc, ints = Encoder(), [Contexts() for _ in range(4)]
    enc.integer(ints[0], len(table) if ngroups is None else ngroups)
    prev = -1
    for key, count, m in table:
        enc.integer(ints[1], key - prev - 1)
        enc.integer(ints[2], count - 1)
        enc.integer(ints[3], m - 1)
        prev = key
    unary = Contexts()
    for j, ((_, _, m), group) in enumerate(zip(table, gaps, strict=True)):
        carry(unary, j, 8)
        k = (m - 1).bit_length()  # the smallest k with 2^k >= m
        u = (1 << k) - m
        for gap in group:
            q, rem = divmod(int(gap), m)
            for i in range(q):
                enc.bit(unary[8 * j + min(i, 7)], 1)
            enc.bit(unary[8 * j + min(q, 7)], 0)
            if m > 1:
                enc.direct(rem, k - 1) if rem < u else enc.direct(rem + u, k)
    return enc.finish()


def code_values(groups: list[list[int]], bits: int) -> bytes:
    """The values stream of each group's entries (group-major) for words of `bits` bits (an
    entry wider than that, which hostile tests write, gets some tree: a reader refuses it at its
    length)."""
    levels = bits.bit_length()
    offsets = {}  # length n → its mantissa tree's first context, after the length tree
    block = 1 << levels
    for n in range(2, bits + 1):
        offsets[n] = block
        block += 1 << min(n - 1, 8)
    enc, models = Encoder(), Contexts()
    for j, zs in enumerate(groups):
        carry(models, j, block)
        for z in zs:
            n = z.bit_length()
            enc.tree(models, block * j, n, levels)
            if n >= 2:
                nm = min(n - 1, 8)
                rest = n - 1 - nm
                enc.tree(models, block * j + offsets.get(n, 0), (z >> rest) & ((1 << nm) - 1), nm)
                enc.direct(z, rest)
    return enc.finish()


def carry(models: Contexts, j: int, width: int) -> None:
    """Group j's contexts start as group j − 1's ended, counts capped at 4 (spec)."""
    if j == 0:
        return
    for k in range(width):
        prev = models.get(width * (j - 1) + k)
        if prev is not None:
            ctx = models[width * j + k]
            ctx.p, ctx.c = prev.p, min(prev.c, 4)
