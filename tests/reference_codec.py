"""A reference delta encoder written from format/spec.md §2, independently of the kernels, and
the old/new bit-array generator the codec tests share (importable: tests/ is on the path).

Tests build segments with each coding forced, so decoders are checked against the spec rather
than against whatever the encoder happens to choose.
"""

from __future__ import annotations

import numpy as np

from bit_patterns import random_bits
from reference_ans import ref_ans
from reference_ctx import ref_ctx
from weighthub.codec import Op, Positions, Segment, Values
from weighthub.tensors import DType

OP_FOR = {Values.VARINT: Op.XOR, Values.ZIGZAG: Op.ADD, Values.RAW: Op.OVERWRITE, Values.CTX: Op.XOR,
          Values.ANS: Op.XOR}


def leb128(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def u8(b: bytes) -> np.ndarray:
    return np.frombuffer(b, np.uint8).copy()


def ref_gaps(pos: np.ndarray) -> bytes:
    prev, out = -1, bytearray()
    for p in pos.tolist():
        out += leb128(p - prev - 1)
        prev = p
    return bytes(out)


def ref_groups(old: np.ndarray, pos: np.ndarray, dtype: DType) -> bytes:
    keys = ((old.astype(np.uint64) >> np.uint64(dtype.exponent_shift))
            & np.uint64(dtype.exponent_mask)).astype(np.int64)
    seen: dict[int, int] = {}
    ranks = {}
    changed = set(pos.tolist())
    per_group: dict[int, list[int]] = {}
    for i, k in enumerate(keys.tolist()):
        r = seen.get(k, 0)
        if i in changed:
            ranks[i] = r
            per_group.setdefault(k, []).append(r)
        seen[k] = r + 1
    out = bytearray(leb128(len(per_group)))
    for k in sorted(per_group):
        out += leb128(k) + leb128(len(per_group[k]))
    for k in sorted(per_group):
        prev = -1
        for r in per_group[k]:
            out += leb128(r - prev - 1)
            prev = r
    return bytes(out)


def ref_bitmap(n: int, pos: np.ndarray) -> bytes:
    mask = np.zeros(n, np.bool_)
    mask[pos] = True
    return np.packbits(mask, bitorder="little").tobytes()


def ref_entries(old: np.ndarray, new: np.ndarray, pos: np.ndarray, op: Op, dtype: DType) -> list[int]:
    """The op's entry z per changed position (xor: old^new; add: the zigzagged wrap-around
    difference; overwrite: the new word)."""
    bits = 8 * dtype.width
    out = []
    for o, n in zip(old[pos].tolist(), new[pos].tolist(), strict=True):
        if op == Op.XOR:
            z = o ^ n
        elif op == Op.ADD:
            d = (n - o) % (1 << bits)
            s = d - (1 << bits) if d >> (bits - 1) else d  # the signed difference
            z = 2 * s if s >= 0 else -2 * s - 1
        else:
            z = n
        out.append(z % (1 << bits))
    return out


def ref_values(old: np.ndarray, new: np.ndarray, pos: np.ndarray, codec: Values, dtype: DType,
               op: Op | None = None) -> bytes:
    """The value stream: the op's entries as varints or raw words (W bytes)."""
    op = OP_FOR[codec] if op is None else op
    out = bytearray()
    for z in ref_entries(old, new, pos, op, dtype):
        out += z.to_bytes(dtype.width, "little") if codec == Values.RAW else leb128(z)
    return bytes(out)


def ref_segment(old: np.ndarray, new: np.ndarray, dtype: DType, positions: Positions,
                values: Values, start: int = 0, *, op: Op | None = None) -> Segment:
    """A segment of every changed word, coded as forced; op defaults to the values' usual one."""
    op = OP_FOR[values] if op is None else op
    pos = np.flatnonzero(old != new)
    if positions in (Positions.CTX, Positions.ANS):
        z = dict(zip(pos.tolist(), ref_entries(old, new, pos, op, dtype), strict=True))
        pb, vb = (ref_ctx if positions == Positions.CTX else ref_ans)(old, pos, z, dtype)
        return Segment(0, start, start + old.size, op, positions, values, int(pos.size), u8(pb), u8(vb))
    if positions == Positions.GAPS:
        pb = ref_gaps(pos)
    elif positions == Positions.GROUPS:
        pb = ref_groups(old, pos, dtype)
    else:
        pb = ref_bitmap(old.size, pos)
    return Segment(0, start, start + old.size, op, positions, values, int(pos.size),
                   u8(pb), u8(ref_values(old, new, pos, values, dtype, op)))


def make_pair(dtype: DType, seed: int, n: int, density: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    old = random_bits(rng, dtype, n)
    new = old.copy()
    change = rng.random(n) < density
    new[change] = random_bits(rng, dtype, int(change.sum()), special_frac=0.3)
    if dtype.name != "BOOL" and change.any() and rng.random() < 0.5:
        # mostly ±1 ulp moves, as RL steps make them (wrap-around at the ends is fine)
        step = rng.choice(np.array([1, (1 << (8 * dtype.width)) - 1], np.uint64), int(change.sum()))
        new[change] = (old[change].astype(np.uint64) + step).astype(dtype.uint)
    return old, new
