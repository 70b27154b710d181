"""The linear tensor digest (format/spec.md §4) in plain torch ops, for words on any device.

The host loops (`digest.kernels`, numba) read host memory; this module computes the same two
lane sums where the tensor lives (CUDA in production, CPU in tests) and so gives the same 16
bytes: a rank digests its shard without copying it to the host, and a receiver checks what it
wrote on the GPU.

torch has no general uint64 arithmetic, so each uint64 is held as the int64 with the same bit
pattern. Add, multiply and sum of int64 wrap mod 2^64 (two's complement) on CPU and CUDA, which
is exactly the uint64 arithmetic of the spec; XOR/AND/OR are bitwise; only the right shift
differs (arithmetic on int64), so a logical shift is emulated by masking off the copied sign
bits. Constants above 2^63 are written as their int64 equivalents (`_s64`).

Memory is bounded whatever the tensor's size: words are taken in chunks of at most `SLICE`
elements, and a chunk needs at most five int64 scratch buffers of its length (the two Weyl
sequences, the widened word, a lane and a shift temporary): 5 · SLICE · 8 bytes, 160 MiB at
SLICE = 2^22 (four buffers for 8-byte words). Setting up the Weyl values of a multi-dim block
takes, for a moment, two more int64 tensors of at most one chunk: 7 · SLICE · 8 bytes at worst.
The buffers are allocated once per call and reused by every chunk.

Nothing here waits on the device: every function that returns lanes returns an int64[2] tensor
on the words' device (S0, S1 as two's-complement bit patterns), and the only device→host copy is
`lanes_bytes`. The `digest_*`/`tensor_digest` functions are the lanes functions plus that copy.
Importing this module does not import numba.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import UsageError
from ..tensors import dtype_of
from .blocks import c_strides, coalesce
from .sums import lanes_digest

SLICE = 1 << 22  # elements per chunk: bounds the scratch memory (see the module docstring)
# on a CPU, chunks whose buffers stay in cache: a 64M-element bf16 tensor on 2 cores took 900 ms
# in chunks of 2^22, 400 ms in chunks of 2^18 and 490 ms in chunks of 2^16 (more Python per word)
_CPU_SLICE = 1 << 18

_M64 = (1 << 64) - 1


def _s64(x: int) -> int:
    """The int64 holding the bit pattern of x mod 2^64."""
    return ((x + (1 << 63)) & _M64) - (1 << 63)


# spec §4's constants, as in digest.mix (which imports numba, so they are restated here; the
# tests compare every path with the numba kernels bit for bit)
K0 = _s64(0x9E3779B97F4A7C15)
K1 = _s64(0xD1B54A32D192ED03)
_M0A = _s64(0xFF51AFD7ED558CCD)
_M0B = _s64(0xC4CEB9FE1A85EC53)
_M1A = _s64(0xBF58476D1CE4E5B9)
_M1B = _s64(0x94D049BB133111EB)
_LOW32 = 0xFFFFFFFF

# the signed torch type each word width is viewed as (torch lacks unsigned 16/32/64 views);
# 1-byte words are uint8, whose conversion to int64 already zero-extends
_VIEW_BY_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ZEXT_MASK = {2: 0xFFFF, 4: _LOW32}  # int16/int32 widen with their sign: mask it off


def as_words(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integer words of the same width (a view, whatever the strides).

    Args:
        t: a tensor of any dtype whose element width is 1, 2, 4 or 8 bytes; its bits count.

    Returns:
        `t` viewed as uint8, int16, int32 or int64, detached.

    Raises:
        UsageError: for another element width.
    """
    width = t.element_size()
    view = _VIEW_BY_WIDTH.get(width)
    if view is None:
        raise UsageError(f"cannot digest {t.dtype} words: element width must be 1, 2, 4 or 8 "
                         "bytes")
    t = t.detach()
    return t if t.dtype == view else t.view(view)


class _Scratch:
    """The int64 buffers one call's chunks share: allocated on first use, then reused; and the
    chunk length on this device (SLICE, or less on a CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.slice = min(SLICE, _CPU_SLICE) if device.type == "cpu" else SLICE
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        n = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n:
            buf = self._bufs[name] = torch.empty(n, dtype=torch.int64, device=self.device)
        return buf[:n].view(tuple(shape))


def _xorshift(x: torch.Tensor, t: torch.Tensor, s: int) -> None:
    """x ^= x >> s with a logical shift (t: a scratch buffer of x's shape)."""
    torch.bitwise_right_shift(x, s, out=t)
    t.bitwise_and_((1 << (64 - s)) - 1)  # clear the s sign copies the arithmetic shift made
    x.bitwise_xor_(t)


def _fmix64(x: torch.Tensor, t: torch.Tensor) -> None:
    _xorshift(x, t, 33)
    x.mul_(_M0A)
    _xorshift(x, t, 33)
    x.mul_(_M0B)
    _xorshift(x, t, 33)


def _mix13(x: torch.Tensor, t: torch.Tensor) -> None:
    _xorshift(x, t, 30)
    x.mul_(_M1A)
    _xorshift(x, t, 27)
    x.mul_(_M1B)
    _xorshift(x, t, 31)


def _fold(words: torch.Tensor, k0: torch.Tensor, k1: torch.Tensor, scratch: _Scratch
          ) -> torch.Tensor:
    """(S0, S1) of `words` (an integer word view, any shape and strides) at the Weyl values
    k0 = (i + 1)·K0, k1 = (i + 1)·K1 of each element (int64 tensors of the words' shape)."""
    shape = words.shape
    a = scratch.get("a", shape)
    t = scratch.get("t", shape)
    if words.dtype == torch.int64:
        # 8-byte words are already the 64-bit patterns: read them where they are
        torch.bitwise_xor(words, k0, out=a)
        _fmix64(a, t)
        s0 = a.sum()
        torch.bitwise_right_shift(words, 32, out=t)  # rotl(w, 32), the shift made logical
        t.bitwise_and_(_LOW32)
        torch.bitwise_left_shift(words, 32, out=a)
        a.bitwise_or_(t)
        a.bitwise_xor_(k1)
        _mix13(a, t)
        s1 = a.sum()
    else:
        w = scratch.get("w", shape)
        w.copy_(words)  # widens and gathers a strided chunk in one pass
        mask = _ZEXT_MASK.get(words.element_size())
        if mask is not None:
            w.bitwise_and_(mask)
        # a word under 2^32 rotates by a plain shift; lane 1 first, so lane 0 can reuse w
        torch.bitwise_left_shift(w, 32, out=a)
        a.bitwise_xor_(k1)
        _mix13(a, t)
        s1 = a.sum()
        w.bitwise_xor_(k0)
        _fmix64(w, t)
        s0 = w.sum()
    return torch.stack((s0, s1))


def _inner_offsets(shape: tuple[int, ...], canon: tuple[int, ...], device: torch.device
                   ) -> torch.Tensor:
    """Σ_j a_j·canon[j] (mod 2^64) for every element a of a block of this shape, row-major."""
    off = torch.zeros(1, dtype=torch.int64, device=device)
    for n, c in zip(shape, canon, strict=True):
        step = torch.arange(n, dtype=torch.int64, device=device).mul_(_s64(c))
        off = (off.view(-1, 1) + step.view(1, -1)).view(-1)
    return off


def _block(w: torch.Tensor, f1: int, canon: tuple[int, ...], scratch: _Scratch
           ) -> torch.Tensor:
    """(S0, S1) of an n-D block of words whose element a is canonical index f1 − 1 + Σ a_j·canon[j].

    Chunks are whole rows of dim 0 (at most scratch.slice elements); a row of more than that
    is a block of its own, one dim down.
    """
    n0 = w.shape[0]
    inner = w[0].numel()
    if inner > scratch.slice:  # each sub-block is over a chunk long: the Python loop is amortized
        acc = torch.zeros(2, dtype=torch.int64, device=w.device)
        for i in range(n0):
            acc += _block(w[i], f1 + i * canon[0], canon[1:], scratch)
        return acc
    rows = max(1, min(n0, scratch.slice // inner))
    shape = (rows, *w.shape[1:])
    # the Weyl values of the first chunk, k = (f1 + r·canon[0] + offset)·K ...
    k0 = scratch.get("k0", shape)
    k1 = scratch.get("k1", shape)
    head = torch.arange(rows, dtype=torch.int64, device=w.device).mul_(_s64(canon[0]))
    head.add_(_s64(f1))
    off = _inner_offsets(tuple(w.shape[1:]), canon[1:], w.device)
    torch.add(head.view(-1, 1), off.view(1, -1), out=k0.view(rows, inner))
    del head, off
    torch.mul(k0, K1, out=k1)
    k0.mul_(K0)
    # ... and every later chunk's are the same advanced by rows·canon[0] indexes: one add each
    step = rows * canon[0]
    acc = torch.zeros(2, dtype=torch.int64, device=w.device)
    for r0 in range(0, n0, rows):
        m = min(rows, n0 - r0)
        if r0:
            k0.add_(_s64(step * (K0 & _M64)))
            k1.add_(_s64(step * (K1 & _M64)))
        acc += _fold(w[r0:r0 + m], k0[:m], k1[:m], scratch)
    return acc


def lanes_affine(words: torch.Tensor, first: int, strides: tuple[int, ...]) -> torch.Tensor:
    """Lane sums of an n-D block of words placed by an affine map (read one chunk at a time).

    Element (a0, …, ak) of `words` is canonical element first + Σ a_j·strides[j]; `first` and
    the strides may be any integers (negative and zero included) and wrap mod 2^64, as in
    `digest.linear.digest_affine`, whose bytes `lanes_bytes` of this gives.

    Args:
        words: a block of bit patterns of width 1, 2, 4 or 8 bytes, any device and strides.
        first: the canonical index of element (0, …, 0).
        strides: the canonical stride of each dim of `words`, in elements.

    Returns:
        int64[2] (S0, S1) on words.device, without a host sync.

    Raises:
        UsageError: if `strides` does not match words.ndim or the width is not 1/2/4/8.
    """
    if len(strides) != words.ndim:
        raise UsageError(f"lanes_affine: {len(strides)} strides for a {words.ndim}-D block")
    w = as_words(words)
    if w.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=w.device)
    shape, mem, canon = coalesce(tuple(w.shape), tuple(w.stride()),
                                  tuple(int(s) for s in strides))
    w = torch.as_strided(w, shape, mem)  # same memory (and offset), merged dims
    return _block(w, int(first) + 1, canon, _Scratch(w.device))


def lanes_run(words: torch.Tensor, first: int) -> torch.Tensor:
    """Lane sums of a 1-D run: element j is canonical index first + j.

    Args:
        words: a 1-D tensor of bit patterns of width 1, 2, 4 or 8 bytes, any device and stride.
        first: the canonical index of words[0].

    Returns:
        int64[2] (S0, S1) on words.device, without a host sync.

    Raises:
        UsageError: if `words` is not 1-D or its width is not 1/2/4/8.
    """
    if words.ndim != 1:
        raise UsageError(f"lanes_run: words must be 1-D, got shape {tuple(words.shape)}")
    return lanes_affine(words, first, (1,))


def _check_at(index: torch.Tensor, *words: torch.Tensor) -> None:
    shapes = [tuple(index.shape), *(tuple(x.shape) for x in words)]
    if index.ndim != 1 or len(set(shapes)) != 1:
        raise UsageError(f"index and words must be equal 1-D shapes, got {shapes}")
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise UsageError(f"index must be an integer tensor, got {index.dtype}")
    devices = {index.device, *(x.device for x in words)}
    if len(devices) != 1:
        raise UsageError(f"index and words must be on one device, got {sorted(map(str, devices))}")


def _lanes_at(index: torch.Tensor, groups: Sequence[torch.Tensor], first: int
              ) -> list[torch.Tensor]:
    """(S0, S1) of each of `groups` (words gathered at canonical positions first + index),
    the Weyl values computed once per chunk for all of them."""
    scratch = _Scratch(index.device)
    ws = [as_words(g) for g in groups]
    accs = [torch.zeros(2, dtype=torch.int64, device=index.device) for _ in groups]
    f1 = _s64(int(first) + 1)
    n = index.shape[0]
    for s in range(0, n, scratch.slice):
        m = min(scratch.slice, n - s)
        k0 = scratch.get("k0", (m,))
        k1 = scratch.get("k1", (m,))
        k0.copy_(index[s:s + m])
        k0.add_(f1)
        torch.mul(k0, K1, out=k1)
        k0.mul_(K0)
        for acc, w in zip(accs, ws, strict=True):
            acc += _fold(w[s:s + m], k0, k1, scratch)
    return accs


def lanes_at(words: torch.Tensor, index: torch.Tensor, first: int) -> torch.Tensor:
    """Σ_t mix(first + index[t], words[t]): lane sums of words already gathered at positions.

    Args:
        words: 1-D bit patterns (width 1, 2, 4 or 8 bytes), words[t] at canonical position
            first + index[t].
        index: 1-D integer tensor of words' length, on words' device.
        first: added to every index (wrapping mod 2^64).

    Returns:
        int64[2] (S0, S1) on words.device, without a host sync.

    Raises:
        UsageError: for unequal or non-1-D shapes, a non-integer index, two devices, or a
            width other than 1/2/4/8.
    """
    _check_at(index, words)
    return _lanes_at(index, [words], first)[0]


def lanes_change(index: torch.Tensor, old: torch.Tensor, new: torch.Tensor, first: int
                 ) -> torch.Tensor:
    """lanes_at(new) − lanes_at(old): an update's effect on the lanes (as
    `digest.linear.digest_change`).

    Args:
        index: 1-D integer tensor of the rewritten positions (canonical: first + index[t]).
        old: the words there before, gathered (index's shape and device).
        new: the words written there (index's shape and device).
        first: added to every index (wrapping mod 2^64).

    Returns:
        int64[2] (S0, S1) of the change, lane-wise mod 2^64, on index.device; no host sync.

    Raises:
        UsageError: for unequal or non-1-D shapes, a non-integer index, two devices, or a
            width other than 1/2/4/8.
    """
    _check_at(index, old, new)
    o, n = _lanes_at(index, [old, new], first)
    return n - o


def lanes_bytes(lanes: torch.Tensor) -> bytes:
    """The 16 digest bytes of lane sums (S0, S1), as `digest.sums.lanes_digest` (one copy to the
    host: the only synchronizing call of this module).

    Raises:
        UsageError: unless `lanes` is an int64 tensor of shape (2,).
    """
    if lanes.dtype != torch.int64 or tuple(lanes.shape) != (2,):
        raise UsageError(f"lanes must be int64[2], got {lanes.dtype}{list(lanes.shape)}")
    return lanes_digest(lanes.detach().cpu().numpy().view(np.uint64))


def tensor_digest(t: torch.Tensor) -> bytes:
    """The linear digest of a whole tensor's canonical (row-major) bits, on its own device.

    Equal to `digest.linear.tensor_digest(t.cpu())`, for any strides (a transposed or sliced
    view digests as its elements in row-major order, without a contiguous copy).

    Raises:
        UsageError: for a dtype weighthub does not carry (`tensors.dtype_of`).
    """
    dtype_of(t)
    return lanes_bytes(lanes_affine(t, 0, c_strides(tuple(t.shape))))


def digest_affine(words: torch.Tensor, first: int, strides: tuple[int, ...]) -> bytes:
    """The digest bytes of `lanes_affine(words, first, strides)` (see there)."""
    return lanes_bytes(lanes_affine(words, first, strides))


def digest_change(index: torch.Tensor, old: torch.Tensor, new: torch.Tensor, *,
                  first: int = 0) -> bytes:
    """The digest bytes of `lanes_change(index, old, new, first)` (see there)."""
    return lanes_bytes(lanes_change(index, old, new, first))
