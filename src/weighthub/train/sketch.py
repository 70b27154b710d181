"""The sketched group's state, stacked by weight shape: one tensor op per shape, not per weight.

A Llama decoder has four shapes of 2-D weights (q/o, k/v, gate/up, down): a `Bucket` holds
the L same-shape weights' accumulators S (L×m×r), first moments M (L×m×r), row second moments
V (L×m) and projections P (L×n×r) as one tensor each, so a step's moment update is a handful of
kernels for the whole bucket and the reconstruction (`projection.apply_low_rank_batch`) runs its
r rank-1 terms once per chunk of several weights. Each weight's `optimizer.state[p]` entries are
views into these tensors (the gradient hook folds into its own slice).

The step is split in two for the optimizer's all-or-nothing contract (`optim`): `prepare`
allocates everything the step needs and mutates nothing; `commit` only writes into memory that
already exists (no device allocation, so no out-of-memory error half way through a step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .projection import apply_low_rank_batch, rademacher, workspace_size


class Bucket:
    """L same-shape (m×n) fp32 weights sketched at rank r, with their stacked state."""

    def __init__(self, names: list[str], params: list[torch.nn.Parameter], rank: int, seed: int) -> None:
        m, n = params[0].shape
        dev = params[0].device
        self.names, self.params, self.rank, self.seed = names, params, rank, seed
        self.P = torch.empty(len(params), n, rank, device=dev)
        self.S = torch.zeros(len(params), m, rank, device=dev)
        self.M = torch.zeros(len(params), m, rank, device=dev)
        self.V = torch.zeros(len(params), m, device=dev)
        self.draw(0)

    def draw(self, epoch: int) -> None:
        """Fill P with the projections of refresh epoch `epoch`, in place (host → device copy)."""
        for i, name in enumerate(self.names):
            self.P[i].copy_(rademacher(self.seed, name, epoch, self.P.shape[1], self.rank))

    def nonfinite(self) -> list[str]:
        """Names of the weights whose sketch holds a NaN or inf (syncs: only after a failed check)."""
        bad = (~torch.isfinite(self.S)).flatten(1).any(1).tolist()
        return [n for n, b in zip(self.names, bad, strict=True) if b]

    def prepare(self, b1: float, b2: float, eps: float, m_t: int, v_t: int,
                update_dtype: torch.dtype) -> Prepared:
        """The new moments and the update U of every weight, out of place (state untouched).

        The per-element operations are those of an unbatched Adam-in-sketch-space step:
        M' = M·β1 + (1−β1)·S, V' = V·β2 + (1−β2)·mean_k S², U = (M'/bc1) / (√(V'/bc2) + ε).
        """
        m_new = torch.mul(self.M, b1).add_(self.S, alpha=1 - b1)
        v_new = torch.mul(self.V, b2).add_(self.S.square().mean(dim=-1), alpha=1 - b2)
        denom = (v_new / (1 - b2 ** v_t)).sqrt_().add_(eps)
        u = (m_new / (1 - b1 ** m_t)) / denom[..., None]
        # what is applied and sent (bf16 halves compact payloads); uc and work come once α is known
        return Prepared(m_new, v_new, u.to(update_dtype))

    def tangent_update(self, prep: Prepared, i: int) -> torch.Tensor:
        """Weight i's dense update direction U·Pᵀ at α = 1, before lr and decay (for the KL probe)."""
        return prep.u.to(torch.float32)[i] @ self.P[i].t()

    def commit(self, prep: Prepared, decay: float) -> None:
        """Write the prepared moments and apply the update to the weights (allocates nothing)."""
        assert prep.uc is not None and prep.work is not None, "set by the optimizer's prepare"
        self.M.copy_(prep.m)
        self.V.copy_(prep.v)
        apply_low_rank_batch([p.data for p in self.params], prep.uc, self.P, decay=decay,
                             work=prep.work)


@dataclass(slots=True)
class Prepared:
    """One bucket's step, computed but not applied."""

    m: torch.Tensor  # new first moments (L×m×r)
    v: torch.Tensor  # new row second moments (L×m)
    u: torch.Tensor  # the update in the optimizer's update dtype (L×m×r): recorded and sent
    uc: torch.Tensor | None = None  # fl(u·coef) in fp32: what the reconstruction adds
    work: torch.Tensor | None = None  # the reconstruction's workspace


def workspace(bks: list[Bucket]) -> torch.Tensor:
    """One workspace large enough for every bucket's reconstruction (they run one at a time)."""
    sizes = [workspace_size(bk.S.shape[1], bk.P.shape[1], bk.rank, bk.P.device) for bk in bks]
    return torch.empty(3, max(sizes, default=0), dtype=torch.float32,
                       device=bks[0].P.device if bks else None)


def buckets(named: list[tuple[str, torch.nn.Parameter]], rank: int, seed: int) -> list[Bucket]:
    """Group sketched weights by shape, in first-appearance order (weights keep their order)."""
    by_shape: dict[tuple[int, ...], list[tuple[str, torch.nn.Parameter]]] = {}
    for name, p in named:
        by_shape.setdefault(tuple(p.shape), []).append((name, p))
    return [Bucket([n for n, _ in g], [p for _, p in g], rank, seed) for g in by_shape.values()]
