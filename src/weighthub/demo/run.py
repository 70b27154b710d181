"""`weighthub demo`: fine-tune a real model and refit it, bit-exact, into receiver processes.

Per optimizer step: the trainer's bf16 state is published to a local store as a delta (only
changed words travel), every receiver process syncs to the new version in place, and each
receiver's root digest, computed from its own tensors, is checked against the manifest's root
and against the digest of the trainer's state. Exit status 0 iff every receiver matched at
every step.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .. import catalog
from ..engines.warm import warm_kernels
from ..errors import UsageError
from ..publish import Publisher, PublishResult
from ..store import LocalStore
from .pool import WorkerFailed, WorkerPool
from .trainer import MODEL_NAME, MiniLMTrainer
from .worker import state_root


@dataclass(slots=True)
class ReceiverStep:
    name: str
    ok: bool
    match: bool
    version: int | None = None
    route: list[str] = field(default_factory=list)
    bytes: int = 0
    stage_s: float = 0.0
    pause_s: float = 0.0
    root: str | None = None
    error: str | None = None


@dataclass(slots=True)
class StepRecord:
    step: int
    version: int
    base: int | None  # None: published as a full version
    loss: float | None
    train_s: float
    changed_fraction: float
    payload_bytes: int
    dense_bytes: int
    publish_s: float
    manifest_root: str
    trainer_match: bool  # the manifest's root is the digest of the trainer's own state
    receivers: list[ReceiverStep]

    @property
    def ratio(self) -> float:
        return self.payload_bytes / self.dense_bytes if self.dense_bytes else 0.0

    @property
    def all_matched(self) -> bool:
        return self.trainer_match and all(r.match for r in self.receivers)


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """The demo's settings, as the CLI's `demo` subcommand spells them."""

    steps: int = 6
    receivers: int = 2
    lr: float = 1e-5
    store: str | None = None  # None: a fresh temporary directory, removed at the end
    seed: int = 0
    json: str | None = None  # a path to write the JSON summary to
    optimizer: str = "adamw"  # or "logra": low-rank gradient sketches (weighthub.train)
    logra_rank: int = 16

    @classmethod
    def of(cls, args: Any) -> DemoConfig:
        """From the CLI's Namespace (or any object with some of those attributes)."""
        defaults = cls()
        cfg = cls(**{f: getattr(args, f, getattr(defaults, f)) for f in cls.__dataclass_fields__})
        if cfg.steps < 0 or cfg.receivers < 1 or not cfg.lr > 0:
            raise UsageError(f"need steps >= 0, receivers >= 1 and lr > 0; got steps={cfg.steps}, "
                             f"receivers={cfg.receivers}, lr={cfg.lr}")
        return cfg


def main(args: Any) -> int:
    """Run the demo (see the module docstring). Returns the process exit status."""
    cfg = DemoConfig.of(args)
    t_start = time.perf_counter()
    temp_store = cfg.store is None
    store_path = Path(cfg.store) if cfg.store is not None else Path(
        tempfile.mkdtemp(prefix="weighthub-demo-"))
    try:
        records, pids = _run(cfg, store_path)
    finally:
        if temp_store:
            shutil.rmtree(store_path, ignore_errors=True)
    seconds = time.perf_counter() - t_start
    ok = bool(records) and all(r.all_matched for r in records)
    _print_summary(records, seconds, ok)
    if cfg.json:
        summary = {"model": MODEL_NAME, "store": str(store_path), "store_kept": not temp_store,
                   "lr": cfg.lr, "seed": cfg.seed, "receivers": cfg.receivers,
                   "worker_pids": pids, "seconds": seconds, "all_matched": ok,
                   "steps": [dict(asdict(r), ratio=r.ratio, all_matched=r.all_matched)
                             for r in records]}
        Path(cfg.json).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"summary written to {cfg.json}")
    return 0 if ok else 1


def _run(cfg: DemoConfig, store_path: Path) -> tuple[list[StepRecord], list[int]]:
    print(f"weighthub demo: fine-tuning {MODEL_NAME} (InfoNCE on generated sentence pairs, {cfg.optimizer} "
          f"lr={cfg.lr:g}, seed {cfg.seed}) for {cfg.steps} steps")
    publisher = Publisher(LocalStore(store_path))
    print(f"  store     {store_path}{' (temporary)' if cfg.store is None else ''}")
    # workers start first: they import and warm up while the trainer loads the model
    pool = WorkerPool(str(store_path), cfg.receivers)
    records: list[StepRecord] = []
    try:
        print(f"  receivers {cfg.receivers} processes (python -m weighthub.demo.worker), each "
              f"with its own copy of the weights; pids {pool.pids}")
        t0 = time.perf_counter()
        trainer = MiniLMTrainer(lr=cfg.lr, seed=cfg.seed, optimizer=cfg.optimizer,
                                logra_rank=cfg.logra_rank)
        params = trainer.num_parameters
        print(f"  model     {trainer.model_path}\n"
              f"            {params / 1e6:.1f}M parameters, refitted as bf16 "
              f"({params * 2 / 2**20:.1f} MiB dense); loaded in {time.perf_counter() - t0:.1f} s")
        warm_kernels()  # the publisher's codec kernels, so step 1's publish time is not JIT time
        pool.wait_ready()
        print()
        _print_header(cfg.receivers)
        state, loss, train_s = trainer.initial_state(), None, 0.0
        for step in range(cfg.steps + 1):
            if step:
                t = time.perf_counter()
                loss, state = trainer.step()
                train_s = time.perf_counter() - t
            rec = _refit(step, loss, train_s, state, publisher, pool)
            records.append(rec)
            _print_step(rec)
            if not all(r.ok for r in rec.receivers):
                break  # a receiver failed (it rolled back): report, do not go on
    except WorkerFailed as exc:
        print(f"FAILED: {exc}")
    finally:
        pool.close()
    return records, pool.pids


def _refit(step: int, loss: float | None, train_s: float, state: dict[str, Any],
           publisher: Publisher, pool: WorkerPool) -> StepRecord:
    """Publish one state, sync every receiver to it and check every digest."""
    result: PublishResult = publisher.publish(state)
    manifest = catalog.primary_manifest(publisher.store, result.version)
    trainer_match = state_root(state) == manifest.root
    receivers = []
    for w, reply in zip(pool.workers, pool.sync(result.version), strict=True):
        if reply.get("ok"):
            receivers.append(ReceiverStep(
                w.name, True, reply["root"] == manifest.root and reply["version"] == result.version,
                reply["version"], reply["route"], reply["bytes"], reply["stage_s"],
                reply["pause_s"], reply["root"]))
        else:
            receivers.append(ReceiverStep(w.name, False, False, error=str(reply.get("error"))))
    return StepRecord(step, result.version, result.base, loss, train_s, result.changed_fraction,
                      result.payload_bytes, result.dense_bytes, result.seconds, manifest.root,
                      trainer_match, receivers)


# -- report -------------------------------------------------------------------------------------
def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # unreachable; keeps type checkers content


def _print_header(receivers: int) -> None:
    cols = "  ".join(f"pause r{i}" for i in range(receivers))
    print(f"{'step':>4} {'ver':>3} {'loss':>7} {'train':>6} {'changed':>8} {'payload':>10} "
          f"{'ratio':>7} {'publish':>7}  {cols}  digests")


def _print_step(r: StepRecord) -> None:
    loss = "-" if r.loss is None else f"{r.loss:.4f}"
    changed = "full" if r.base is None else f"{r.changed_fraction:.3%}"
    applies = "  ".join(f"{x.pause_s:7.3f}s" if x.ok else f"{'error':>8}" for x in r.receivers)
    print(f"{r.step:>4} {r.version:>3} {loss:>7} {r.train_s:5.1f}s {changed:>8} "
          f"{_fmt_bytes(r.payload_bytes):>10} {r.ratio:7.4f} {r.publish_s:6.2f}s  {applies}  "
          f"{'OK' if r.all_matched else 'FAIL'}")
    for x in r.receivers:
        if not x.ok:
            print(f"       {x.name}: {x.error}")
        elif not x.match:
            print(f"       {x.name}: holds root {x.root} at version {x.version}, manifest says "
                  f"{r.manifest_root}")
    if not r.trainer_match:
        print(f"       the manifest's root {r.manifest_root} is not the digest of the trainer's state")


def _print_summary(records: list[StepRecord], seconds: float, ok: bool) -> None:
    deltas = [r for r in records if r.step > 0]
    print()
    print(f"{'':<24}{'step 0':>14}{'deltas (mean)':>16}{'deltas (total)':>16}")
    if records:
        first = records[0]
        n = max(1, len(deltas))
        total = sum(r.payload_bytes for r in deltas)
        dense = sum(r.dense_bytes for r in deltas)
        rows = [
            ("changed words", f"{first.changed_fraction:.2%}",
             f"{sum(r.changed_fraction for r in deltas) / n:.3%}", ""),
            ("payload", _fmt_bytes(first.payload_bytes), _fmt_bytes(total / n), _fmt_bytes(total)),
            ("payload / dense bf16", f"{first.ratio:.4f}",
             f"{total / dense:.4f}" if dense else "-", ""),
            ("publish", f"{first.publish_s:.2f} s",
             f"{sum(r.publish_s for r in deltas) / n:.2f} s", ""),
            ("receiver pause (max)", f"{max((x.pause_s for x in first.receivers), default=0):.3f} s",
             f"{sum(max((x.pause_s for x in r.receivers), default=0) for r in deltas) / n:.3f} s", ""),
        ]
        for label, a, b, c in rows:
            print(f"{label:<24}{a:>14}{b if deltas else '-':>16}{c:>16}")
    matched = sum(r.all_matched for r in records)
    print(f"\n{matched}/{len(records)} versions bit-exact on every receiver; {seconds:.1f} s in all: "
          f"{'OK' if ok else 'FAIL'}")
