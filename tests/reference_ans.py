"""A reference encoder of the `ans` segment coding, written from format/spec.md §2 ("ANS coding")
in plain Python, independently of the numba kernels (codec.ans, codec.ans_kernels). The codec
tests check the kernels' bytes against it, byte for byte, and the kernels' decoder on what it
writes; it is slow (pure Python), so tests keep it to small segments.
"""

from __future__ import annotations

import numpy as np

from reference_ctx import golomb_m, group_ranks
from weighthub.tensors import DType


class Context:
    """A context of alphabet A: weights, observations, rebuild point, coding table (spec)."""

    def __init__(self, alphabet: int) -> None:
        self.a = alphabet
        self.w: list[int] | None = None  # never used yet
        self.group = -1
        self.c = self.t = 0
        self.freq: list[int] = []
        self.start: list[int] = []

    def rebuild(self) -> None:
        if sum(self.w) > 1 << 20:
            self.w = [x >> 1 for x in self.w]
        total = sum(self.w)
        self.freq = [4 + x * (4096 - 4 * self.a) // total for x in self.w]
        heaviest = self.w.index(max(self.w))
        self.freq[heaviest] += 4096 - sum(self.freq)
        self.start = [sum(self.freq[:s]) for s in range(self.a)]

    def enter(self, group: int) -> None:
        if self.w is None:
            self.w = [4] * self.a
        elif sum(self.w) > 256:
            total = sum(self.w)
            self.w = [x * 256 // total for x in self.w]
        self.c, self.t, self.group = 0, 1, group
        self.rebuild()

    def op(self, s: int, group: int) -> tuple[int, int, int]:
        """The op of symbol s in `group` (entering it first), then the observation."""
        if self.group != group:
            self.enter(group)
        op = (self.start[s], self.freq[s], 12)
        self.w[s] += 32
        self.c += 1
        if self.c == self.t:
            self.t = self.c + min(max(1, self.c >> 2), 256)
            self.rebuild()
        return op


def raw(v: int, k: int) -> list[tuple[int, int, int]]:
    """The ops of a raw field of k bits (pieces of at most 16, the odd one first)."""
    ops = []
    while k > 0:
        take = k - 16 * ((k - 1) // 16)
        k -= take
        ops.append(((v >> k) & ((1 << take) - 1), 1, take))
    return ops


def integer(slot: Context, v: int) -> list[tuple[int, int, int]]:
    n = v.bit_length()
    return [slot.op(n, 0)] + (raw(v, n - 1) if n >= 2 else [])


def code(ops: list[tuple[int, int, int]]) -> bytes:
    """The rANS stream of ops (decoding order): two interleaved states, words prepended."""
    x = [1 << 16, 1 << 16]
    words: list[int] = []
    for j in range(len(ops) - 1, -1, -1):
        start, freq, b = ops[j]
        s = x[j % 2]
        if s >= ((1 << 16 >> b) << 16) * freq:
            words.insert(0, s & 0xFFFF)
            s >>= 16
        x[j % 2] = ((s // freq) << b) + s % freq + start
    return (x[0].to_bytes(4, "little") + x[1].to_bytes(4, "little")
            + b"".join(w.to_bytes(2, "little") for w in words))


def rice_k(total_gap: int, count: int) -> int:
    return golomb_m(total_gap, count).bit_length() - 1


def ref_ans(old: np.ndarray, pos: np.ndarray, z: dict[int, int], dtype: DType) -> tuple[bytes, bytes]:
    """(positions, values) streams of the changes at `pos` with entries z[position]."""
    groups = group_ranks(old, pos, dtype)
    table, gaps = [], []
    for key in sorted(groups):
        ranks = [r for r, _ in groups[key]]
        g = list(np.diff(ranks, prepend=-1) - 1)
        table.append((key, len(ranks), rice_k(int(sum(g)), len(ranks))))
        gaps.append([int(x) for x in g])
    values = [[z[p] for _, p in groups[key]] for key in sorted(groups)]
    return code_positions(table, gaps), code_values(values, 8 * dtype.width)


def code_positions(table: list[tuple[int, int, int]], gaps: list[list[int]]) -> bytes:
    """The positions stream of a group table [(key, count, k)] and each group's rank gaps."""
    ints = [Context(65) for _ in range(5)]
    ops = integer(ints[0], len(table))
    prev = -1
    for key, count, k in table:
        ops += integer(ints[1], key - prev - 1) + integer(ints[2], count - 1) + integer(ints[3], k)
        prev = key
    quotient = Context(8)
    for j, ((_, _, k), group) in enumerate(zip(table, gaps, strict=True)):
        for gap in group:
            q = gap >> k
            ops.append(quotient.op(min(q, 7), j))
            if q >= 7:
                ops += integer(ints[4], q - 7)
            ops += raw(gap & ((1 << k) - 1), k)
    return code(ops)


def code_values(groups: list[list[int]], bits: int) -> bytes:
    """The values stream of each group's entries (group-major) for words of `bits` bits."""
    head = Context(bits + 5)
    first: dict[int, Context] = {}
    second: dict[tuple[int, int], Context] = {}
    ops = []
    for j, zs in enumerate(groups):
        for z in zs:
            n = z.bit_length()
            ops.append(head.op(z if z < 8 else 8 + n - 4, j))
            if z < 8:
                continue
            t1 = min(n - 1, 4)
            r = n - 1 - t1
            c1 = (z >> r) & ((1 << t1) - 1)
            ops.append(first.setdefault(n, Context(16)).op(c1, j))
            if r > 0:
                t2 = min(r, 4)
                r -= t2
                ops.append(second.setdefault((n, c1), Context(16)).op((z >> r) & ((1 << t2) - 1), j))
                ops += raw(z, r)
    return code(ops)
