"""Empirical entropy bounds on the size of one delta, to judge codecs against.

Both bounds are per tensor and summed over tensors; they count only the coded symbols (no model
or table cost), so a real codec can approach them but an order-0 coder of those symbols cannot
beat them. For a tensor with N elements, k of them changed at sorted positions p_1 < … < p_k:

order 0 (`order0_bytes`)
    gap_j  = p_j − p_{j−1} (p_0 = −1, so every gap ≥ 1)
    xor_j  = old ^ new,   diff_j = (new − old) mod 2^width     (bit patterns, integer view)
    H(s)   = empirical entropy of a symbol sequence s of length k, in bits per symbol
    bits   = k·H(gap) + k·min(H(xor), H(diff))

context (`context_bytes`), for float dtypes; the receiver knows every old word, so it can
condition on the old word's exponent e (integer dtypes fall back to order 0):
    n_e, k_e = elements / changed elements whose old exponent is e
    H_b(q)   = −q·log2 q − (1−q)·log2(1−q)
    bits     = Σ_e n_e·H_b(k_e/n_e) + min(Σ_e k_e·H(diff | e), Σ_e k_e·H(xor | e))

The XOR and integer-difference variants are reported separately; the bound takes the smaller
per tensor (a codec may choose per tensor too, as weighthub does). These are empirical entropies
(the statistics are taken from the delta itself and cost nothing), so neither bound is always
below the other: with few changes over a large alphabet of gaps, the gap entropy undercounts.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

import numpy as np

from ..tensors import DType


@dataclass(frozen=True, slots=True)
class DeltaBounds:
    """Entropy bounds of one delta (or a sum over tensors) in bytes, with their parts.

    order0_bytes and context_bytes take the smaller value variant per tensor, so a sum over
    tensors can be below gap + min(total xor, total diff).
    """

    changed: int
    order0_bytes: float
    context_bytes: float
    gap_bytes: float  # order-0 positions
    xor_bytes: float  # order-0 values, as XOR
    diff_bytes: float  # order-0 values, as wrap-around integer difference
    ctx_pos_bytes: float  # positions given the old exponent
    ctx_xor_bytes: float  # XOR values given the old exponent
    ctx_diff_bytes: float  # difference values given the old exponent

    def __add__(self, other: DeltaBounds) -> DeltaBounds:
        return DeltaBounds(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def to_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


EMPTY = DeltaBounds(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def _clogc(counts: np.ndarray) -> float:
    """Σ c·log2(c) over positive counts."""
    c = counts[counts > 0].astype(np.float64)
    return float((c * np.log2(c)).sum())


def _counts(symbols: np.ndarray) -> np.ndarray:
    """Occurrence counts of each distinct value (bincount where the alphabet is small)."""
    if symbols.size == 0:
        return np.zeros(0, np.int64)
    if symbols.dtype.itemsize <= 2 or (symbols.dtype.kind in "iu" and symbols.min() >= 0
                                       and symbols.max() < (1 << 20)):
        return np.bincount(symbols.astype(np.int64, copy=False))
    return np.unique(symbols, return_counts=True)[1]


def entropy_bits(symbols: np.ndarray) -> float:
    """k·H(s): total empirical order-0 entropy of a symbol sequence, in bits."""
    k = symbols.size
    return 0.0 if k == 0 else float(k * np.log2(k)) - _clogc(_counts(symbols))


def conditional_entropy_bits(symbols: np.ndarray, context: np.ndarray) -> float:
    """Σ_c k_c·H(s | c): total empirical entropy of symbols given a small-integer context."""
    if symbols.size == 0:
        return 0.0
    width = 8 * symbols.dtype.itemsize
    per_ctx = np.bincount(context.astype(np.int64))
    if width + int(per_ctx.size - 1).bit_length() <= 64:
        keys = (context.astype(np.uint64) << np.uint64(width)) | symbols.astype(np.uint64)
        joint = np.unique(keys, return_counts=True)[1]
    else:  # 64-bit symbols: no room for the context in one word
        pairs = np.stack([context.astype(np.uint64), symbols.astype(np.uint64)], axis=1)
        joint = np.unique(pairs, axis=0, return_counts=True)[1]
    return _clogc(per_ctx) - _clogc(joint)


def binary_entropy_bits(n: np.ndarray, k: np.ndarray) -> float:
    """Σ n·H_b(k/n) = Σ [n log n − k log k − (n−k) log(n−k)], in bits."""
    n = np.asarray(n, np.int64)
    k = np.asarray(k, np.int64)
    return _clogc(n) - _clogc(k) - _clogc(n - k)


def delta_bounds(old: np.ndarray, new: np.ndarray, dtype: DType) -> DeltaBounds:
    """Entropy bounds of the delta old → new of one tensor (flat unsigned bit views)."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"delta_bounds: {old.dtype}{old.shape} vs {new.dtype}{new.shape}")
    pos = np.flatnonzero(old != new)
    k = int(pos.size)
    if k == 0:
        return EMPTY
    o, w = old[pos], new[pos]
    xor = o ^ w
    diff = w - o  # unsigned arithmetic wraps: the difference mod 2^width
    gaps = np.diff(pos, prepend=-1)
    gap_bits = entropy_bits(gaps)
    xor_bits, diff_bits = entropy_bits(xor), entropy_bits(diff)
    if not dtype.is_float:
        ctx = (gap_bits, xor_bits, diff_bits)
    else:
        shift, mask = old.dtype.type(dtype.exponent_shift), old.dtype.type(dtype.exponent_mask)
        exp_all = (old >> shift) & mask
        exp_changed = (o >> shift) & mask
        n_e = np.bincount(exp_all.astype(np.int64), minlength=dtype.exponent_mask + 1)
        k_e = np.bincount(exp_changed.astype(np.int64), minlength=dtype.exponent_mask + 1)
        ctx = (binary_entropy_bits(n_e, k_e), conditional_entropy_bits(xor, exp_changed),
               conditional_entropy_bits(diff, exp_changed))
    return DeltaBounds(k, (gap_bits + min(xor_bits, diff_bits)) / 8,
                       (ctx[0] + min(ctx[1], ctx[2])) / 8, gap_bits / 8, xor_bits / 8,
                       diff_bits / 8, ctx[0] / 8, ctx[1] / 8, ctx[2] / 8)
