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

import numpy as np
import torch
import xxhash

# elements per row block of the reconstruction: ~1 MiB of fp32 temporaries, cache-resident
_BLOCK_ELEMS = 1 << 18


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


@torch.no_grad()
def apply_low_rank(w: torch.Tensor, u: torch.Tensor, p: torch.Tensor, *, coef: float,
                   decay: float = 1.0) -> None:
    """In place: w ← w·decay + Σ_k (u[:, k]·coef) ⊗ p[:, k], summed in k order, row block by row block.

    Args:
        w: fp32 (m×n) master weight, contiguous; modified in place.
        u: (m×r) sketch-space update, any float dtype (cast to fp32 exactly: bf16 ⊂ fp32).
        p: (n×r) fp32 projection.
        coef: step coefficient (−α·lr); rounded to fp32 and folded into u first.
        decay: decoupled weight-decay factor (1 − α·lr·wd); rounded to fp32; 1.0 skips the multiply.

    Every operation is an elementwise fp32 multiply or add with one rounding, in a fixed order,
    so the result is the same on any machine, thread count or device (see the module docstring).
    """
    m, n = w.shape
    r = u.shape[1]
    uc = u.to(torch.float32).mul(fp32(coef))  # fl(u·c): the scaled sketch, rounded once
    pt = p.t().contiguous()  # rows of Pᵀ: contiguous operands for the rank-1 terms
    decay = fp32(decay)
    rows = max(1, _BLOCK_ELEMS // max(n, 1))
    acc = torch.empty(min(rows, m), n, dtype=torch.float32, device=w.device)
    tmp = torch.empty_like(acc)
    for i0 in range(0, m, rows):
        i1 = min(m, i0 + rows)
        a, t = acc[: i1 - i0], tmp[: i1 - i0]
        torch.mul(uc[i0:i1, 0:1], pt[0:1], out=a)
        for k in range(1, r):
            torch.mul(uc[i0:i1, k:k + 1], pt[k:k + 1], out=t)
            a.add_(t)  # alpha=1: a plain add, never a fused multiply-add
        blk = w[i0:i1]
        if decay != 1.0:
            blk.mul_(decay)
        blk.add_(a)
