"""Seeded projections and the deterministic low-rank reconstruction shared by trainer and receivers.

A sketched weight W (m×n) is updated by ΔW = c · U · Pᵀ, with U (m×r) the sketch-space update and
P (n×r) a projection. Both the trainer (on its fp32 master weights) and every receiver that keeps
fp32 masters run *this* module's `apply_low_rank` with the same inputs, so their masters stay
bit-identical without ever sending a dense fp32 delta.

Why not `U @ P.T`: a BLAS matmul's summation order depends on the library, its blocking, the
thread count and the instruction set, so two machines (or one machine with a different thread
count) may round differently. `apply_low_rank` instead sums the r rank-1 terms one at a time in a
fixed order, using only elementwise IEEE-754 multiplies and adds (one rounding each, no fused
multiply-add across ops), which every CPU and GPU backend computes identically.

Why Rademacher (±1/√r) and numpy's PCG64: `torch.randn` on CPU uses vectorised transcendental
functions whose last bits may differ between instruction sets; PCG64's raw 64-bit output from a
`SeedSequence` is specified bit-for-bit and stable across platforms and numpy versions. Signs
need no transcendental function at all, and E[P·Pᵀ] = I, so U·Pᵀ is an unbiased decompression of
the gradient sketch G·P.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import xxhash

# elements per temporary of the reconstruction (it holds two, plus one chunk of Pᵀ). On a CPU,
# 2^18 (1 MiB): cache-resident, as fast as larger blocks. On CUDA, 2^22 (16 MiB): the pair stays
# in an H100/H200's L2 (50/60 MB) across the r rank-1 terms, while one chunk covers a whole
# 2048×2048 weight, so a Llama-1B step at rank 64 is ~0.97e9/2^22 × 2·64 ≈ 30k launches
# instead of ~470k with the 2^18 row blocks of one weight at a time.
_CPU_CHUNK = 1 << 18
_CUDA_CHUNK = 1 << 22


def chunk_elems(device: torch.device) -> int:
    """Elements per temporary `apply_low_rank_batch` uses on `device` (its memory bound: 3× this, fp32)."""
    return _CUDA_CHUNK if device.type == "cuda" else _CPU_CHUNK


def projection_key(seed: int, name: str, epoch: int) -> list[int]:
    """The SeedSequence entropy for tensor `name` in refresh epoch `epoch` (portable, stable)."""
    return [seed & 0xFFFFFFFFFFFFFFFF, xxhash.xxh3_64_intdigest(name.encode()), epoch]


def rademacher(seed: int, name: str, epoch: int, n: int, rank: int) -> torch.Tensor:
    """P (n×rank, fp32) with entries ±1/√rank from PCG64(SeedSequence(key)); bit-reproducible.

    Raises:
        ValueError: n or rank not positive (callers validate user input before this).
    """
    if n <= 0 or rank <= 0:
        raise ValueError(f"projection needs n > 0 and rank > 0, got n={n}, rank={rank}")
    bitgen = np.random.PCG64(np.random.SeedSequence(projection_key(seed, name, epoch)))
    words = bitgen.random_raw((n * rank + 63) // 64).astype("<u8")
    signs = np.unpackbits(words.view(np.uint8), bitorder="little")[: n * rank]
    scale = np.float32(1.0 / math.sqrt(rank))  # one correctly rounded double → fp32 cast
    p = (np.float32(1.0) - np.float32(2.0) * signs.astype(np.float32)) * scale
    return torch.from_numpy(np.ascontiguousarray(p.reshape(n, rank)))


def fp32(x: float) -> float:
    """Round a Python float to the nearest fp32 value (kept as a float that fp32 represents exactly).

    Scalars that enter `apply_low_rank` are pre-rounded so that whether a kernel computes in
    fp32 or in double, the product of two fp32 values rounds once to the same fp32 result.
    """
    return float(np.float32(x))


def scaled_update(u: torch.Tensor, coef: float) -> torch.Tensor:
    """fl(u·c) in fp32: the sketch-space update scaled by the step coefficient, rounded once."""
    return u.to(torch.float32).mul(fp32(coef))


@torch.no_grad()
def apply_low_rank(w: torch.Tensor, u: torch.Tensor, p: torch.Tensor, *, coef: float,
                   decay: float = 1.0) -> None:
    """In place: w ← w·decay + Σ_k (u[:, k]·coef) ⊗ p[:, k], summed in k order.

    Args:
        w: fp32 (m×n) master weight, contiguous; modified in place.
        u: (m×r) sketch-space update, any float dtype (cast to fp32 exactly: bf16 ⊂ fp32).
        p: (n×r) fp32 projection.
        coef: step coefficient (−α·lr); rounded to fp32 and folded into u first.
        decay: decoupled weight-decay factor (1 − α·lr·wd); rounded to fp32; 1.0 skips the multiply.

    Every operation is an elementwise fp32 multiply or add with one rounding, in a fixed order,
    so the result is the same on any machine, thread count or device (see the module docstring).
    This is `apply_low_rank_batch` for one weight: the trainer batches, receivers replay one
    tensor at a time, and both compute the same IEEE operations per element.
    """
    apply_low_rank_batch([w], scaled_update(u, coef)[None], p[None], decay=decay)


@torch.no_grad()
def apply_low_rank_batch(ws: Sequence[torch.Tensor], uc: torch.Tensor, p: torch.Tensor, *,
                         decay: float = 1.0, work: torch.Tensor | None = None) -> None:
    """In place, for each l: ws[l] ← ws[l]·decay + Σ_k uc[l, :, k] ⊗ p[l, :, k], k = 0, 1, … in order.

    Per element that is acc = fl(uc[i,0]·p[j,0]); acc = fl(acc + fl(uc[i,k]·p[j,k])) for
    k = 1..r−1; then w = fl(w·decay) (unless decay is 1) and w = fl(w + acc): the operations of
    `apply_low_rank`, batched over same-shape weights, so the bits do not depend on how the
    weights are grouped or chunked. Each mul and add is its own elementwise kernel: no matmul,
    addcmul or fused multiply-add, which would round differently.

    Args:
        ws: L fp32 (m×n) contiguous weights, modified in place.
        uc: (L×m×r) fp32, already scaled by the step coefficient (`scaled_update`).
        p: (L×n×r) fp32 projections.
        decay: fp32-representable weight-decay factor (rounded to fp32 here).
        work: optional preallocated fp32 workspace from `workspace_for` (then this function
            allocates no device memory: the optimizer's commit phase relies on that).

    Temporaries are bounded by `work` (default 3 × `chunk_elems(device)` fp32 elements): a chunk
    is several whole weights (k/v, q/o) or rows of one; the r terms run once per chunk.
    """
    if not ws:
        return
    n_layers, m, r = uc.shape
    n = p.shape[1]
    lc, rows = _chunking(m, n, r, chunk_elems(uc.device))
    work = workspace_for(m, n, r, uc.device) if work is None else work
    decay = fp32(decay)
    for l0 in range(0, n_layers, lc):
        l1 = min(n_layers, l0 + lc)
        pt = work[2, : (l1 - l0) * r * n].view(l1 - l0, r, n)
        pt.copy_(p[l0:l1].transpose(1, 2))  # rows of Pᵀ: contiguous operands for the terms
        for i0 in range(0, m, rows):
            i1 = min(m, i0 + rows)
            size = (l1 - l0) * (i1 - i0) * n
            a = work[0, :size].view(l1 - l0, i1 - i0, n)
            t = work[1, :size].view(l1 - l0, i1 - i0, n)
            torch.mul(uc[l0:l1, i0:i1, 0:1], pt[:, 0:1], out=a)
            for k in range(1, r):
                torch.mul(uc[l0:l1, i0:i1, k:k + 1], pt[:, k:k + 1], out=t)
                a.add_(t)  # alpha=1: a plain add, never a fused multiply-add
            blocks = [w[i0:i1] for w in ws[l0:l1]]
            if decay != 1.0:
                torch._foreach_mul_(blocks, decay)
            torch._foreach_add_(blocks, list(a.unbind(0)))


def _chunking(m: int, n: int, r: int, budget: int) -> tuple[int, int]:
    """(weights per chunk, rows per chunk) so that a chunk's temporaries fit `budget` elements."""
    if m * n <= budget:
        return max(1, budget // (m * n)), m
    return 1, max(1, budget // n)


def workspace_size(m: int, n: int, r: int, device: torch.device) -> int:
    """Elements per row of the (3×size) fp32 workspace `apply_low_rank_batch` needs for (m×n)
    weights at rank r on `device`: the two temporaries and one chunk of Pᵀ."""
    lc, rows = _chunking(m, n, r, chunk_elems(device))
    return lc * max(rows, r) * n


def workspace_for(m: int, n: int, r: int, device: torch.device) -> torch.Tensor:
    """A workspace for `apply_low_rank_batch` (see `workspace_size`)."""
    return torch.empty(3, workspace_size(m, n, r, device), dtype=torch.float32, device=device)
