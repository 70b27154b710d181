"""PNG plots of a benchmark document (matplotlib, Agg backend: no display needed).

    payload.png     payload / dense vs change rate, every step of every run, per codec and bound
    throughput.png  encode and decode+apply GB/s per run next to the memcpy and XOR ceilings
    projection.png  projected refit time vs link speed per model size, next to a full checkpoint
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .report import CODEC_ORDER


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(doc: dict[str, Any], out_dir: Path) -> list[str]:
    """Write every plot into out_dir; return the file names written."""
    plt = _pyplot()
    names = []
    for name, draw in (("payload.png", _payload), ("throughput.png", _throughput),
                       ("projection.png", _projection)):
        fig = draw(plt, doc)
        if fig is None:
            continue
        fig.savefig(out_dir / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        names.append(name)
    return names


def _payload(plt: Any, doc: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(8, 5.5))
    bound_marks = {"bound_order0": "x", "bound_ctx": "+"}
    for j, codec in enumerate(CODEC_ORDER):
        for kind, mark in (("real", "o"), ("synthetic", "^")):
            pts = [(s["change_rate"], s["codecs"][codec]["ratio"]) for r in doc["runs"]
                   if r["kind"] == kind for s in r["steps"] if s["change_rate"] > 0]
            if not pts:
                continue
            xs, ys = zip(*pts, strict=True)
            ax.scatter(xs, ys, marker=bound_marks.get(codec, mark), s=22, color=f"C{j}",
                       label=f"{codec} ({kind})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("changed fraction of words per step")
    ax.set_ylabel("payload / dense bf16 bytes")
    ax.set_title("Payload vs change rate (every step of every run; o real, ^ synthetic)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    return fig


def _throughput(plt: Any, doc: dict[str, Any]) -> Any:
    runs = [r for r in doc["runs"] if r["throughput"]]
    if not runs:
        return None
    series = [("encode", "weighthub", "encode"), ("encode fast", "weighthub_fast", "encode"),
              ("apply", "weighthub", "apply"), ("apply fast", "weighthub_fast", "apply"),
              ("scan", "scan", None), ("xor", "xor", None), ("memcpy", "memcpy", None)]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(runs)), 5))
    width = 0.8 / len(series)
    for j, (label, key, op) in enumerate(series):
        xs = [i + j * width for i in range(len(runs))]
        for t in ("1t", "2t"):
            vals = []
            for r in runs:
                spread = r["throughput"].get(key, {}).get(f"{op}_{t}" if op else t)
                vals.append(spread["best"] if spread else float("nan"))
            if t == "1t":
                ax.bar(xs, vals, width, color=f"C{j}", label=f"{label}", alpha=0.85)
            else:  # two threads: a black tick on the same bar
                ax.scatter(xs, vals, marker="_", s=120, color="black",
                           label="2 threads" if j == 0 else None, zorder=3)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(runs))])
    ax.set_xticklabels([f"{r['trajectory']}\n{r['change_rate']:.2%}" for r in runs], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s of dense parameter bytes, 1 thread (best of repeats)")
    ax.set_title("Throughput vs ceilings")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    return fig


def _projection(plt: Any, doc: dict[str, Any]) -> Any:
    proj = doc["projection"]["runs"]
    if not proj:
        return None
    real = [r for r in doc["runs"] if r["kind"] == "real" and r["trajectory"] in proj]
    run = (real or [r for r in doc["runs"] if r["trajectory"] in proj])[0]
    rows = proj[run["trajectory"]]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    models = list(dict.fromkeys(p["model"] for p in rows))
    for j, model in enumerate(models):
        pts = sorted((p["link_gbit"], p["refit_s"], p["full_s"]) for p in rows if p["model"] == model)
        xs = [p[0] for p in pts]
        ax.plot(xs, [p[1] for p in pts], "-o", color=f"C{j}", label=f"{model} refit")
        ax.plot(xs, [p[2] for p in pts], "--", color=f"C{j}", label=f"{model} full checkpoint")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link (Gbit/s)")
    ax.set_ylabel("seconds")
    ax.set_title(f"Projected refit time, payload and speeds of {run['trajectory']} "
                 f"({run['codecs']['weighthub']['ratio']:.4f}× dense)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return fig
