"""`weighthub bench`: pick the trajectories, run the benchmark, write JSON, report and plots.

    --quick   the QUICK trajectory set + synthetic 1% and 3% on its first model's weights
    default   the STANDARD set + synthetic 1, 3, 5 and 10%
Outputs are checked writable before any work starts; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..cliargs import LazyParser
from ..errors import UsageError

if TYPE_CHECKING:
    from . import runner

QUICK_RATES = (0.01, 0.03)
STANDARD_RATES = (0.01, 0.03, 0.05, 0.10)


def add_parser(sub: Any) -> None:
    """Register the `bench` subcommand on an argparse subparsers object."""
    s = sub.add_parser("bench", help="measure payload, bounds, throughput and projected refit time")
    s.add_argument("--quick", action="store_true",
                   help="reduced set (MiniLM 3 steps + synthetic 1%% and 3%%), under a minute")
    s.add_argument("--json", default=None, metavar="PATH", help="write the JSON document here")
    s.add_argument("--out", default=None, metavar="DIR",
                   help="report and plots (default: next to --json, else ./bench-out)")
    s.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="trajectory cache (default: $WEIGHTHUB_CACHE or ~/.cache/weighthub/trajectories)")
    s.add_argument("--reps", type=int, default=3, help="repeats per throughput figure (best kept)")
    s.add_argument("--timed-steps", type=int, default=None, metavar="N",
                   help="steps per run with throughput timed (default 1 quick, 3 otherwise)")
    s.add_argument("--rates", default=None, metavar="R,R",
                   help="synthetic change rates (default 0.01,0.03 quick; 0.01,0.03,0.05,0.1)")
    s.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    s.add_argument("--logra", action="store_true",
                   help="also run the LoGRA comparison (bench.logra), if installed")
    s.set_defaults(func=cmd_bench)
    # Optional suites; each one's module is imported only when that suite is parsed
    # (LazyParser), so `weighthub --help` does not import them. Without a suite: the bench above.
    suites = s.add_subparsers(dest="bench_suite", metavar="[SUITE]", parser_class=LazyParser,
                              help="optional: run one of these instead of the default bench")
    suites.add_parser("shaped", help="refit over a tc-shaped link: full checkpoint vs "
                      "weighthub vs shardcast (network namespaces; needs root)",
                      add_arguments=_shaped_arguments)
    suites.add_parser("net", help="refit via the hub's relay tree vs all from the store, elastic "
                      "join, a relay killed mid-refit; bytes over a tc-shaped region link (root)",
                      add_arguments=_net_arguments)
    suites.add_parser("transport", help="loopback throughput of one stream of large chunks: "
                      "aiohttp vs framed TCP vs the weighthub chunk server",
                      add_arguments=_transport_arguments)
    suites.add_parser("gpu", help="the device backend on Llama-3-8B-shaped bf16 states: copy, "
                      "scan and digest GB/s, publish and receive times, device memory",
                      add_arguments=_gpu_arguments)
    suites.add_parser("logra", help="LoGRA vs fused AdamW training steps on Llama shapes (--gpu): "
                      "peak memory, step time, predicted vs realized KL, largest model per budget",
                      add_arguments=_logra_arguments)


def _shaped_arguments(p: argparse.ArgumentParser) -> None:
    """`weighthub bench shaped`: refit over tc-shaped links between network namespaces (root)."""
    from . import shaped

    shaped.add_arguments(p)
    p.set_defaults(func=shaped.cmd_shaped)


def _net_arguments(p: argparse.ArgumentParser) -> None:
    from . import net

    net.add_arguments(p)
    p.set_defaults(func=net.cmd_net)


def _transport_arguments(p: argparse.ArgumentParser) -> None:
    from . import transport as bench_transport

    bench_transport.add_arguments(p)
    p.set_defaults(func=bench_transport.cmd_transport)


def _gpu_arguments(p: argparse.ArgumentParser) -> None:
    from . import gpu

    gpu.add_arguments(p)
    p.set_defaults(func=gpu.cmd_gpu)


def _logra_arguments(p: argparse.ArgumentParser) -> None:
    from . import logra_gpu

    logra_gpu.add_arguments(p)


def _progress(t0: float) -> runner.Progress:
    def show(msg: str) -> None:
        print(f"[bench {time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)
    return show


def _check_writable(directory: Path) -> None:
    """Create `directory` if needed and prove a file can be written there, or UsageError."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".weighthub-bench-"):
            pass
    except OSError as exc:
        raise UsageError(f"cannot write benchmark output to {directory}: "
                         f"{exc.strerror or exc}; choose another --out/--json") from None


def _outputs(args: argparse.Namespace) -> tuple[Path | None, Path]:
    json_path = Path(args.json).expanduser() if args.json else None
    if json_path is not None and json_path.is_dir():
        raise UsageError(f"--json {json_path} is a directory; give a file path")
    out = Path(args.out).expanduser() if args.out else (
        json_path.parent if json_path is not None else Path("bench-out"))
    for d in {out, *(() if json_path is None else (json_path.parent,))}:
        _check_writable(d)
    return json_path, out


def _rates(args: argparse.Namespace) -> tuple[float, ...]:
    if args.rates is None:
        return QUICK_RATES if args.quick else STANDARD_RATES
    try:
        rates = tuple(float(r) for r in args.rates.split(",") if r.strip())
    except ValueError:
        raise UsageError(f"--rates {args.rates!r}: give comma-separated fractions, e.g. 0.01,0.03") from None
    if any(not 0 < r < 1 or math.isnan(r) for r in rates):
        raise UsageError(f"--rates {args.rates!r}: every rate must be in (0, 1)")
    return rates


def build_suite(quick: bool, rates: tuple[float, ...], cache_dir: Path | None,
                progress: runner.Progress) -> list[tuple[runner.TrajectoryLike, str]]:
    """The real trajectories of the QUICK or STANDARD set, then synthetic ones on the first's weights.

    Trajectories are built and cached on first use (checksummed; a corrupt cache is rebuilt).
    Raises UsageError when a model package is missing.
    """
    from . import trajectories

    suite: list[tuple[runner.TrajectoryLike, str]] = []
    for spec in trajectories.QUICK if quick else trajectories.STANDARD:
        progress(f"loading trajectory {spec.name} (built and cached on first use)")
        try:
            traj = trajectories.load(spec, cache_dir)
        except ImportError as exc:
            raise UsageError(f"trajectory {spec.name} needs a package that is not installed "
                             f"({exc}); install weighthub[bench]") from exc
        suite.append((traj, "real"))
    base = suite[0][0].state(0)
    for j, rate in enumerate(rates):
        suite.append((trajectories.SyntheticTrajectory(base, rate, j), "synthetic"))
    return suite


def _run_logra(out: Path, quick: bool, progress: runner.Progress) -> Any:
    try:
        from .logra import run_logra_bench  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise UsageError(f"--logra: weighthub.bench.logra is not available ({exc})") from exc
    progress("running the LoGRA comparison (bench.logra)")
    # SmolLM2 takes 1-3 min per step per optimizer on 2 cores: keep --quick to 2 small steps
    return run_logra_bench(steps=2, rank=8, rss=False) if quick else run_logra_bench(steps=8, rank=16)


def cmd_bench(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    progress = _progress(t0)
    json_path, out = _outputs(args)  # before any work: an unwritable path fails in a second
    rates = _rates(args)
    timed = args.timed_steps if args.timed_steps is not None else (1 if args.quick else 3)
    if args.reps < 1 or timed < 1:
        raise UsageError("--reps and --timed-steps must be >= 1")
    cache = Path(args.cache_dir).expanduser() if args.cache_dir else None
    if cache is not None:
        os.environ["WEIGHTHUB_CACHE"] = str(cache)
    from . import report, runner  # lazily: `weighthub --help` must not import torch

    suite = build_suite(args.quick, rates, cache, progress)
    cfg = runner.BenchConfig(reps=args.reps, timed_steps=timed,
                             compose=(2,) if args.quick else (2, 4, 8))
    doc = runner.run_bench(suite, cfg, progress)
    doc["quick"] = bool(args.quick)
    if args.logra:
        doc["logra"] = runner._jsonable(_run_logra(out, args.quick, progress))
    text = json.dumps(doc, indent=1, allow_nan=True)
    (json_path or out / "bench.json").write_text(text)
    plots = [] if args.no_plots else _plots(doc, out, progress)
    (out / "report.md").write_text(report.render(doc, plots))
    progress(f"wrote {json_path or out / 'bench.json'}, {out / 'report.md'} and {len(plots)} plot(s)")
    real = [row for row in doc["targets"] if row["kind"] == "real"]
    if real:
        progress("goals (the project's targets, measured not gated: see report.md 'Targets')")
    for row in real:
        mark = "met" if row["met"] else f"short of the goal by {row['shortfall']:.0%}"
        progress(f"goal {row['target']} [{row['trajectory']}, {row['codec']}]: "
                 f"{row['measured']:.3f} vs {row['threshold']}: {mark}")
    return 0  # the measurement succeeded; goals missed are findings, not failures


def _plots(doc: dict[str, Any], out: Path, progress: runner.Progress) -> list[str]:
    from .plots import write_plots

    try:
        return write_plots(doc, out)
    except ImportError as exc:
        progress(f"no plots: {exc}")
        return []
