"""The benchmark's Markdown report, written from the JSON document alone.

JSON document (keys other tools read are marked *):
  runs*: list of runs, each
    trajectory*  name; kind: real | synthetic; meta: the trajectory's metadata
    change_rate* changed words / words, over all steps
    codecs*      name → {payload_bytes*, dense_bytes*, ratio (to dense), bits_per_changed_word
                 (payload bytes·8 / changed words), to_bound_ctx (payload / bound_ctx)}, summed
                 over steps, for weighthub (`compact`: ans), weighthub_range (`compact` with the
                 range coder, ctx), weighthub_v1 (compact before the context coding),
                 weighthub_fast (`fast`), dense, dense_zstd, sparserl, sparserl_zstd, nemo,
                 bound_order0, bound_ctx; weighthub and weighthub_fast also carry encode_gbps*,
                 apply_gbps* (1 thread, GB/s of dense parameter bytes) and _2t twins
    throughput   figure → threads → {best, median, worst} GB/s (median over timed steps)
    codec_speed  [{step, change_rate, in_range (1–3%), gbps: {xor, scan, encode_compact,
                 encode_fast, pause_staged, pause_fast: spread}, ratio_to_xor, pause_ratio,
                 ctx: {changed, compact_stream_bytes, mbps: {ctx_encode, ctx_decode,
                 ctx_stage, range_encode, range_decode: spread},
                 ns_per_word}}], one thread (bench.codec_speed)
    e2e_seconds  publish → pull through a LocalStore: {median, max} over steps
    composition  [{k, composed_bytes, singles_bytes, ratio, …}]
    steps        the same per step (codecs, change_rate, seconds, throughput where timed)
  projection: {assumptions: [lines], runs: {trajectory: [per model and link]}}
  targets: rows from bench.targets.evaluate
"""

from __future__ import annotations

import time
from typing import Any

from . import bounds, projection
from .targets import CODEC_SPEED_TARGETS, EXPLAIN, SIZE_TARGETS, SPEED_TARGETS

CODEC_ORDER = ("weighthub", "weighthub_range", "weighthub_v1", "weighthub_fast", "nemo",
               "sparserl_zstd", "sparserl",
               "dense_zstd", "dense", "bound_order0", "bound_ctx")
CODEC_NOTES = {
    "weighthub": "chunk frames as written by Publisher (headers included), `compact` profile "
                 "(context coding on: ans)",
    "weighthub_v1": "same, `compact` before the context coding (exponent groups, order-0 streams)",
    "weighthub_range": "`compact` with the range coder (ctx), which ans replaced",
    "weighthub_fast": "same, `fast` profile (plain gaps, no groups, no ctx)",
    "nemo": "uint16 gaps (escape) + XOR values, zstd-1",
    "sparserl_zstd": "int32 index + raw value, zstd-1",
    "sparserl": "int32 index + raw value",
    "dense_zstd": "every word, zstd-1",
    "dense": "every word",
    "bound_order0": "order-0 entropy: gaps + min(XOR, difference)",
    "bound_ctx": "positions per tensor and old exponent + difference | exponent",
}


def _pct(x: float) -> str:
    return f"{x:.3%}"


def _secs(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.2f} s" if s >= 0.1 else f"{s * 1000:.1f} ms"


def _gbps(d: dict[str, float] | None) -> str:
    if not d:
        return "–"
    return f"{d['best']:.2f} ({d['worst']:.2f}–{d['best']:.2f})"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(r) + " |" for r in rows)]


def _cpu(machine: dict[str, Any]) -> str:
    """The CPU model and the placement's vector lowerings (place_vectors), where recorded."""
    if "cpu" not in machine:
        return ""
    low = machine.get("placement", {})
    return (f" ({machine['cpu']}; placement: {low.get('counts', '?')} counts, "
            f"{low.get('nth_set_bit', '?')} lanes)")


def render(doc: dict[str, Any], plots: list[str]) -> str:
    """The whole report as Markdown; `plots` are file names next to it."""
    runs = doc["runs"]
    out = ["# weighthub bench", "",
           f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(doc['created']))}; "
           f"{doc['machine']['cpus']} CPUs, {doc['machine']['platform']}{_cpu(doc['machine'])}; "
           f"{len(runs)} runs in {_secs(doc['seconds'])}. All payloads are summed over every step "
           "of a run; ratios are to dense bf16 bytes.", ""]
    out += _targets(doc["targets"]) + _payloads(runs) + _throughput(runs) + _codec_speed(runs)
    out += _e2e(runs)
    out += _projection(doc) + _formulas()
    if plots:
        out += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(out) + "\n"


def _targets(rows: list[dict[str, Any]]) -> list[str]:
    out = ["## Targets", "",
           "The project's goals for its codec and kernels, set in its issues; this report measures "
           "them, it does not gate on them (`weighthub bench` exits 0 whenever the measurement "
           "succeeded, met or not). A \"no\" is a finding: how far the code is from where the "
           "project wants it on this machine. The goals are stated for real trajectories; "
           "synthetic runs are checked too and marked. Shortfall = how far the measured figure "
           "is from the threshold, relative to it.", "",
           *(f"- **{label}**: {EXPLAIN[ref]}." for label, ref, _ in SIZE_TARGETS),
           *(f"- **{label}**: {EXPLAIN[key]}." for label, key, *_ in (*SPEED_TARGETS,
                                                                      *CODEC_SPEED_TARGETS)),
           ""]
    body = [[r["target"], f"{r['trajectory']}{'' if r.get('step') is None else ' step ' + str(r['step'])}"
             f" ({r['kind']}, {_pct(r['change_rate'])})", r["codec"],
             f"{r['measured']:.3f}", f"{r['threshold']}", "yes" if r["met"] else "**no**",
             "–" if r["met"] else f"{r['shortfall']:.0%}"] for r in rows]
    worse = [f"{r['trajectory']} {r['worst_step_ratio']:.3f}" for r in rows
             if r["target"].endswith("weighthub_v1") and r.get("worst_step_ratio", 0) > 1]
    if worse:
        out += ["Steps where weighthub was larger than weighthub_v1 (worst step's ratio): "
                + ", ".join(worse) + ".", ""]
    return [*out, *_table(["target", "run", "codec", "measured", "threshold", "met", "shortfall"],
                          body), ""]


def _payloads(runs: list[dict[str, Any]]) -> list[str]:
    out = ["## Payload", "", "Bits per changed word (payload bytes·8 / changed words), and in "
           "brackets the payload as a multiple of bound_ctx, summed over the run's steps.", ""]
    head = ["run", "changed", *CODEC_ORDER]
    body = []
    for r in runs:
        bound = r["codecs"]["bound_ctx"]["payload_bytes"]
        cells = [f"{r['codecs'][c]['bits_per_changed_word']:.2f} "
                 f"({r['codecs'][c]['payload_bytes'] / bound if bound else 0:.3f}×)"
                 for c in CODEC_ORDER]
        body.append([f"{r['trajectory']} ({r['kind']}, {r['steps_count']} steps)",
                     _pct(r["change_rate"]), *cells])
    out += _table(head, body)
    out += ["", "Ratio to dense bf16 bytes:", ""]
    out += _table(head, [[r["trajectory"], _pct(r["change_rate"]),
                          *(f"{r['codecs'][c]['ratio']:.4f}" for c in CODEC_ORDER)] for r in runs])
    notes = "; ".join(f"`{k}` {v}" for k, v in CODEC_NOTES.items())
    out = [*out, "", f"Codecs: {notes}.", ""]
    comp = [[r["trajectory"], str(c["k"]), f"{c['from_step']}→{c['to_step']}",
             _pct(c["composed_change_rate"]), str(c["composed_bytes"]), str(c["singles_bytes"]),
             f"{c['ratio']:.2f}"] for r in runs for c in r["composition"]]
    if comp:
        out += ["### Catch-up: one composed k-step delta vs k single deltas", ""]
        out += _table(["run", "k", "steps", "changed", "composed bytes", "k singles bytes",
                       "composed / singles"], comp)
        out.append("")
    return out


def _throughput(runs: list[dict[str, Any]]) -> list[str]:
    out = ["## Throughput", "",
           "GB/s of dense parameter bytes: best of the repeats (worst–best in brackets), the median "
           "over timed steps. Ceilings on the same buffers: memcpy and XOR; scan = change detection "
           "alone. The machine is shared: the spread is part of the result.", ""]
    head = ["run", "threads", "encode", "encode fast", "apply", "apply fast", "scan", "xor", "memcpy"]
    body = []
    for r in runs:
        tp = r["throughput"]
        if not tp:
            continue
        for t in ("1t", "2t"):
            if t not in tp.get("memcpy", {}):
                continue
            body.append([r["trajectory"], t[0], _gbps(tp["weighthub"].get(f"encode_{t}")),
                         _gbps(tp["weighthub_fast"].get(f"encode_{t}")),
                         _gbps(tp["weighthub"].get(f"apply_{t}")),
                         _gbps(tp["weighthub_fast"].get(f"apply_{t}")),
                         _gbps(tp["scan"].get(t)), _gbps(tp["xor"].get(t)),
                         _gbps(tp["memcpy"].get(t))])
    out += _table(head, body)
    shares = [(r["trajectory"], r["throughput"]["weighthub"]["encode_1t"]["best"]
               / r["throughput"]["scan"]["1t"]["best"]) for r in runs if r["throughput"]]
    if shares:
        out += ["", "Share of single-thread encode time spent finding the changes (encode GB/s ÷ "
                "scan GB/s): " + ", ".join(f"{n} {s:.0%}" for n, s in shares) + ". The rest is "
                "building position and value streams and choosing codings; with groups on, also "
                "the exponent pass over every old word.", ""]
    return out


def _codec_speed(runs: list[dict[str, Any]]) -> list[str]:
    rows = [(r, e) for r in runs for e in r.get("codec_speed", [])]
    if not rows:
        return []
    out = ["## Coder speed, one thread", "",
           "Side by side on the same buffers, best of the repeats (worst–best in brackets). State "
           "figures in GB/s of old tensor bytes, with the encoders as a multiple of the XOR pass "
           "(np.bitwise_xor into a preallocated buffer). Steps: those with 1–3% of the words "
           "changed, nearest 2% first; a run with none gets its step nearest 2% (marked *, its "
           "encode-ratio target not checked). Context coder (codec.ctx.ctx_streams on the scan's "
           "changes), context decode (codec.ctx.decode_changes: positions and values placed "
           "against the old words) and the whole staging of a segment (codec.prepared: the "
           "decode, the old and new words, digest halves and seal), for `compact`'s ans coder "
           "and, on the same changes, the range coder (ctx) it replaced: MB/s of compact "
           "stream = 4 bytes of position + W bytes of value per changed word, and ns per "
           "changed word. Pause: as a receiver runs it (the scatter of the words staging "
           "prepared, else the apply kernel folding the digest change), the compact delta vs "
           "the same delta coded `fast`.", ""]
    head = ["run", "step", "changed", "xor", "scan", "encode compact", "encode fast",
            "ans coder MB/s, ns/word", "ans decode MB/s, ns/word", "ans stage MB/s, ns/word",
            "range coder", "range decode",
            "pause staged", "pause fast"]
    body = []
    for r, e in rows:
        g, x, c = e["gbps"], e["ratio_to_xor"], e["ctx"]
        ctx_cells = [f"{c['mbps'][k]['best']:.0f} ({c['mbps'][k]['worst']:.0f}–"
                     f"{c['mbps'][k]['best']:.0f}) {c['ns_per_word'][k]:.1f} ns" if c["changed"]
                     else "–" for k in ("ctx_encode", "ctx_decode", "ctx_stage")]
        ctx_cells += [f"{c['mbps'][k]['best']:.0f} {c['ns_per_word'][k]:.0f} ns" if c["changed"]
                      else "–" for k in ("range_encode", "range_decode")]
        body.append([r["trajectory"], f"{e['step']}{'' if e['in_range'] else '*'}",
                     _pct(e["change_rate"]), _gbps(g["xor"]),
                     f"{_gbps(g['scan'])} {x['scan']:.2f}×",
                     f"{_gbps(g['encode_compact'])} {x['encode_compact']:.2f}×",
                     f"{_gbps(g['encode_fast'])} {x['encode_fast']:.2f}×", *ctx_cells,
                     _gbps(g["pause_staged"]), f"{_gbps(g['pause_fast'])} ({e['pause_ratio']:.2f}×)"])
    return [*out, *_table(head, body), ""]


def _e2e(runs: list[dict[str, Any]]) -> list[str]:
    body = [[r["trajectory"], _secs(r["e2e_seconds"]["median"]), _secs(r["e2e_seconds"]["max"]),
             f"{r['params'] * 2 / 1e6:.1f} MB"] for r in runs if r["e2e_seconds"]]
    if not body:
        return []
    return ["## Publish → pull", "",
            "Publisher + Receiver(StateDictTarget) through a LocalStore in a temporary directory "
            "(fsync per object), per step: encode, write, commit, plan, fetch, verify checksums, "
            "apply, verify digests.", "",
            *_table(["run", "median", "max", "dense size"], body), ""]


def _projection(doc: dict[str, Any]) -> list[str]:
    proj = doc["projection"]["runs"]
    out = ["## Projection", "", "Assumptions:", "",
           *(f"- {line}" for line in doc["projection"]["assumptions"]), ""]
    if not proj:
        return out
    real = [r for r in doc["runs"] if r["kind"] == "real" and r["trajectory"] in proj]
    pick = real or [r for r in doc["runs"] if r["trajectory"] in proj]
    for r in pick:
        rows = proj[r["trajectory"]]
        out += [f"### {r['trajectory']} ({_pct(r['change_rate'])} changed, payload "
                f"{r['codecs']['weighthub']['ratio']:.4f}× dense)", ""]
        links = sorted({p["link_gbit"] for p in rows})
        body = []
        for model in projection.MODEL_SIZES:
            cells = []
            for link in links:
                p = next(p for p in rows if p["model"] == model and p["link_gbit"] == link)
                cells.append(f"{_secs(p['refit_s'])} vs {_secs(p['full_s'])} ({p['speedup']:.1f}×)")
            body.append([model, *cells])
        out += _table(["model", *(f"{link:g} Gbit/s: refit vs full" for link in links)], body)
        out += [""]
    return out


def _formulas() -> list[str]:
    doc = bounds.__doc__ or ""
    body = doc.split("\n\n", 1)[1] if "\n\n" in doc else doc
    return ["## Bounds", "", "```", body.strip(), "```", ""]
