"""Residual conversion: a receiver whose storage is not a bit copy of the canonical tensors.

`Fp8BlockTarget` serves fp8 (e4m3) weights with one fp32 scale per 128×128 block, the layout of
DeepSeek-V3's fp8 checkpoints (`weight` + `weight_scale_inv`). XOR/add deltas cannot pass
through a quantizer, so the canonical tensors are kept in an inner target (the mirror the
Receiver updates bit-exactly and verifies); at commit, only the blocks containing a changed
position are re-quantized from their new canonical values (an overwrite), the others are left
untouched. The result is bit-identical to `quantize_fp8_blocks` of the trainer's checkpoint of
that version, because every block is quantized by the same function from the same bits.

Which positions changed is found exactly by comparing the new canonical bits with a copy of the
previous ones (one compare pass over the converted tensors; the copy costs their size again).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import UsageError
from ..tensors import TensorSpec, Words
from .base import Held, Target, TargetWrapper, host_views

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def _blocks_of(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """(rows/bh, cols/bw, bh, bw) fp32 view of `w`, zero-padded to whole blocks."""
    bh, bw = block
    r, c = math.ceil(w.shape[0] / bh), math.ceil(w.shape[1] / bw)
    padded = torch.nn.functional.pad(w.float(), (0, c * bw - w.shape[1], 0, r * bh - w.shape[0]))
    return padded.reshape(r, bh, c, bw).permute(0, 2, 1, 3)


def _quantize(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize (..., bh, bw) fp32 blocks: scale = amax / 448 per block (zero blocks: 1)."""
    amax = blocks.abs().amax(dim=(-2, -1))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D float tensor from scratch: (fp8 weight of w's shape, fp32 scales per block).

    Dequantize with `q.float() * scale` broadcast over each block.
    """
    if w.ndim != 2 or not w.is_floating_point():
        raise UsageError(f"fp8 block quantization needs a 2-D float tensor, got {w.dtype}{list(w.shape)}")
    q, scale = _quantize(_blocks_of(w, block))
    return _unblock(q, w.shape), scale


def _unblock(q: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    r, c, bh, bw = q.shape
    return q.permute(0, 2, 1, 3).reshape(r * bh, c * bw)[: shape[0], : shape[1]].contiguous()


@dataclass(slots=True)
class ConversionReport:
    """Blocks re-quantized by the last commit, out of all blocks of the converted tensors."""

    blocks: int = 0
    requantized: int = 0
    per_tensor: dict[str, int] = field(default_factory=dict)


def _default_select(spec: TensorSpec) -> bool:
    return len(spec.shape) == 2 and spec.dtype.is_float and spec.dtype.width >= 2


class Fp8BlockTarget(TargetWrapper):
    """Wraps a canonical target; keeps fp8 block-quantized copies of its 2-D float tensors.

    Args:
        inner: the canonical mirror the Receiver applies into (e.g. a StateDictTarget).
        block: block shape (rows, cols).
        select: which canonical tensors are served quantized (default: 2-D float tensors).

    `weight(name)` is (fp8 tensor of the canonical shape, fp32 scales per block) once a version
    has been committed; `report` says how many blocks the last commit re-quantized.
    """

    def __init__(self, inner: Target, *, block: tuple[int, int] = (128, 128),
                 select: Callable[[TensorSpec], bool] = _default_select) -> None:
        if len(block) != 2 or min(block) < 1:
            raise UsageError(f"block={block}: need two positive sizes")
        super().__init__(inner)
        self.block = block
        self.select = select
        # fp8 bits as zero-padded blocks (rows/bh, cols/bw, bh, bw), and fp32 scales per block
        self._blocks: dict[str, tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]] = {}
        self.report = ConversionReport()
        self._prev: dict[str, np.ndarray] = {}  # canonical bits the weights were made from

    def open(self, specs: list[TensorSpec]) -> Mapping[str, Words]:
        views = self.inner.open(specs)
        try:
            return host_views(views, "Fp8BlockTarget's re-quantization")
        except UsageError:
            self.inner.abort()
            raise

    def commit(self, held: Held) -> None:
        """Re-quantize the changed blocks (computed first), commit the inner, then install."""
        views = host_views(self.inner.peek(), "Fp8BlockTarget's re-quantization")
        specs = [s for s in self.inner.specs() or [] if self.select(s)]
        updates = {s.name: self._convert(s, views[s.name]) for s in specs}
        self.inner.commit(held)
        report = ConversionReport()
        for spec in specs:
            idx, q, scale, total = updates[spec.name]
            report.blocks += total
            report.requantized += len(idx)
            report.per_tensor[spec.name] = len(idx)
            self._install(spec, idx, q, scale)
            prev = self._prev.setdefault(spec.name, np.empty_like(views[spec.name]))
            np.copyto(prev, views[spec.name])
        self.report = report

    # abort: the inner's alone (TargetWrapper); nothing of ours changes before commit

    def _convert(self, spec: TensorSpec, new_bits: np.ndarray
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(block indices (n, 2), their fp8 blocks, their scales, total blocks) to re-quantize."""
        w = torch.from_numpy(new_bits.view(_SIGNED[spec.dtype.width])).view(
            spec.dtype.torch_dtype).reshape(spec.shape)
        blocks = _blocks_of(w, self.block)
        r, c = blocks.shape[:2]
        prev = self._prev.get(spec.name)
        if prev is None or spec.name not in self._blocks:
            changed = torch.ones((r, c), dtype=torch.bool)
        else:
            diff = torch.from_numpy(new_bits != prev).reshape(spec.shape)
            changed = _blocks_of(diff, self.block).amax(dim=(-2, -1)) > 0
        idx = changed.nonzero()
        q, scale = _quantize(blocks[idx[:, 0], idx[:, 1]])
        return idx, q, scale, r * c

    def _install(self, spec: TensorSpec, idx: torch.Tensor, q: torch.Tensor,
                 scale: torch.Tensor) -> None:
        if spec.name not in self._blocks:
            r, c = math.ceil(spec.shape[0] / self.block[0]), math.ceil(spec.shape[1] / self.block[1])
            self._blocks[spec.name] = (torch.zeros((r, c, *self.block), dtype=torch.uint8),
                                       torch.empty((r, c), dtype=torch.float32), spec.shape)
        blocks, scales, _shape = self._blocks[spec.name]
        blocks[idx[:, 0], idx[:, 1]] = q.view(torch.uint8)
        scales[idx[:, 0], idx[:, 1]] = scale

    def weight(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp8 weight in the canonical shape, fp32 scale per block) of a converted tensor."""
        if name not in self._blocks:
            raise UsageError(f"{name!r} is not a converted tensor of a committed version; "
                             f"converted: {sorted(self._blocks)[:5]}")
        blocks, scales, shape = self._blocks[name]
        return _unblock(blocks.view(torch.float8_e4m3fn), shape), scales.clone()
