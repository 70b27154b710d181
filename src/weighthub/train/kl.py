"""Predicted-KL step control: how far will a proposed update move the policy, before applying it?

For a proposed parameter step θ → θ + α·d, the per-token logits move by α·δ + O(α²), where
δ = J·d is the Jacobian-vector product of the logits along d (one forward-mode pass,
`torch.func.jvp`; no dense Jacobian). To second order,

    KL(p_θ ‖ p_{θ+αd}) ≈ ½ α² Σ_v p_v (δ_v − E_p[δ])²        (Fisher of a softmax in logit space)

averaged over the probe's scored tokens. The step scale is α = min(1, √(target / KL̂(1))).
After the step is applied, the realized KL is measured exactly with one more forward pass.

The JVP needs the tangent (the dense update direction) of the parameters it covers; `chunks`
splits the parameters into groups, one JVP each, so the dense tangents held at any moment are
those of one group (δ is linear in d, so the per-group δ's add up).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch.func import functional_call, jvp
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import UsageError

# one proposed direction: (parameter name as the module names it, a function building its tangent)
Direction = tuple[str, Callable[[], torch.Tensor]]


class KLProbe:
    """A small fixed batch on which the policy's movement is predicted and measured.

    Args:
        model: the policy (an `nn.Module` whose output has `.logits`, or is the logits).
        input_ids: (batch, seq) token ids of prompts + completions.
        attention_mask: optional (batch, seq) mask passed to the model.
        token_mask: which positions' next-token distributions count (e.g. completion tokens);
            default: every position the attention mask keeps.
        chunks: JVP passes per prediction (bounds the dense tangents held at once).

    Raises:
        UsageError: mismatched shapes, an empty token mask or chunks < 1.
    """

    def __init__(self, model: torch.nn.Module, input_ids: torch.Tensor, *,
                 attention_mask: torch.Tensor | None = None, token_mask: torch.Tensor | None = None,
                 chunks: int = 1) -> None:
        if input_ids.dim() != 2:
            raise UsageError(f"KLProbe needs (batch, seq) input_ids, got shape {tuple(input_ids.shape)}")
        if chunks < 1:
            raise UsageError(f"KLProbe chunks must be >= 1, got {chunks}")
        mask = token_mask if token_mask is not None else attention_mask
        mask = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
        if mask.shape != input_ids.shape:
            raise UsageError(f"KLProbe token_mask shape {tuple(mask.shape)} != input_ids shape "
                             f"{tuple(input_ids.shape)}")
        if not bool(mask.any()):
            raise UsageError("KLProbe token_mask selects no token: nothing to measure KL on")
        self.model = model
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.mask = mask
        self.chunks = chunks

    def _kwargs(self) -> dict[str, torch.Tensor]:
        return {} if self.attention_mask is None else {"attention_mask": self.attention_mask}

    @staticmethod
    def _logits(out: object) -> torch.Tensor:
        return out.logits if hasattr(out, "logits") else out  # type: ignore[return-value]

    @torch.no_grad()
    def logits(self) -> torch.Tensor:
        """The policy's fp32 logits on the probe batch, now."""
        # same kernel as the JVP pass: comparable numbers
        with sdpa_kernel(SDPBackend.MATH), _eval_mode(self.model):
            return self._logits(self.model(self.input_ids, **self._kwargs())).float()

    @torch.no_grad()
    def predict(self, directions: Sequence[Direction]) -> tuple[float, torch.Tensor]:
        """(predicted KL at α = 1, logits before the step) for the update Σ directions.

        Raises:
            UsageError: a direction names a parameter the model does not have.
        """
        params = dict(self.model.named_parameters())
        unknown = [n for n, _ in directions if n not in params]
        if unknown:
            raise UsageError(f"KL prediction: the model has no parameter(s) {unknown[:3]}")
        if not directions:
            return 0.0, self.logits()
        ids, kw = self.input_ids, self._kwargs()

        def run(ps: dict[str, torch.Tensor]) -> torch.Tensor:
            return self._logits(functional_call(self.model, ps, (ids,), kw)).float()

        size = -(-len(directions) // self.chunks)
        base: torch.Tensor | None = None
        delta: torch.Tensor | None = None
        # forward-mode AD has no flash/efficient SDPA kernel on CPU; the math kernel is composite
        with sdpa_kernel(SDPBackend.MATH), _eval_mode(self.model):
            for i in range(0, len(directions), size):
                group = directions[i:i + size]
                primals = {n: params[n].detach() for n, _ in group}
                tangents = {n: make() for n, make in group}
                out, d = jvp(run, (primals,), (tangents,))[:2]
                del tangents
                base = out if base is None else base
                delta = d if delta is None else delta.add_(d)
        assert base is not None and delta is not None  # directions is non-empty
        return quadratic_kl(base, delta, self.mask), base

    @torch.no_grad()
    def realized(self, before: torch.Tensor) -> float:
        """Exact mean per-token KL(p_before ‖ p_now) on the probe's scored tokens."""
        return token_kl(before, self.logits(), self.mask)


@contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """The probe's passes in eval mode, then each module's own mode back: the policy's
    distribution without dropout, and no gradient checkpointing inside the JVP (a training-mode
    Hugging Face model checkpoints its layers, which forward-mode AD cannot trace)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def quadratic_kl(logits: torch.Tensor, delta: torch.Tensor, mask: torch.Tensor) -> float:
    """½ Σ_v p_v (δ_v − E_p δ)², mean over masked tokens (the Fisher quadratic form in logit space)."""
    p = torch.softmax(logits, dim=-1)
    centred = delta - (p * delta).sum(-1, keepdim=True)
    per_token = 0.5 * (p * centred.square()).sum(-1)
    return float(per_token[mask].mean())


def token_kl(before: torch.Tensor, after: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over masked tokens of KL(softmax(before) ‖ softmax(after))."""
    lp, lq = torch.log_softmax(before, -1), torch.log_softmax(after, -1)
    per_token = (lp.exp() * (lp - lq)).sum(-1)
    return float(per_token[mask].mean())


def step_scale(predicted_full: float, target: float | None) -> float:
    """α = min(1, √(target / KL̂(α=1))): KL̂ grows as α², so this puts the prediction at the target."""
    if target is None or predicted_full <= target:
        return 1.0
    return (target / predicted_full) ** 0.5
