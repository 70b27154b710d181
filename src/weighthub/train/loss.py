"""Token losses whose logits are built chunk by chunk: a large vocabulary's logits never all exist.

With a 128k vocabulary the logits of a 8×1024 batch are 8192×128256 values: 4.2 GB in fp32,
again for log-softmax and again for their gradient, more than the optimizer state LoGRA saves
on a 1B model. `chunked_token_loss` computes Σ w·(−log p(target)) over `chunk_tokens` tokens at a
time, each chunk under activation checkpointing, so the backward recomputes one chunk's logits
and at most one chunk's logits (and their gradient) are alive at any moment; what is kept for
the backward is the hidden states (tokens × hidden, already held by the model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..errors import UsageError


def chunked_token_loss(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor,
                       weights: torch.Tensor | None = None, *, chunk_tokens: int = 1024) -> torch.Tensor:
    """Σ_t w_t · (−log softmax(h_t·Wᵀ)[y_t]) (weights given) or the mean NLL (weights None).

    Args:
        hidden: (..., H) final hidden states at the positions that predict `targets`.
        head_weight: (V, H) output projection (lm_head / tied embedding).
        targets: (...) int64 token ids, the shape of `hidden` without its last dimension.
        weights: optional (...) per-token weights (e.g. advantage / token count for a
            policy-gradient loss); the loss is their weighted sum.
        chunk_tokens: tokens per chunk (memory ~ chunk_tokens × V × 12 bytes at a time).

    Logits are computed in the autocast dtype if autocast is on, and soft-maxed in fp32.

    Raises:
        UsageError: shapes that do not line up, or chunk_tokens < 1.
    """
    if chunk_tokens < 1:
        raise UsageError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.shape[:-1] != targets.shape or (weights is not None and weights.shape != targets.shape):
        raise UsageError(f"chunked_token_loss: hidden {tuple(hidden.shape)} must be targets "
                         f"{tuple(targets.shape)} + (hidden,), and weights "
                         f"{None if weights is None else tuple(weights.shape)} the shape of targets")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    w = None if weights is None else weights.reshape(-1)
    total = h.new_zeros((), dtype=torch.float32)
    for i in range(0, h.shape[0], chunk_tokens):
        wi = None if w is None else w[i:i + chunk_tokens]
        total = total + checkpoint(_chunk_nll, h[i:i + chunk_tokens], head_weight,
                                   y[i:i + chunk_tokens], wi, use_reentrant=False)
    return total if w is not None else total / max(1, h.shape[0])


def _chunk_nll(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor,
               w: torch.Tensor | None) -> torch.Tensor:
    nll = F.cross_entropy(F.linear(h, weight).float(), y, reduction="none")
    return nll.sum() if w is None else (nll * w).sum()


def causal_lm_loss(model: torch.nn.Module, input_ids: torch.Tensor, weights: torch.Tensor | None = None,
                   *, attention_mask: torch.Tensor | None = None,
                   chunk_tokens: int | None = 1024) -> torch.Tensor:
    """Next-token loss of a Hugging Face causal LM, logits chunked (`chunked_token_loss`).

    Args:
        model: a `*ForCausalLM` (has `get_decoder()` and `get_output_embeddings()`).
        input_ids: (B, T) tokens; position t predicts token t + 1.
        weights: optional (B, T − 1) weight of predicting token t + 1 at position t.
        chunk_tokens: tokens per logits chunk; None computes all logits at once (the plain loss).
    """
    kw = {} if attention_mask is None else {"attention_mask": attention_mask}
    hidden = model.get_decoder()(input_ids, **kw).last_hidden_state[:, :-1]  # type: ignore[operator]
    head = model.get_output_embeddings().weight  # type: ignore[operator]
    targets = input_ids[:, 1:]
    if chunk_tokens is None:
        nll = F.cross_entropy(F.linear(hidden, head).float().flatten(0, 1), targets.reshape(-1),
                              reduction="none")
        return nll.mean() if weights is None else (nll * weights.reshape(-1)).sum()
    return chunked_token_loss(hidden, head, targets, weights, chunk_tokens=chunk_tokens)
