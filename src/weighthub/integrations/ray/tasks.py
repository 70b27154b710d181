"""Verifiable tasks for the GRPO loop: prompts as token ids, rewards computed from the tokens.

    ArithmeticTask   "What is a + b?" for a chat model with a tokenizer (SmolLM2)
    TokenTask        a tokenizer-free task for tiny test models: reward the share of
                     completion tokens in the lower half of the vocabulary

Both are deterministic given their seed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ...errors import UsageError

_INT = re.compile(r"-?\d+")


class Task(Protocol):
    def prompts(self, step: int, count: int) -> list[tuple[list[int], Any]]:
        """`count` (token ids, answer) pairs for `step`."""
        ...

    def reward(self, answer: Any, completion: Sequence[int]) -> float: ...


class ArithmeticTask:
    """Sums of two integers below 20; reward 1 if the first integer in the completion is the
    sum, plus up to 0.2 for stopping early (groups all right or all wrong still differ)."""

    def __init__(self, tokenizer: Any, *, seed: int = 0, max_tokens: int = 16) -> None:
        self.tokenizer = tokenizer
        self.seed = seed
        self.max_tokens = max_tokens
        self.eos_id = int(tokenizer.eos_token_id)

    def prompts(self, step: int, count: int) -> list[tuple[list[int], Any]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        out = []
        for a, b in torch.randint(0, 20, (count, 2), generator=g).tolist():
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": f"What is {a} + {b}?"}],
                add_generation_prompt=True, tokenize=False) + f"{a} + {b} ="
            out.append((list(self.tokenizer(text)["input_ids"]), a + b))
        return out

    def reward(self, answer: Any, completion: Sequence[int]) -> float:
        text = self.tokenizer.decode([t for t in completion if t != self.eos_id],
                                     skip_special_tokens=True)
        nums = _INT.findall(text)
        finished = self.eos_id in completion
        brevity = 0.2 * finished * (1 - len(completion) / self.max_tokens)
        return float(bool(nums) and int(nums[0]) == answer) + brevity


class TokenTask:
    """Random prompts over a vocabulary; reward = share of completion tokens below vocab/2."""

    def __init__(self, vocab: int, *, seed: int = 0, prompt_len: int = 6) -> None:
        if vocab < 4 or prompt_len < 1:
            raise UsageError(f"TokenTask needs vocab ≥ 4 and prompt_len ≥ 1, got {vocab}, {prompt_len}")
        self.vocab, self.seed, self.prompt_len = vocab, seed, prompt_len
        self.eos_id = None

    def prompts(self, step: int, count: int) -> list[tuple[list[int], Any]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        ids = torch.randint(3, self.vocab, (count, self.prompt_len), generator=g).tolist()
        return [(p, None) for p in ids]

    def reward(self, answer: Any, completion: Sequence[int]) -> float:
        return sum(t < self.vocab // 2 for t in completion) / max(1, len(completion))
