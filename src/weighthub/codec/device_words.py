"""Shared parts of the codec's device kernels (codec/device.py, codec/device_groups.py): the
kernels' op ids, slice sizes, argument checks and the word/value conversions.

Words are the signed torch integer views of the bit patterns (uint8 / int16 / int32 / int64 for
widths 1 / 2 / 4 / 8, as `tensors.word_view` gives); values are int64 holding the uint64 value
(two's complement), words zero-extended into them by masking; right shifts that must be logical
are arithmetic shifts followed by a mask. No numba here.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import UsageError
from .coding import Op

# The kernels' op ids, read from the wire ids (codec/kernels.py does the same); importing
# kernels here would import numba.
OP_XOR, OP_ADD, OP_OVERWRITE = int(Op.XOR), int(Op.ADD), int(Op.OVERWRITE)
# Kernel-only: ADD applied inversely (new = old - difference). Must equal kernels.OP_SUB
# (a unit test checks it).
OP_SUB = 16

# Elements per slice of a pass over a whole tensor. The largest user, group_ranks, holds about
# 28 bytes of temporaries per slice element (keys, a sort's output, an inverse permutation, an
# index ramp): ~235 MB at this size. A 16 MB slice of bf16 streams in ~10 µs on an H200, about
# what a sync or a handful of kernel launches cost, so much smaller slices would be dominated
# by those fixed costs (an estimate: not yet measured on a GPU). Read at call time (tests
# shrink it).
SLICE = 1 << 23

# On a CPU, torch's radix sort runs ~3x faster per element on runs that stay in cache (8M uint8
# keys: 0.04 s in 2M-element runs, 0.125 s in one run; 64M bf16 ranked in 0.7 s instead of
# 1.6 s, 2 cores), so the sorting passes (group_ranks, place_ranks) use slices of at most this
# many elements there.
CPU_SORT_SLICE = 1 << 21

# Group tables (per-key counts) are mask + 1 entries; exponent fields need at most 2^11 (F64).
MAX_GROUP_MASK = (1 << 20) - 1

# signed torch bit views by width and the unsigned numpy type of each (what the host kernels use)
WORD_DTYPES = {torch.uint8: np.uint8, torch.int16: np.uint16, torch.int32: np.uint32,
                torch.int64: np.uint64}
I64_MAX = (1 << 63) - 1


def check_words(t: torch.Tensor, what: str, where: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in WORD_DTYPES:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise UsageError(f"{where}: {what} must be a word tensor (torch.uint8/int16/int32/int64 "
                         f"bit view), got {got}; view floats with tensors.bits-style int views")
    if t.ndim != 1:
        raise UsageError(f"{where}: {what} must be 1-D, got shape {tuple(t.shape)}")


def check_field(shift: int, mask: int, where: str) -> int:
    """Validate a group key field; returns the table size mask + 1."""
    if not 0 <= shift < 64:
        raise UsageError(f"{where}: shift {shift} outside 0..63")
    if not 0 <= mask <= MAX_GROUP_MASK:
        raise UsageError(f"{where}: group mask {mask:#x} outside 0..{MAX_GROUP_MASK:#x}")
    return mask + 1


def index_tensor(x: torch.Tensor | np.ndarray, device: torch.device, what: str, where: str
           ) -> torch.Tensor:
    """A 1-D int64 tensor on `device` from a tensor or numpy array of integers."""
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "iu":
            raise UsageError(f"{where}: {what} must be integers, got a {x.dtype} array")
        # a copy: torch cannot share a read-only array, and uint64 keys over 2^63 wrap to
        # negative ones, which are refused as keys no element has
        x = torch.from_numpy(x.astype(np.int64))
    if not isinstance(x, torch.Tensor) or x.ndim != 1 or x.dtype.is_floating_point \
            or x.dtype.is_complex or x.dtype == torch.bool:
        raise UsageError(f"{where}: {what} must be a 1-D integer tensor or array")
    # non-blocking only towards a device: a non-blocking copy to the host may not be done yet
    return x.to(device=device, dtype=torch.int64, non_blocking=device.type != "cpu")


def key_dtype(mask: int) -> torch.dtype:
    # the narrowest type holding every key: a GPU radix sort does one pass per key byte
    return torch.uint8 if mask <= 0xFF else torch.int16 if mask <= 0x7FFF else torch.int32


def keys_of(words: torch.Tensor, shift: int, mask: int, dtype: torch.dtype) -> torch.Tensor:
    """(u >> shift) & mask of the zero-extended unsigned words u, in `dtype` (nonnegative).

    Computed in the word type where that is exact (one narrow pass instead of an int64 copy):
    an arithmetic shift differs from a logical one only in the bits above B - shift, which a
    mask below 2^(B - shift) clears, and such a mask is a positive value of the signed type
    unless shift is 0 and the mask reaches the sign bit.
    """
    bits = 8 * words.element_size()
    if shift >= bits:  # every bit of a zero-extended word shifted out
        return torch.zeros(words.shape, dtype=dtype, device=words.device)
    m = mask & ((1 << (bits - shift)) - 1)
    if words.dtype == torch.uint8 or m < 1 << (bits - 1):
        k = (words >> shift) & m
    else:  # int16 words, shift 0, mask ≥ 2^15 (masks stay below 2^20 < 2^31)
        k = ((words.to(torch.int32) & 0xFFFF) >> shift) & m
    return k.to(dtype)


def widen(words: torch.Tensor) -> torch.Tensor:
    """Words as int64 holding their zero-extended unsigned value (64-bit words: the same bits)."""
    if words.dtype == torch.int64:
        return words
    if words.dtype == torch.uint8:
        return words.to(torch.int64)
    return words.to(torch.int64) & ((1 << (8 * words.element_size())) - 1)


def narrow(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int64 values in [0, 2^B) (any int64 for B = 64) as words of `dtype`, exactly."""
    if dtype == torch.int64:
        return v
    if dtype != torch.uint8:  # into the signed range first, so the cast does not depend on wrapping
        sign = 1 << (8 * dtype.itemsize - 1)
        v = (v ^ sign) - sign
    return v.to(dtype)


def signed64(x: int) -> int:
    return x - (1 << 64) if x > I64_MAX else x


def sort_slice(device: torch.device) -> int:
    """Elements per slice of the sorting passes on `device` (see CPU_SORT_SLICE)."""
    return min(SLICE, CPU_SORT_SLICE) if device.type == "cpu" else SLICE
