"""LoGRA's argument checks: each refusal names the setting or parameter and what to do instead."""

from __future__ import annotations

import math

import torch

from ..errors import UsageError


def check_one_device(named: list[tuple[str, torch.nn.Parameter]]) -> None:
    """UsageError unless every parameter is on one device (the state is stacked per shape and
    the step's check and kernels run on one device; model-parallel sharding is not supported)."""
    by_dev: dict[torch.device, list[str]] = {}
    for name, p in named:
        by_dev.setdefault(p.device, []).append(name)
    if len(by_dev) > 1:
        where = "; ".join(f"{dev}: {len(ns)} parameter(s), e.g. {ns[:3]}" for dev, ns in by_dev.items())
        raise UsageError(f"LoGRA needs every parameter on one device, got {len(by_dev)} devices "
                         f"({where}); move the model to one device (model.to('cuda:0')), or run one "
                         "LoGRA per device over that device's parameters")


def check_settings(rank: int, lr: float, betas: tuple[float, float], eps: float, wd: float,
                    refresh_every: int, kl_target: float | None, update_dtype: torch.dtype) -> None:
    if not isinstance(rank, int) or rank < 1:
        raise UsageError(f"rank must be an integer >= 1, got {rank!r}")
    if not (lr > 0 and math.isfinite(lr)):
        raise UsageError(f"lr must be finite and > 0, got {lr}")
    if not all(0.0 <= b < 1.0 for b in betas) or eps <= 0 or wd < 0 or refresh_every < 0:
        raise UsageError(f"need 0 <= betas < 1, eps > 0, weight_decay >= 0, refresh_every >= 0; "
                         f"got betas={betas}, eps={eps}, weight_decay={wd}, refresh_every={refresh_every}")
    if kl_target is not None and not (kl_target > 0 and math.isfinite(kl_target)):
        raise UsageError(f"kl_target must be a finite KL > 0 (nats per token), got {kl_target}; "
                         "use None to turn step control off")
    if update_dtype not in (torch.float32, torch.bfloat16):
        raise UsageError(f"update_dtype must be torch.float32 or torch.bfloat16, got {update_dtype}")


def check_sketchable(name: str, p: torch.Tensor, rank: int) -> None:
    if p.dim() != 2:
        raise UsageError(f"sketched parameter '{name}' has shape {tuple(p.shape)}: only 2-D weights "
                         "can be sketched; pass it in the dense group")
    if p.dtype != torch.float32:
        raise UsageError(f"sketched parameter '{name}' is {p.dtype}: LoGRA updates fp32 master "
                         "weights; keep the master in fp32 and cast for inference")
    if rank > min(p.shape):
        raise UsageError(f"rank {rank} exceeds min(m, n) = {min(p.shape)} of '{name}' "
                         f"{tuple(p.shape)}: lower the rank or put '{name}' in the dense group")
