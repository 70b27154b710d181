"""Synthetic Llama-shaped bf16 states for `weighthub bench gpu`, and the passes over them.

`llama_specs(cfg)` lists the tensors of a Llama-3-style decoder under Hugging Face names
(Llama-3-8B: 291 tensors, 8.03B parameters); `initial_state` draws version 0 on the device
(bf16 of N(0, 0.02) fp32 matrices, norms near 1.0); `stepped_state` is version 0 with a random
`rate` of its words moved by a few ulp, as one RL step moves them (../shared/MEASUREMENTS.md:
87-91% of changes are ±1 ulp). Both are deterministic in their seed, and nothing of either state
is ever built on the host: every random draw and every word written happens on `device`, in
slices, so the temporaries stay O(SLICE) whatever the model's size. `primitives` times the
passes every ratio of the bench is quoted against: a copy of the state, the device scan and
the device digest.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..codec import device as codec_device
from ..digest import device as digest_device
from ..tensors import word_view

REPS = 3  # best of, for the primitives
SLICE = 1 << 26  # elements per random draw: 256 MB of fp32 (+ 512 MB of bucket indices)

# An RL step's change, in ulp (an integer step of the bf16 word), and the share of changed words
# each step gets: 89% ±1, 8% ±2, 3% ±3 (the measured 87-91% ±1, the rest small).
STEPS = (1, -1, 2, -2, 3, -3)
SHARES = (0.445, 0.445, 0.04, 0.04, 0.015, 0.015)


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """The shapes of a Llama-3-style decoder (grouped-query attention, untied lm_head)."""

    name: str
    hidden: int
    intermediate: int
    vocab: int
    layers: int
    kv_dim: int  # k_proj / v_proj output rows: kv heads × head dim

    def with_layers(self, layers: int) -> LlamaConfig:
        return LlamaConfig(self.name if layers == self.layers else f"{self.name}, {layers} layers",
                           self.hidden, self.intermediate, self.vocab, layers, self.kv_dim)


LLAMA3_8B = LlamaConfig("Llama-3-8B shapes", 4096, 14336, 128256, 32, 1024)
TINY = LlamaConfig("tiny Llama shapes", 256, 704, 2048, 2, 64)


def llama_specs(cfg: LlamaConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(Hugging Face name, shape) of every tensor, in the checkpoint's order."""
    h, i = cfg.hidden, cfg.intermediate
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (cfg.vocab, h))]
    for n in range(cfg.layers):
        p = f"model.layers.{n}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (cfg.kv_dim, h)),
                (p + "self_attn.v_proj.weight", (cfg.kv_dim, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)),
                (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (cfg.vocab, h))]
    return out


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def initial_state(cfg: LlamaConfig, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Version 0 on `device`: bf16 of N(0, 0.02) matrices and 1 + N(0, 0.02) norms."""
    g = _generator(device, seed)
    state = {}
    for name, shape in llama_specs(cfg):
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        flat = t.view(-1)
        for lo in range(0, flat.numel(), SLICE):
            m = min(SLICE, flat.numel() - lo)
            x = torch.randn(m, generator=g, device=device, dtype=torch.float32).mul_(0.02)
            if len(shape) == 1:
                x.add_(1.0)
            flat[lo:lo + m].copy_(x)
        state[name] = t
    return state


@dataclass(frozen=True, slots=True)
class StepStats:
    """What `stepped_state` changed: counts over the whole state."""

    numel: int
    changed: int
    one_ulp: int  # changes of exactly ±1

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.numel if self.numel else 0.0

    @property
    def one_ulp_fraction(self) -> float:
        return self.one_ulp / self.changed if self.changed else 0.0


def stepped_state(v0: dict[str, torch.Tensor], rate: float, seed: int
                  ) -> tuple[dict[str, torch.Tensor], StepStats]:
    """A copy of `v0` (on its device) with about `rate` of its words moved by STEPS ulp.

    Each word draws u ~ U[0, 1); u < rate changes it, by the step whose share of [0, rate) u
    falls in (an integer add on the int16 word, wrapping as bits do). The counts are summed on
    the device and read once at the end.
    """
    device = next(iter(v0.values())).device
    g = _generator(device, seed)
    edges, acc = [], 0.0
    for share in SHARES:
        acc += share
        edges.append(rate * acc)
    bounds = torch.tensor(edges, dtype=torch.float32, device=device)
    bounds[-1] = rate  # the shares sum to 1 up to rounding: the last edge is the rate itself
    table = torch.tensor((*STEPS, 0), dtype=torch.int16, device=device)
    counts = torch.zeros(len(STEPS) + 1, dtype=torch.int64, device=device)
    out = {}
    for name, old in v0.items():
        new = old.clone()
        words = word_view(new)
        for lo in range(0, words.numel(), SLICE):
            m = min(SLICE, words.numel() - lo)
            u = torch.rand(m, generator=g, device=device, dtype=torch.float32)
            bucket = torch.bucketize(u, bounds, right=True)  # 0..5: a step; 6: unchanged
            words[lo:lo + m].add_(table[bucket])
            counts += torch.bincount(bucket, minlength=len(STEPS) + 1)
        out[name] = new
    c = counts.tolist()
    numel = sum(t.numel() for t in v0.values())
    return out, StepStats(numel, numel - c[-1], c[0] + c[1])


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose bits differ (integer views compared on the tensors' device), or missing."""
    bad = sorted(set(a) ^ set(b))
    for name in sorted(set(a) & set(b)):
        x, y = a[name], b[name]
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(word_view(x), word_view(y)):
            bad.append(name)
    return bad


def now(dev: torch.device) -> float:
    """perf_counter once `dev` has finished what was queued on it."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)  # the clock reads what the device has finished
    return time.perf_counter()


def best(dev: torch.device, fn: Callable[[], object]) -> float:
    """The fastest of REPS timed calls of `fn`, after one untimed call."""
    fn()  # warm: allocator, caches
    times = []
    for _ in range(REPS):
        t = now(dev)
        fn()
        times.append(now(dev) - t)
    return min(times)


def primitives(v0: dict[str, torch.Tensor], v1: dict[str, torch.Tensor], dev: torch.device
               ) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Copy, extraction (v0 vs v1) and digest (of v1) in GB/s of one state, and vs the copy;
    and v1's digests (name → the 16 bytes), for the caller to check against a manifest."""
    nbytes = state_bytes(v1)
    buf = {n: torch.empty_like(t) for n, t in v1.items()}
    pairs = [(word_view(v0[n]), word_view(v1[n])) for n in v1]

    def copy_all() -> None:
        for n, t in v1.items():
            buf[n].copy_(t)

    def scan_all() -> None:
        for a, b in pairs:  # each tensor's changes dropped before the next: O(one tensor)
            codec_device.scan(a, b, a.numel())

    copy_s = best(dev, copy_all)
    buf.clear()
    scan_s = best(dev, scan_all)
    digests: dict[str, bytes] = {}
    digest_s = best(dev, lambda: digests.update(
        (n, digest_device.tensor_digest(t)) for n, t in v1.items()))
    return {"copy_gbps": nbytes / copy_s / 1e9, "extract_gbps": nbytes / scan_s / 1e9,
            "extract_over_copy": copy_s / scan_s, "digest_gbps": nbytes / digest_s / 1e9,
            "digest_over_copy": copy_s / digest_s, "copy_seconds": copy_s,
            "extract_seconds": scan_s, "digest_seconds": digest_s}, digests
