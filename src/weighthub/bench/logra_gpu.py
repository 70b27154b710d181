"""`weighthub bench logra --gpu`: LoGRA vs fused AdamW training steps on Llama-shaped models (#14).

Random-init Llama models (Llama-3.2-1B shapes by default: hidden 2048, 16 layers, 32 heads,
8 kv heads, intermediate 8192, vocab 128256, tied embeddings; fp32 masters, bf16 autocast,
gradient checkpointing) train on a fixed random batch with a policy-gradient-style weighted
token loss. Per configuration, in a fresh model from the same seed:

- peak memory of whole training steps: weights + activations + gradients + optimizer state
  (CUDA: `torch.cuda.max_memory_allocated` after a reset, minus what was allocated before the
  model was built; CPU: the process's peak RSS over its RSS before, an approximation);
- step time: median of the timed steps (forward + backward + step, CUDA-synchronized), and
  for LoGRA also with the KL probe;
- predicted vs realized KL of the probed LoGRA steps (AdamW: realized only);

then the largest layer count (and parameters) that fits a memory budget with AdamW and with
LoGRA, fitted linearly on two small layer counts and checked by running the prediction.
Without CUDA (or with --device cpu) it runs a small model in fp32 and a small budget and says
so: CPU figures show the code works and how its parts compare there, not what a GPU does.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..errors import UsageError
from ..train import KLProbe, LoGRA, causal_lm_loss, split_params
from ..train.kl import token_kl


@dataclass(frozen=True, slots=True)
class Shape:
    """A Llama-shaped model and its training batch."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    batch: int
    seq: int


LLAMA_1B = Shape(2048, 16, 32, 8, 8192, 128256, 8, 1024)
CPU_SMALL = Shape(512, 2, 8, 4, 1408, 8192, 2, 128)  # k/v are 256×512: rank 256 fits
TINY = Shape(64, 2, 4, 2, 128, 512, 2, 32)  # the test's smoke size


@dataclass(frozen=True, slots=True)
class Config:
    """One optimizer setting to measure."""

    optimizer: str  # "adamw" | "logra"
    rank: int = 0
    sketch_embeddings: bool = True
    dense_bf16: bool = False
    chunked_loss: bool = True

    @property
    def label(self) -> str:
        if self.optimizer == "adamw":
            return "adamw fused" + (" chunked-loss" if self.chunked_loss else "")
        return (f"logra r{self.rank}" + (" emb-sketched" if self.sketch_embeddings else " emb-dense")
                + (" dense-bf16" if self.dense_bf16 else "") + (" chunked-loss" if self.chunked_loss else ""))


def configs(ranks: tuple[int, ...]) -> list[Config]:
    """AdamW with and without chunked logits; LoGRA at each rank; the memory options at one rank."""
    mid = ranks[len(ranks) // 2]
    out = [Config("adamw", chunked_loss=False), Config("adamw")]
    out += [Config("logra", r) for r in ranks]
    out += [Config("logra", mid, sketch_embeddings=False), Config("logra", mid, False, True),
            Config("logra", mid, chunked_loss=False)]
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `weighthub bench logra`."""
    p.add_argument("--gpu", action="store_true",
                   help="training-step memory/speed/KL on Llama shapes (CPU fallback without CUDA)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto (default): CUDA when available, else the CPU variant")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: 16 GPU, 2 CPU)")
    p.add_argument("--ranks", default="16,64,256", metavar="R,R", help="LoGRA ranks (default 16,64,256)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration (default 5)")
    p.add_argument("--budget-gb", type=float, default=None,
                   help="memory budget of the capacity search (default 40 GPU, 0.5 CPU; 0: skip)")
    p.add_argument("--tiny", action="store_true", help="a smoke-test size (seconds on a CPU)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every figure here")
    p.set_defaults(func=cmd_logra)


def cmd_logra(args: argparse.Namespace) -> int:
    if not args.gpu:
        raise UsageError("bench logra: pass --gpu for the training-step benchmark (memory, step "
                         "time, KL on Llama shapes); the learning comparison is `weighthub bench --logra`")
    out = Path(args.json).expanduser() if args.json else None
    if out is not None and (out.is_dir() or not out.parent.is_dir()):
        raise UsageError(f"--json {out}: give a file path in an existing directory")
    try:
        ranks = tuple(int(r) for r in args.ranks.split(",") if r.strip())
    except ValueError:
        ranks = ()
    if not ranks or min(ranks) < 1 or args.steps < 1:
        raise UsageError(f"--ranks {args.ranks!r} must be positive integers and --steps >= 1")
    doc = run(ranks=ranks, steps=args.steps, device=args.device, layers=args.layers,
              budget_gb=args.budget_gb, tiny=args.tiny)
    print(render(doc))
    if out is not None:
        out.write_text(json.dumps(doc, indent=1))
        print(f"wrote {out}", file=sys.stderr)
    return 0


def run(*, ranks: tuple[int, ...] = (16, 64, 256), steps: int = 5, device: str = "auto",
        layers: int | None = None, budget_gb: float | None = None, tiny: bool = False) -> dict[str, Any]:
    """Measure every configuration, then the capacity search; returns the JSON document."""
    cuda = torch.cuda.is_available() and device != "cpu"
    if device == "cuda" and not cuda:
        raise UsageError("bench logra --device cuda: no CUDA device is available")
    dev = torch.device("cuda" if cuda else "cpu")
    shape = TINY if tiny else (LLAMA_1B if cuda else CPU_SMALL)
    shape = replace(shape, layers=layers or shape.layers)
    smallest = min(shape.hidden, shape.hidden // shape.heads * shape.kv_heads)
    if max(ranks) > smallest:
        raise UsageError(f"bench logra: rank {max(ranks)} exceeds {smallest}, the smallest weight "
                         f"dimension of this shape (k/v projections); lower --ranks")
    budget = budget_gb if budget_gb is not None else (40.0 if cuda else (0.1 if tiny else 0.5))
    note = None if cuda else ("no CUDA: a small CPU model in fp32 (no bf16 autocast), peak memory "
                              "from RSS; these are not GPU figures (run on a GPU for the issue's numbers)")
    if note:
        print(f"bench logra: {note}", file=sys.stderr)
    doc: dict[str, Any] = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu",
                           "note": note, "shape": asdict(shape), "params": _params(shape),
                           "steps": steps, "torch": torch.__version__, "runs": []}
    for cfg in configs(ranks):
        print(f"bench logra: {cfg.label}", file=sys.stderr, flush=True)
        doc["runs"].append(measure(shape, cfg, dev, steps, warmup=0 if tiny else 2,
                                   probe_steps=1 if tiny else 3))
    _compare(doc)
    if budget > 0:
        doc["capacity"] = capacity(shape, budget, ranks[len(ranks) // 2], dev,
                                   max_layers=4 if tiny else (256 if cuda else 32))
    return doc


def _params(s: Shape) -> int:
    kv = s.hidden // s.heads * s.kv_heads
    layer = 2 * s.hidden * s.hidden + 2 * s.hidden * kv + 3 * s.hidden * s.intermediate + 2 * s.hidden
    return s.layers * layer + s.vocab * s.hidden + s.hidden


def _model(s: Shape, dev: torch.device) -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                                   num_hidden_layers=s.layers, num_attention_heads=s.heads,
                                   num_key_value_heads=s.kv_heads, max_position_embeddings=max(s.seq, 128),
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    with dev:  # initialise on the device: seconds instead of minutes for 1B on a CPU
        model = transformers.LlamaForCausalLM(cfg).float()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # its input-embedding hook (output.requires_grad_(), for frozen embeddings under reentrant
    # checkpointing) breaks the KL probe's JVP; trained embeddings make it pointless anyway
    model.disable_input_require_grads()
    model.train()
    return model


class _Meter:
    """Peak memory beyond what was allocated at start (CUDA allocator, or RSS on a CPU)."""

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
            self.base = torch.cuda.memory_allocated(dev)
        else:
            with contextlib.suppress(OSError):  # freed heap back to the OS: last run's memory uncounted
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            self.base = _proc("VmRSS:")
            with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS

    def peak(self) -> int:
        if self.dev.type == "cuda":
            return torch.cuda.max_memory_allocated(self.dev) - self.base
        return _proc("VmHWM:") - self.base


def _proc(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith(key)).split()[1]) * 1024


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure(shape: Shape, cfg: Config, dev: torch.device, steps: int,
            *, probe_steps: int = 3, warmup: int = 2) -> dict[str, Any]:
    """One configuration in a fresh model: peak memory, median step time, KL of probed steps."""
    meter = _Meter(dev)
    model = _model(shape, dev)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(shape.vocab, (shape.batch, shape.seq), generator=g).to(dev)
    adv = torch.randn(shape.batch, 1, generator=g).expand(-1, shape.seq - 1)
    weights = (adv / adv.numel()).contiguous().to(dev)  # GRPO-like: one advantage per sequence
    chunk = 1024 if cfg.chunked_loss else None
    if cfg.optimizer == "adamw":
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    else:
        sk, dn = split_params(model, sketch_embeddings=cfg.sketch_embeddings)
        opt = LoGRA(sk, dn, rank=cfg.rank, lr=1e-5, refresh_every=200, update_dtype=torch.bfloat16,
                    dense_state_dtype=torch.bfloat16 if cfg.dense_bf16 else torch.float32)
    # bf16 autocast on a CPU without bf16 instructions is ~18x slower than fp32 (measured on
    # the 2-core dev box): the CPU variant trains in fp32
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")

    def train_step() -> float:
        _sync(dev)
        t0 = time.perf_counter()
        with autocast:
            loss = causal_lm_loss(model, ids, weights, chunk_tokens=chunk)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(dev)
        return time.perf_counter() - t0

    times = [train_step() for _ in range(warmup + steps)][warmup:]
    row: dict[str, Any] = {"label": cfg.label, **asdict(cfg), "peak_bytes": meter.peak(),
                           "step_s": statistics.median(times)}
    if isinstance(opt, LoGRA):
        row["optimizer_bytes"] = opt.memory_report()
    if probe_steps:
        probe = KLProbe(model, ids[:1, : min(shape.seq, 256)])
        kls, ptimes = [], []
        for _ in range(probe_steps):
            if isinstance(opt, LoGRA):
                opt.kl_probe = probe
                ptimes.append(train_step())
                s = opt.history[-1]
                kls.append({"predicted": s.predicted_kl, "realized": s.realized_kl})
            else:
                before = probe.logits()
                ptimes.append(train_step())
                kls.append({"predicted": None, "realized": token_kl(before, probe.logits(), probe.mask)})
        row["kl"] = kls
        row["step_s_with_probe"] = statistics.median(ptimes)
        ratios = [k["predicted"] / k["realized"] for k in kls if k["predicted"] and k["realized"]]
        row["kl_pred_over_real"] = statistics.median(ratios) if ratios else None
    if isinstance(opt, LoGRA):
        opt.remove_hooks()
    return row  # the model and optimizer go with this frame; the next _Meter collects them


def _compare(doc: dict[str, Any]) -> None:
    """Each run's memory and time against fused AdamW with the same loss (the targets' baseline)."""
    base = {r["chunked_loss"]: r for r in doc["runs"] if r["optimizer"] == "adamw"}
    for r in doc["runs"]:
        a = base.get(r["chunked_loss"])
        if a is None or r is a:
            continue
        r["memory_vs_adamw"] = r["peak_bytes"] / a["peak_bytes"] if a["peak_bytes"] > 0 else None
        r["time_vs_adamw"] = r["step_s"] / a["step_s"] if r["step_s"] and a["step_s"] else None


def capacity(shape: Shape, budget_gb: float, rank: int, dev: torch.device,
             max_layers: int = 256) -> dict[str, Any]:
    """Largest layer count (and params) whose training steps fit `budget_gb`, AdamW vs LoGRA.

    Peak memory is linear in the layer count; it is measured at two small counts, the largest
    count under the budget predicted (at most `max_layers`) and run, then the boundary bracketed
    and bisected with real runs (a few at most).
    """
    budget = int(budget_gb * 2**30)
    out: dict[str, Any] = {"budget_gb": budget_gb, "batch": [shape.batch, shape.seq]}
    for cfg in (Config("adamw"), Config("logra", rank)):
        def peak(layers: int, cfg: Config = cfg) -> int:
            try:
                return measure(replace(shape, layers=layers), cfg, dev, 2, probe_steps=0,
                               warmup=0)["peak_bytes"]
            except torch.OutOfMemoryError:
                gc.collect()
                return budget + 1
        lo, hi = 1, 3
        p_lo, p_hi = peak(lo), peak(hi)
        # a layer costs at least its fp32 weights: a floor under a slope lost in RSS noise
        floor = 4 * (_params(replace(shape, layers=2)) - _params(replace(shape, layers=1)))
        slope = max(floor, (p_hi - p_lo) // (hi - lo))
        guess = min(max_layers, max(0, lo + (budget - p_lo) // slope))
        tried: dict[int, int] = {lo: p_lo, hi: p_hi}
        if guess >= 1 and guess not in tried:
            tried[guess] = peak(guess)
        for _ in range(8):  # bracket the boundary, then bisect it (RSS/allocator are not linear)
            fit = max((n for n, b in tried.items() if b <= budget), default=0)
            over = min((n for n, b in tried.items() if b > budget), default=None)
            if over is None:
                if fit >= max_layers:
                    break
                n = min(max_layers, fit + max(1, fit // 8))
            elif over - fit <= 1:
                break
            else:
                n = (fit + over) // 2
            tried[n] = peak(n)
        fit = max((n for n, b in tried.items() if b <= budget), default=0)
        out[cfg.label] = {"layers": fit, "params": _params(replace(shape, layers=fit)) if fit else 0,
                          "peak_bytes_by_layers": {str(k): v for k, v in sorted(tried.items())}}
    a, lg = out[Config("adamw").label], out[Config("logra", rank).label]
    out["params_ratio"] = lg["params"] / a["params"] if a["params"] else None
    return out


def render(doc: dict[str, Any]) -> str:
    """The readable table."""
    s = doc["shape"]
    lines = [f"LoGRA vs AdamW on {doc['device']}: Llama shapes hidden {s['hidden']}, {s['layers']} "
             f"layers, vocab {s['vocab']} ({doc['params'] / 1e9:.3f}B params), batch "
             f"{s['batch']}x{s['seq']}, {'bf16 autocast' if doc['note'] is None else 'fp32'}, "
             "gradient checkpointing"]
    if doc["note"]:
        lines.append(f"NOTE: {doc['note']}")
    lines.append(f"{'configuration':44s} {'peak GiB':>9} {'vs AdamW':>8} {'step s':>8} {'vs AdamW':>8} "
                 f"{'s w/probe':>9} {'KL pred/real':>12}")
    for r in doc["runs"]:
        def f(x: Any, spec: str) -> str:
            return format(x, spec) if isinstance(x, (int, float)) else "-"
        lines.append(f"{r['label']:44s} {r['peak_bytes'] / 2**30:9.3f} {f(r.get('memory_vs_adamw'), '8.2f')} "
                     f"{f(r['step_s'], '8.3f')} {f(r.get('time_vs_adamw'), '8.2f')} "
                     f"{f(r.get('step_s_with_probe'), '9.3f')} {f(r.get('kl_pred_over_real'), '12.4f')}")
    cap = doc.get("capacity")
    if cap:
        b, t = cap["batch"]
        lines.append(f"largest model within {cap['budget_gb']} GB at batch {b}x{t}:")
        for k, v in cap.items():
            if isinstance(v, dict) and "layers" in v:
                lines.append(f"  {k:42s} {v['layers']:4d} layers  {v['params'] / 1e9:7.3f}B params")
        if cap.get("params_ratio"):
            lines.append(f"  LoGRA fits {cap['params_ratio']:.2f}x the parameters AdamW fits")
    return "\n".join(lines)
