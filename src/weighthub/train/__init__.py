"""LoGRA: low-rank gradient sketch optimizer with predicted-KL step control, and compact sync.

    LoGRA            torch optimizer: sketched 2-D weights (rank-r, seeded projections) + AdamW rest
    KLProbe          predicts (JVP quadratic) and measures the per-token KL a step causes
    encode_update    a recorded step as a compact payload (U, seed, epoch, coef per weight)
    CompactReceiver  fp32-master receiver that replays compact payloads bit-exactly (digest-checked)
    apply_low_rank   the fixed-order reconstruction both sides share (apply_low_rank_batch: batched)
    causal_lm_loss   next-token loss with chunked logits (chunked_token_loss): no full-vocab logits
"""

import torch

from .compact import CompactReceiver, encode_update, parse_update
from .kl import KLProbe, quadratic_kl, step_scale, token_kl
from .loss import causal_lm_loss, chunked_token_loss
from .optim import LoGRA, StepStats
from .projection import apply_low_rank, apply_low_rank_batch, rademacher
from .record import DenseRecord, SketchRecord, UpdateRecord

__all__ = [
    "CompactReceiver", "DenseRecord", "KLProbe", "LoGRA", "SketchRecord", "StepStats",
    "UpdateRecord", "apply_low_rank", "apply_low_rank_batch", "causal_lm_loss", "chunked_token_loss",
    "encode_update", "parse_update", "quadratic_kl", "rademacher", "step_scale", "token_kl",
]


def split_params(model: torch.nn.Module, *, sketch_embeddings: bool = False
                 ) -> tuple[list[tuple[str, torch.nn.Parameter]], list[tuple[str, torch.nn.Parameter]]]:
    """(sketched, dense) named-parameter lists: 2-D fp32 weights sketched, the rest dense.

    Embeddings (names containing 'embed' or 'lm_head') stay dense unless `sketch_embeddings`:
    sketched, a 128k×2048 embedding keeps rank-r state instead of AdamW's two fp32 moments and
    a held gradient (3 GB on Llama-3.2-1B, the largest part of what LoGRA still holds there).
    A tied embedding is one parameter (its gradient hook folds both uses).
    """
    sketched: list[tuple[str, torch.nn.Parameter]] = []
    dense: list[tuple[str, torch.nn.Parameter]] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_embed = "embed" in name or "lm_head" in name
        if p.dim() == 2 and p.dtype.is_floating_point and (sketch_embeddings or not is_embed):
            sketched.append((name, p))
        else:
            dense.append((name, p))
    return sketched, dense
