"""Run the benchmark over trajectories: every codec, baseline and bound on the same steps.

A run is one trajectory (a sequence of model states). For each step i-1 → i it records the
changed fraction; the payload of weighthub (what really goes on the wire: the chunk frames a
`Publisher` with anchors off writes, headers included) under each encode policy of POLICIES
(`weighthub` = the `compact` profile, context coding on; `weighthub_v1` = compact before the
context coding; `weighthub_fast` = the `fast` profile), of every baseline (bench.baselines) and
the entropy bounds (bench.bounds); publish → pull seconds through a LocalStore; and, on a few
evenly spaced steps, encode and decode+apply throughput next to the memcpy/XOR ceilings
(bench.throughput). After the steps: the single-thread coder figures (bench.codec_speed) on the
steps nearest 2% changed (those with 1–3% first), and composition: the direct delta over the
last k steps against their k single deltas. The JSON document this builds is described in
bench.report.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch
from llvmlite import binding as llvm

from ..codec import place_vectors
from ..codec.coding import ENCODE_PROFILES
from ..publish import Publisher
from ..receive import Receiver
from ..store import LocalStore, MemoryStore
from ..targets import StateDictTarget
from ..tensors import bits, dtype_of
from . import baselines, bounds, codec_speed, projection, targets, throughput

Progress = Callable[[str], None]

# weighthub_v1: the `compact` profile as it was before the context coding (issue #16), kept to
# show what the context coding gains on the same deltas; weighthub_range: `compact` with the
# range coder (ctx) that ans replaced, to show what ans costs in bytes
POLICIES = {"weighthub": ENCODE_PROFILES["compact"],
            "weighthub_range": replace(ENCODE_PROFILES["compact"], coder="range"),
            "weighthub_v1": ENCODE_PROFILES["grouped"], "weighthub_fast": ENCODE_PROFILES["fast"]}
THROUGHPUT_POLICIES = ("weighthub", "weighthub_fast")  # timed in bench.throughput (1 and 2 threads)
CODECS = (*POLICIES, *baselines.BASELINES, "bound_order0", "bound_ctx")
# codec_speed: steps with this change rate are the ones its targets are stated for
SPEED_RATES = (0.01, 0.03)


class TrajectoryLike(Protocol):
    """What the runner needs of a trajectory (bench.trajectories.Trajectory has it)."""

    @property
    def name(self) -> str: ...

    @property
    def meta(self) -> Mapping[str, Any]: ...

    def __len__(self) -> int: ...

    def state(self, i: int) -> Mapping[str, torch.Tensor]: ...


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What to measure. timed_steps: steps per run with throughput timed (evenly spaced)."""

    reps: int = 3
    timed_steps: int = 2
    compose: tuple[int, ...] = (2, 4, 8)
    e2e: bool = True
    threads: tuple[int, ...] = (1, 2)
    assumptions: projection.Assumptions = field(default_factory=projection.Assumptions)


def _quiet(_msg: str) -> None:
    pass


def _bits_of(state: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {n: bits(t.detach().cpu().contiguous()) for n, t in state.items()}


def _timed_indices(steps: int, wanted: int) -> set[int]:
    """`wanted` step indices in 1..steps, evenly spaced, always including the last."""
    if wanted <= 0 or steps <= 0:
        return set()
    if wanted >= steps:
        return set(range(1, steps + 1))
    return {steps - round(j * (steps - 1) / max(1, wanted - 1)) for j in range(wanted)}


def _codec_entry(payload: float, dense: int, changed: int) -> dict[str, Any]:
    return {"payload_bytes": payload, "dense_bytes": dense,
            "ratio": payload / dense if dense else 0.0,
            "bits_per_changed_word": 8 * payload / changed if changed else 0.0}


def bench_run(traj: TrajectoryLike, kind: str, cfg: BenchConfig,
              progress: Progress = _quiet) -> dict[str, Any]:
    """Measure one trajectory. Returns its run document (see bench.report for the schema)."""
    n = len(traj)
    if n < 2:
        raise ValueError(f"trajectory {traj.name} has {n} state(s); a delta needs at least 2")
    timed = _timed_indices(n - 1, cfg.timed_steps)
    steps: list[dict[str, Any]] = []
    t_run = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="weighthub-bench-") as tmp:
        store = LocalStore(tmp)
        pub = Publisher(store, anchor_every=0, policy=POLICIES["weighthub"])
        others = {name: Publisher(MemoryStore(), anchor_every=0, policy=policy)
                  for name, policy in POLICIES.items() if name != "weighthub"}
        rx = Receiver(store, StateDictTarget({}))
        prev_state = traj.state(0)
        for p in (pub, *others.values()):
            p.publish(prev_state)
        if cfg.e2e:
            rx.sync()
        prev = _bits_of(prev_state)
        for i in range(1, n):
            t0 = time.perf_counter()
            state = traj.state(i)
            cur = _bits_of(state)
            steps.append(_step(i, state, prev, cur, pub, others, rx, cfg, i in timed))
            s = steps[-1]
            progress(f"{traj.name}: step {i}/{n - 1}: {s['change_rate']:.3%} changed, weighthub "
                     f"{s['codecs']['weighthub']['bits_per_changed_word']:.2f} bits/word "
                     f"({s['codecs']['weighthub']['to_bound_ctx']:.3f}× bound_ctx), v1 "
                     f"{s['codecs']['weighthub_v1']['bits_per_changed_word']:.2f}, nemo "
                     f"{s['codecs']['nemo']['bits_per_changed_word']:.2f} "
                     f"({time.perf_counter() - t0:.1f}s)")
            prev = cur
    run = _summarize(traj, kind, steps)
    run["codec_speed"] = _codec_speed(traj, steps, cfg, progress)
    run["composition"] = _composition(traj, steps, cfg.compose, progress)
    run["seconds"] = time.perf_counter() - t_run
    return run


def _step(i: int, state: Mapping[str, torch.Tensor], prev: dict[str, np.ndarray],
          cur: dict[str, np.ndarray], pub: Publisher, others: dict[str, Publisher], rx: Receiver,
          cfg: BenchConfig, timed: bool) -> dict[str, Any]:
    r = pub.publish(state)
    pull_s = rx.sync().seconds if cfg.e2e else None
    dense, changed = r.dense_bytes, r.changed
    codecs = {"weighthub": _codec_entry(r.payload_bytes, dense, changed)}
    for name, p in others.items():
        codecs[name] = _codec_entry(p.publish(state).payload_bytes, dense, changed)
    for name, size in baselines.baseline_bytes(prev, cur).items():
        codecs[name] = _codec_entry(size, dense, changed)
    b = bounds.EMPTY
    for name in sorted(cur):
        b = b + bounds.delta_bounds(prev[name], cur[name], dtype_of(state[name]))
    codecs["bound_order0"] = {**_codec_entry(b.order0_bytes, dense, changed), "parts": b.to_dict()}
    codecs["bound_ctx"] = {**_codec_entry(b.context_bytes, dense, changed), "parts": b.to_dict()}
    _add_bound_ratios(codecs)
    doc: dict[str, Any] = {"step": i, "changed": changed, "numel": r.numel,
                           "change_rate": r.changed_fraction, "codecs": codecs,
                           "publish_seconds": r.seconds, "pull_seconds": pull_s,
                           "e2e_seconds": None if pull_s is None else r.seconds + pull_s}
    if timed:
        pairs = [throughput.Pair(prev[name], cur[name], dtype_of(state[name])) for name in sorted(cur)]
        doc["throughput"] = throughput.measure(pairs, {n: POLICIES[n] for n in THROUGHPUT_POLICIES},
                                               reps=cfg.reps, threads=cfg.threads)
    return doc


def _summarize(traj: TrajectoryLike, kind: str, steps: list[dict[str, Any]]) -> dict[str, Any]:
    changed = sum(s["changed"] for s in steps)
    numel = sum(s["numel"] for s in steps)
    codecs: dict[str, dict[str, Any]] = {}
    for name in CODECS:
        payload = sum(s["codecs"][name]["payload_bytes"] for s in steps)
        dense = sum(s["codecs"][name]["dense_bytes"] for s in steps)
        codecs[name] = _codec_entry(payload, dense, changed)
    _add_bound_ratios(codecs)
    timed = [s["throughput"] for s in steps if "throughput" in s]
    tp: dict[str, Any] = {}
    if timed:
        # per figure: the median over timed steps of each step's best-of-reps (and its spread)
        for what, per in timed[0].items():
            tp[what] = {k: {stat: statistics.median(t[what][k][stat] for t in timed)
                            for stat in ("best", "median", "worst")} for k in per}
        for name in THROUGHPUT_POLICIES:
            c = codecs[name]
            for k, spread in tp[name].items():  # encode_1t, apply_2t, …
                op, threads_ = k.split("_")
                c[f"{op}_gbps" if threads_ == "1t" else f"{op}_gbps_{threads_}"] = spread["best"]
    e2e = [s["e2e_seconds"] for s in steps if s["e2e_seconds"] is not None]
    return {
        "trajectory": traj.name, "kind": kind, "meta": _jsonable(dict(traj.meta)),
        "steps_count": len(steps), "params": steps[0]["numel"],
        "change_rate": changed / numel if numel else 0.0,
        "codecs": codecs, "throughput": tp,
        "e2e_seconds": {"median": statistics.median(e2e), "max": max(e2e)} if e2e else None,
        "steps": steps,
    }


def _add_bound_ratios(codecs: dict[str, dict[str, Any]]) -> None:
    """Each codec's payload as a multiple of the context bound (`to_bound_ctx`), in place."""
    bound = codecs["bound_ctx"]["payload_bytes"]
    for c in codecs.values():
        c["to_bound_ctx"] = c["payload_bytes"] / bound if bound else 0.0


def speed_steps(steps: list[dict[str, Any]], wanted: int) -> list[dict[str, Any]]:
    """The steps the coder figures are measured on: up to `wanted` with a change rate in
    SPEED_RATES (nearest 2% first), else the one step nearest 2%."""
    lo, hi = SPEED_RATES
    mid = (lo + hi) / 2
    by_rate = sorted(steps, key=lambda s: abs(s["change_rate"] - mid))
    inside = [s for s in by_rate if lo <= s["change_rate"] <= hi]
    return sorted(inside[:max(1, wanted)] or by_rate[:1], key=lambda s: s["step"])


def _codec_speed(traj: TrajectoryLike, steps: list[dict[str, Any]], cfg: BenchConfig,
                 progress: Progress) -> list[dict[str, Any]]:
    """bench.codec_speed on the chosen steps (states reloaded: the run keeps only one)."""
    lo, hi = SPEED_RATES
    out = []
    for s in speed_steps(steps, cfg.timed_steps):
        i = s["step"]
        old, new = traj.state(i - 1), traj.state(i)
        pairs = [throughput.Pair(bits(old[n].detach().cpu().contiguous()),
                                 bits(new[n].detach().cpu().contiguous()), dtype_of(new[n]))
                 for n in sorted(new)]
        m = codec_speed.measure(pairs, reps=cfg.reps)
        out.append({"step": i, "change_rate": s["change_rate"],
                    "in_range": lo <= s["change_rate"] <= hi, **m})
        progress(f"{traj.name}: coder speed on step {i} ({s['change_rate']:.2%} changed): encode "
                 f"compact {m['ratio_to_xor']['encode_compact']:.2f}× XOR, ans coder "
                 f"{m['ctx']['ns_per_word']['ctx_encode']:.0f} ns/change (range coder "
                 f"{m['ctx']['ns_per_word']['range_encode']:.0f}), ans decode "
                 f"{m['ctx']['mbps']['ctx_decode']['best']:.0f} MB/s (range "
                 f"{m['ctx']['mbps']['range_decode']['best']:.0f}), ans stage "
                 f"{m['ctx']['mbps']['ctx_stage']['best']:.0f} MB/s, pause "
                 f"{m['pause_ratio']:.2f}× fast")
    return out


def _composition(traj: TrajectoryLike, steps: list[dict[str, Any]], ks: tuple[int, ...],
                 progress: Progress) -> list[dict[str, Any]]:
    """Direct delta over the last k steps vs the k single deltas, for each k the run allows."""
    out = []
    last = len(traj) - 1
    for k in ks:
        if k > len(steps):
            continue
        first = last - k
        pub = Publisher(MemoryStore(), anchor_every=0, policy=POLICIES["weighthub"])
        pub.publish(traj.state(first))
        r = pub.publish(traj.state(last))
        singles = sum(s["codecs"]["weighthub"]["payload_bytes"] for s in steps[first:last])
        out.append({"k": k, "from_step": first, "to_step": last,
                    "composed_bytes": r.payload_bytes, "singles_bytes": singles,
                    "ratio": r.payload_bytes / singles if singles else 0.0,
                    "composed_change_rate": r.changed_fraction})
        progress(f"{traj.name}: {k} steps composed: {r.payload_bytes} bytes = "
                 f"{out[-1]['ratio']:.2f}× the {k} single deltas")
    return out


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def run_bench(trajectories: list[tuple[TrajectoryLike, str]], cfg: BenchConfig = BenchConfig(),
              progress: Progress = _quiet) -> dict[str, Any]:
    """Measure every (trajectory, kind) and assemble the JSON document."""
    t0 = time.perf_counter()
    runs = []
    for j, (traj, kind) in enumerate(trajectories, 1):
        progress(f"run {j}/{len(trajectories)}: {traj.name} ({kind}, {len(traj)} states)")
        runs.append(bench_run(traj, kind, cfg, progress))
    doc: dict[str, Any] = {
        "format": "weighthub-bench/1",
        "created": time.time(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "cpu": llvm.get_host_cpu_name(), "placement": place_vectors.lowering()},
        "config": {**asdict(cfg), "policies": {n: asdict(p) for n, p in POLICIES.items()}},
        "runs": runs,
    }
    doc["projection"] = {
        "assumptions": cfg.assumptions.lines(),
        "runs": {r["trajectory"]: [p.to_dict() for p in projection.project(
            r["codecs"]["weighthub"]["ratio"], r["codecs"]["weighthub"]["encode_gbps"],
            r["codecs"]["weighthub"]["apply_gbps"], assumptions=cfg.assumptions)]
            for r in runs if "encode_gbps" in r["codecs"]["weighthub"]},
    }
    doc["targets"] = targets.evaluate(runs)
    doc["seconds"] = time.perf_counter() - t0
    return doc
