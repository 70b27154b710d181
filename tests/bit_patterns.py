"""Bit-pattern generators shared by the codec and digest tests (importable: tests/ is on the path)."""

from __future__ import annotations

import numpy as np

from weighthub.tensors import DType


def special_patterns(dtype: DType) -> np.ndarray:
    """Bit patterns that float equality gets wrong: ±0, ±inf, NaN payloads, subnormals, extremes."""
    bits = 8 * dtype.width
    top = (1 << bits) - 1
    sign = 1 << (bits - 1)
    if dtype.name == "BOOL":
        return np.array([0, 1], dtype.uint)
    out = {0, 1, top, sign, sign - 1, sign | 1, top - 1}
    if dtype.is_float:
        s, m = dtype.exponent_shift, dtype.exponent_mask
        exp = m << s
        out |= {
            exp, sign | exp,  # ±inf (or the top binade where the format has none)
            exp | 1, sign | exp | 1,  # signalling NaN, smallest payload
            exp | (1 << (s - 1)), exp | (1 << (s - 1)) | 1,  # quiet NaNs with payloads
            exp | ((1 << s) - 1), top,  # largest payload, all ones
            (1 << s) - 1, sign | ((1 << s) - 1),  # largest subnormals
            1 << s, (m - 1) << s | ((1 << s) - 1),  # smallest normal, largest finite
        }
    return np.array(sorted(out), dtype.uint)


def random_bits(rng: np.random.Generator, dtype: DType, n: int, special_frac: float = 0.2) -> np.ndarray:
    """n random bit patterns of a dtype's width, a fraction of them drawn from the specials."""
    if dtype.name == "BOOL":
        return rng.integers(0, 2, n, dtype=np.uint8)
    raw = rng.integers(0, 256, n * dtype.width, dtype=np.uint8).view(dtype.uint).copy()
    specials = special_patterns(dtype)
    pick = rng.random(n) < special_frac
    raw[pick] = specials[rng.integers(0, specials.size, int(pick.sum()))]
    return raw
