"""The codec's device kernels in plain torch ops: change scan, exponent-group ranks and their
inverse, and the sparse apply, on tensors wherever they live (CUDA in production, CPU in tests).

Each function produces exactly what its numba host kernel (codec/kernels.py) produces for the
same bits, so a trainer or receiver whose weights live on a GPU can extract or apply a delta
there and only the compact streams cross to the host:

    scan         ~ scan.scan_range             changed positions with their old and new words
    group_ranks  ~ kernels.group_ranks         (old exponent, rank within it) per change
    place_ranks  ~ the last pass of place.ctx_place (both codings')
    combine      ~ kernels._combine            new words from old words and decoded values
    apply_sparse ~ kernels.apply_positions     in place, returning the undo record
    restore      ~ kernels.restore

Words are the signed torch integer views of the bit patterns (uint8 / int16 / int32 / int64 for
widths 1 / 2 / 4 / 8, as `tensors.bits` uses); comparing bits is comparing those integers.
Values are int64 holding the uint64 value (two's complement), words zero-extended into them by
masking; right shifts that must be logical are arithmetic shifts followed by a mask.

Memory: every pass over a whole tensor works in slices of at most SLICE elements, so the
temporaries are O(SLICE) plus O(changed), never O(len) (a receiver's GPU is mostly full of
KV cache). Speed on a GPU (../shared/MEASUREMENTS.md): each elementwise op is a memory pass and
a host sync costs more than a small tensor's work, so syncs happen only where a size must be
known on the host: once per slice in `scan` (torch.nonzero) and in a multi-slice `place_ranks`
(how many entries land in the slice), once per call in `group_ranks` and a one-slice
`place_ranks`, never in combine / apply_sparse / restore. Keys are counted by sorting, not by
torch.bincount (on CUDA it reads its input's min and max back to the host) or torch.histc
(refused on CUDA under torch's deterministic mode).

This module imports no numba: a process that only moves tensors on a device need not pay it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import UsageError
from . import device_words as W
from .device_groups import group_ranks, place_ranks
from .device_words import OP_ADD, OP_OVERWRITE, OP_SUB, OP_XOR

__all__ = ["OP_ADD", "OP_OVERWRITE", "OP_SUB", "OP_XOR", "DeviceChanges", "apply_sparse",
           "combine", "group_ranks", "place_ranks", "restore", "scan"]


@dataclass(frozen=True, slots=True)
class DeviceChanges:
    """Changed elements of a range on its device, in increasing position order."""

    pos: torch.Tensor  # int64, strictly increasing positions in the range
    old: torch.Tensor  # the old words at pos (the inputs' word dtype)
    new: torch.Tensor  # the new words at pos

    def to_host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pos int64, old, new) as numpy arrays, the words in the unsigned numpy type of their
        width: what `scan.scan_range` returns in its `Changes` for the same inputs.

        From CUDA the three copies go through pinned host memory without blocking, with one
        synchronize of the current stream at the end (so they overlap one another).
        """
        tensors = (self.pos, self.old, self.new)
        if self.pos.device.type == "cuda":
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(host, tensors, strict=True):
                h.copy_(t, non_blocking=True)
            torch.cuda.current_stream(self.pos.device).synchronize()
        else:
            host = [t.cpu() for t in tensors]
        pos, old, new = (h.numpy() for h in host)
        uint = W.WORD_DTYPES[self.old.dtype]
        return pos, old.view(uint), new.view(uint)


# --- change scan --------------------------------------------------------------------------------


def scan(old: torch.Tensor, new: torch.Tensor, limit: int) -> DeviceChanges | None:
    """Every changed element of two equal-length word tensors, or None if more than `limit`.

    Per slice of SLICE elements: one compare pass (a bool temporary), torch.nonzero (the one
    host sync per slice: it must know how many to allocate) and two gathers of the changed
    words; the per-slice results are concatenated once at the end. It gives up, at a slice
    boundary, as soon as the count passes `limit`. Temporaries: SLICE bytes plus O(changed).

    Args:
        old, new: 1-D word tensors (torch.uint8/int16/int32/int64 bit views), same dtype,
            length and device.
        limit: the most changes worth returning.

    Returns:
        The changes (as `scan.scan_range`'s, on the inputs' device), or None if more than `limit`.

    Raises:
        UsageError: a non-word dtype, mismatched dtypes, shapes or devices, or non-1-D inputs.
    """
    where = "device.scan"
    W.check_words(old, "old", where)
    W.check_words(new, "new", where)
    if old.shape != new.shape or old.dtype != new.dtype or old.device != new.device:
        raise UsageError(f"{where}: {old.dtype}{tuple(old.shape)} on {old.device} vs "
                         f"{new.dtype}{tuple(new.shape)} on {new.device}")
    n, step = old.shape[0], W.SLICE
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    total = 0
    for lo in range(0, n, step):
        a, b = old[lo:lo + step], new[lo:lo + step]
        idx = torch.nonzero(a != b).squeeze(1)
        total += idx.shape[0]
        if total > limit:
            return None
        if idx.shape[0]:
            parts.append((idx + lo, a[idx], b[idx]))
    if total > limit:  # n == 0 with a negative limit, as scan_range
        return None
    if not parts:
        empty = old[:0].clone()
        return DeviceChanges(torch.zeros(0, dtype=torch.int64, device=old.device), empty,
                             empty.clone())
    if len(parts) == 1:
        return DeviceChanges(*parts[0])
    pos, ov, nv = (torch.cat(list(p)) for p in zip(*parts, strict=True))
    return DeviceChanges(pos, ov, nv)


# --- applying -----------------------------------------------------------------------------------


def combine(old: torch.Tensor, z: torch.Tensor, op: int, bits: int) -> torch.Tensor:
    """New words from old words and decoded values z under op, exactly as kernels._combine
    with mask = 2^bits − 1: xor: old ^ z; add: old + unzigzag(z); sub: old − unzigzag(z)
    (add undone); overwrite: z; all mod 2^bits.

    Args:
        old: 1-D word tensor.
        z: int64 tensor (the uint64 values, two's complement), old's shape and device.
        op: W.OP_XOR, W.OP_ADD, W.OP_SUB or W.OP_OVERWRITE.
        bits: 1 .. the word width in bits (the value mask's width).

    Returns:
        The new words, in old's dtype and on its device.

    Raises:
        UsageError: a bad word tensor, z not int64 of old's shape and device, an unknown op or
            a bits outside the word.
    """
    where = "device.combine"
    W.check_words(old, "old", where)
    if not isinstance(z, torch.Tensor) or z.dtype != torch.int64 or z.shape != old.shape \
            or z.device != old.device:
        got = f"{z.dtype}{tuple(z.shape)} on {z.device}" if isinstance(z, torch.Tensor) else type(z)
        raise UsageError(f"{where}: values must be int64 of shape {tuple(old.shape)} on "
                         f"{old.device}, got {got}")
    width = 8 * old.element_size()
    if not 1 <= bits <= width:
        raise UsageError(f"{where}: {bits} value bits for {width}-bit words")
    m = W.signed64((1 << bits) - 1)
    if op == W.OP_XOR:
        v = (W.widen(old) ^ z) & m
    elif op in (W.OP_ADD, W.OP_SUB):
        # unzigzag: logical z >> 1, xor all ones when z is odd; reduced mod 2^bits first so
        # the sum below cannot leave int64 for narrow words (64-bit words wrap, as in uint64)
        d = (((z >> 1) & W.I64_MAX) ^ (-(z & 1))) & m
        v = ((W.widen(old) + d) if op == W.OP_ADD else (W.widen(old) - d)) & m
    elif op == W.OP_OVERWRITE:
        v = z & m
    else:
        raise UsageError(f"{where}: unknown op {op}; known: xor {W.OP_XOR}, add {W.OP_ADD}, "
                         f"sub {W.OP_SUB}, overwrite {W.OP_OVERWRITE}")
    return W.narrow(v, old.dtype)


def apply_sparse(dst: torch.Tensor, pos: torch.Tensor, z: torch.Tensor, op: int, bits: int
                 ) -> torch.Tensor:
    """In place: dst[pos] = combine(dst[pos], z, op, bits); returns the old words (the undo
    record for `restore`).

    The write is an index_copy_ into `dst` itself, so it lands in the storage that dst views
    (a target's weights), never in a copy. Temporaries O(len(pos)).

    Args:
        dst: 1-D word view of the target's storage.
        pos: int64 positions on dst's device, distinct and in range (validated by the caller:
            an out-of-range index is torch's IndexError, or a device-side assert on CUDA).
        z, op, bits: as `combine`.

    Returns:
        The words at pos before the write (dst's dtype and device).

    Raises:
        UsageError: bad tensors (as combine), or pos not int64 of z's length on dst's device.
    """
    where = "device.apply_sparse"
    W.check_words(dst, "dst", where)
    _check_pos(pos, dst, where)
    old = dst.index_select(0, pos)
    dst.index_copy_(0, pos, combine(old, z, op, bits))
    return old


def restore(dst: torch.Tensor, pos: torch.Tensor, old: torch.Tensor) -> None:
    """dst[pos] = old, the undo of `apply_sparse` (idempotent: safe to run twice).

    Raises:
        UsageError: bad tensors, or old not of dst's dtype and pos's length.
    """
    where = "device.restore"
    W.check_words(dst, "dst", where)
    _check_pos(pos, dst, where)
    if not isinstance(old, torch.Tensor) or old.dtype != dst.dtype or old.shape != pos.shape \
            or old.device != dst.device:
        raise UsageError(f"{where}: old words must be {dst.dtype}{tuple(pos.shape)} on "
                         f"{dst.device}")
    dst.index_copy_(0, pos, old)


def _check_pos(pos: torch.Tensor, dst: torch.Tensor, where: str) -> None:
    if not isinstance(pos, torch.Tensor) or pos.dtype != torch.int64 or pos.ndim != 1 \
            or pos.device != dst.device:
        raise UsageError(f"{where}: positions must be a 1-D int64 tensor on {dst.device}")
