"""AdamW for LoGRA's dense group (norms, biases, embeddings it does not sketch), with foreach ops.

Receivers get the dense group's new values as they are (`DenseRecord`), so this step need not be
replayable elsewhere; it is deterministic on the trainer (the same elementwise operations as a
per-parameter AdamW, batched by `torch._foreach_*`: one multi-tensor kernel per operation on
CUDA, instead of ~10 kernels per parameter launched from Python).

Like `sketch.Bucket` it splits a step into `prepare` (allocates, mutates nothing) and `commit`
(writes only into existing memory). The direction d = m̂/(√v̂ + ε) is built in the gradients'
own buffers at commit (they are dropped right after the step), so the dense group needs one
extra dense-sized buffer (the denominator) at step time, not two (direction + denominator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class DensePrepared:
    """The dense parameters that have a gradient this step, and the step's buffers."""

    params: list[torch.nn.Parameter]
    grads: list[torch.Tensor]
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]
    steps: list[int]  # each parameter's step count after this step
    denom: list[torch.Tensor]  # preallocated: the commit's √v̂ + ε


class DenseAdamW:
    """Decoupled-weight-decay Adam over a list of parameters; state in `state[p]`.

    Args:
        state: the optimizer's per-parameter state dict (exp_avg, exp_avg_sq, t).
        state_dtype: dtype of the two moments (torch.bfloat16 halves them; the arithmetic of
            each op runs in fp32 and rounds to bf16).
    """

    def __init__(self, params: list[torch.nn.Parameter], state: dict[torch.Tensor, dict[str, Any]],
                 state_dtype: torch.dtype) -> None:
        self.params, self.state, self.state_dtype = params, state, state_dtype

    def prepare(self) -> DensePrepared:
        """Gather this step's parameters and allocate its buffers (the state is not changed;
        first-step moments are created here and installed by `commit`)."""
        ps = [p for p in self.params if p.grad is not None]
        ea, sq, steps = [], [], []
        for p in ps:
            st = self.state[p]
            if "exp_avg" in st:
                ea.append(st["exp_avg"])
                sq.append(st["exp_avg_sq"])
                steps.append(st["t"] + 1)
            else:
                ea.append(torch.zeros_like(p, dtype=self.state_dtype))
                sq.append(torch.zeros_like(p, dtype=self.state_dtype))
                steps.append(1)
        grads: list[torch.Tensor] = [p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype)  # type: ignore[misc,union-attr]
                                     for p in ps]
        denom = [torch.empty_like(p) for p in ps]
        return DensePrepared(ps, grads, ea, sq, steps, denom)

    def tangent(self, prep: DensePrepared, i: int, b1: float, b2: float, eps: float) -> torch.Tensor:
        """Parameter i's direction d out of place, from the state before the step (KL probe)."""
        g, t = prep.grads[i].float(), prep.steps[i]
        m = prep.exp_avg[i].float().mul(b1).add_(g, alpha=1 - b1)
        v = prep.exp_avg_sq[i].float().mul(b2).addcmul_(g, g, value=1 - b2)
        return (m / (1 - b1 ** t)) / (v / (1 - b2 ** t)).sqrt_().add_(eps)

    def commit(self, prep: DensePrepared, b1: float, b2: float, eps: float, coef: float,
               decay: float) -> None:
        """Advance the moments, build d in the gradient buffers and apply p ← p·decay + coef·d."""
        if not prep.params:
            return
        g, ea, sq = prep.grads, prep.exp_avg, prep.exp_avg_sq
        torch._foreach_mul_(ea, b1)
        torch._foreach_add_(ea, g, alpha=1 - b1)
        torch._foreach_mul_(sq, b2)
        torch._foreach_addcmul_(sq, g, g, value=1 - b2)
        for p, a, s, t in zip(prep.params, ea, sq, prep.steps, strict=True):
            st = self.state[p]
            st["exp_avg"], st["exp_avg_sq"], st["t"] = a, s, t
        torch._foreach_copy_(g, ea)  # from here on g holds the direction, not the gradient
        torch._foreach_div_(g, [1 - b1 ** t for t in prep.steps])
        torch._foreach_copy_(prep.denom, sq)
        torch._foreach_div_(prep.denom, [1 - b2 ** t for t in prep.steps])
        torch._foreach_sqrt_(prep.denom)
        torch._foreach_add_(prep.denom, eps)
        torch._foreach_div_(g, prep.denom)
        params = [p.data for p in prep.params]
        if decay != 1.0:
            torch._foreach_mul_(params, decay)
        torch._foreach_mul_(g, coef)
        torch._foreach_add_(params, g)
