"""Benchmark pieces on tiny inputs: bounds against hand-computed values, baseline sizes, the
projection arithmetic, target rows, and the JSON contract of a whole (tiny) run."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
import torch

from weighthub.bench import baselines, bounds, projection, report, runner, targets
from weighthub.tensors import DTYPE_BY_NAME

BF16 = DTYPE_BY_NAME["BF16"]
I16 = DTYPE_BY_NAME["I16"]


# -- bounds --------------------------------------------------------------------------------------


def test_entropy_of_hand_sequences() -> None:
    assert bounds.entropy_bits(np.array([5, 5, 5], np.uint16)) == 0.0
    assert bounds.entropy_bits(np.array([1, 2], np.uint16)) == pytest.approx(2.0)  # 2 × 1 bit
    # counts 2,1,1 of 4: H = 1.5 bits, 6 bits in all
    assert bounds.entropy_bits(np.array([7, 7, 9, 3], np.int64)) == pytest.approx(6.0)
    assert bounds.entropy_bits(np.array([1 << 40, 1 << 41], np.uint64)) == pytest.approx(2.0)


def test_binary_and_conditional_entropy() -> None:
    # n=4, k=2: 4·H_b(1/2) = 4 bits; n=4, k=0 and k=4 cost nothing
    assert bounds.binary_entropy_bits(np.array([4, 4, 4]), np.array([2, 0, 4])) == pytest.approx(4.0)
    # symbols fully determined by the context → 0; independent of it → order-0
    assert bounds.conditional_entropy_bits(np.array([1, 2, 1, 2], np.uint16),
                                           np.array([0, 1, 0, 1])) == pytest.approx(0.0)
    assert bounds.conditional_entropy_bits(np.array([1, 2, 1, 2], np.uint16),
                                           np.array([0, 0, 1, 1])) == pytest.approx(4.0)
    wide = np.array([1, 2, 1, 2], np.uint64)  # 64-bit symbols take the two-column path
    assert bounds.conditional_entropy_bits(wide, np.array([0, 0, 1, 1])) == pytest.approx(4.0)


def test_delta_bounds_hand_computed() -> None:
    # 8 bf16 words; two exponents: elements 0-3 have exponent 0x7F (1.0…), 4-7 exponent 0x80.
    old = np.array([0x3F80, 0x3F81, 0x3F82, 0x3F83, 0x4000, 0x4001, 0x4002, 0x4003], np.uint16)
    new = old.copy()
    new[[1, 3]] += 1  # +1 ulp twice, both in exponent 0x7F: XOR 0x3 (0x81→0x82)… see below
    b = bounds.delta_bounds(old, new, BF16)
    assert b.changed == 2
    # gaps: 1-(-1)=2, 3-1=2 → one symbol, 0 bits
    assert b.gap_bytes == 0.0
    # diffs are +1, +1 → 0 bits; XORs 0x81^0x82=3, 0x83^0x84=7 → 2 bits
    assert b.diff_bytes == 0.0
    assert b.xor_bytes == pytest.approx(2 / 8)
    assert b.order0_bytes == pytest.approx(0.0)
    # context: exponent 0x7F has n=4, k=2 → 4 bits; exponent 0x80 n=4, k=0 → 0
    assert b.ctx_pos_bytes == pytest.approx(4 / 8)
    assert b.ctx_diff_bytes == 0.0
    assert b.context_bytes == pytest.approx(4 / 8)


def test_delta_bounds_mixed_gaps_and_integer_dtype() -> None:
    old = np.zeros(10, np.uint16)
    new = old.copy()
    new[[0, 1, 5]] = [1, 2, 1]  # gaps 1, 1, 4 → counts 2,1 → 3·H(2/3,1/3)
    b = bounds.delta_bounds(old, new, I16)
    h = -(2 / 3) * math.log2(2 / 3) - (1 / 3) * math.log2(1 / 3)
    assert b.gap_bytes == pytest.approx(3 * h / 8)
    assert b.diff_bytes == pytest.approx(3 * h / 8)  # diffs 1, 2, 1
    assert b.context_bytes == pytest.approx(b.order0_bytes)  # no exponent: falls back to order 0
    assert bounds.delta_bounds(old, old, I16) == bounds.EMPTY


def test_bound_sums_keep_per_tensor_minima() -> None:
    a = bounds.DeltaBounds(1, 1.0, 1.0, 0.5, 0.5, 2.0, 0.5, 0.5, 2.0)
    b = bounds.DeltaBounds(1, 1.0, 1.0, 0.5, 2.0, 0.5, 0.5, 2.0, 0.5)
    s = a + b
    assert s.order0_bytes == 2.0 and s.xor_bytes == 2.5 and s.diff_bytes == 2.5


# -- baselines -----------------------------------------------------------------------------------


def _sparse_delta(n: int, rate: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    old = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.02).bfloat16()
    old_bits = old.view(torch.int16).numpy().view(np.uint16).copy()
    new = old_bits.copy()
    idx = np.flatnonzero(rng.random(n) < rate)
    new[idx] += rng.choice(np.array([1, 0xFFFF], np.uint16), idx.size)
    return old_bits, new


def test_baseline_sizes_are_sane_on_sparse_deltas() -> None:
    old, new = _sparse_delta(200_000, 0.01)
    k = int((old != new).sum())
    sizes = baselines.baseline_bytes({"w": old}, {"w": new})
    assert sizes["dense"] == old.nbytes
    assert sizes["sparserl"] == 6 * k  # int32 index + bf16 value
    assert sizes["nemo"] < sizes["sparserl_zstd"] < sizes["sparserl"] < sizes["dense_zstd"] < sizes["dense"]
    assert baselines.nemo_bytes(old, old) == 0


def test_nemo_escapes_long_gaps() -> None:
    old = np.zeros(200_000, np.uint16)
    new = old.copy()
    new[[10, 150_000]] = 1  # the second gap is ≥ 65535: escaped
    assert baselines.nemo_bytes(old, new) > 0
    with pytest.raises(ValueError):
        baselines.sparserl_bytes(old, new[:10])


# -- projection and targets ----------------------------------------------------------------------


def test_projection_arithmetic() -> None:
    rows = projection.project(0.01, 1.0, 2.0, assumptions=projection.Assumptions(encoder_cores=4,
                                                                                 apply_cores=2),
                              sizes={"1T": 1e12}, links=(3.0,))
    (p,) = rows
    assert p.full_s == pytest.approx(2e12 / (3e9 / 8))  # ≈ 88.9 min: the seed's 87.5 min
    assert p.wire_s == pytest.approx(0.01 * p.full_s)
    assert p.encode_s == pytest.approx(2e12 / 4e9)
    assert p.apply_s == pytest.approx(2e12 / 4e9)
    assert p.refit_s == pytest.approx(max(p.wire_s, p.encode_s) + p.apply_s)
    assert p.speedup == pytest.approx(p.full_s / p.refit_s)
    with pytest.raises(ValueError):
        projection.project(0.01, 0.0, 1.0)


def test_targets_rows() -> None:
    def fig(gbps: float) -> dict[str, float]:
        return {"best": gbps, "median": gbps, "worst": gbps}

    tp = {"weighthub": {"encode_1t": fig(1.0), "apply_1t": fig(6.0)},
          "weighthub_fast": {"encode_1t": fig(2.5), "apply_1t": fig(7.0)}}
    run = {"trajectory": "t", "kind": "real", "change_rate": 0.02, "codecs": {
        "weighthub": {"payload_bytes": 60}, "nemo": {"payload_bytes": 100},
        "bound_ctx": {"payload_bytes": 50}},
        "steps": [{"step": 1, "change_rate": 0.01, "throughput": tp},
                  {"step": 2, "change_rate": 0.2, "throughput": tp}]}
    rows = {(r["target"], r["codec"]): r for r in targets.evaluate([run])}
    assert rows[("payload ≤ 0.65× nemo", "weighthub")]["met"]
    ctx = rows[("payload ≤ 1.1× bound_ctx", "weighthub")]
    assert not ctx["met"] and ctx["shortfall"] == pytest.approx(1.2 / 1.1 - 1)
    enc = rows[("encode ≥ 2 GB/s/core at 1–3%", "weighthub")]
    assert not enc["met"] and enc["shortfall"] == pytest.approx(0.5)
    assert rows[("encode ≥ 2 GB/s/core at 1–3%", "weighthub_fast")]["met"]
    assert rows[("decode+apply ≥ 5 GB/s/core at 1%", "weighthub")]["met"]
    assert len(targets.evaluate([run])) == 6  # the 20% step is outside both speed ranges


def _speed_entry(step: int, rate: float, ratio: float, decode_mbps: float, pause: float,
                 ctx_changed: int = 10) -> dict[str, Any]:
    mbps = {"best": decode_mbps, "median": decode_mbps, "worst": decode_mbps}
    return {"step": step, "change_rate": rate, "in_range": 0.01 <= rate <= 0.03,
            "ratio_to_xor": {"encode_compact": ratio}, "pause_ratio": pause,
            "ctx": {"changed": ctx_changed, "mbps": {"ctx_decode": mbps}}}


def test_v1_and_codec_speed_target_rows() -> None:
    def step(i: int, wh: int, v1: int) -> dict[str, Any]:
        return {"step": i, "change_rate": 0.02, "codecs": {"weighthub": {"payload_bytes": wh},
                                                            "weighthub_v1": {"payload_bytes": v1}}}

    run = {"trajectory": "t", "kind": "synthetic", "change_rate": 0.02,
           "codecs": {"weighthub": {"payload_bytes": 95}, "weighthub_v1": {"payload_bytes": 100}},
           "steps": [step(1, 40, 50), step(2, 55, 50)],
           "codec_speed": [_speed_entry(1, 0.02, 0.30, 200.0, 1.0),
                           _speed_entry(2, 0.05, 0.50, 100.0, 0.9),  # outside 1-3%: no ratio row
                           _speed_entry(3, 0.02, 0.40, 0.0, 1.0, ctx_changed=0)]}
    rows = targets.evaluate([run])
    (v1,) = [r for r in rows if r["target"] == "payload ≤ weighthub_v1"]
    assert v1["met"] and v1["measured"] == pytest.approx(0.95)
    assert v1["worst_step_ratio"] == pytest.approx(1.1)  # step 2 alone was larger
    enc = [r for r in rows if r["target"].startswith("compact encode")]
    assert [(r["step"], r["met"]) for r in enc] == [(1, False), (3, True)]
    assert enc[0]["shortfall"] == pytest.approx(1 - 0.30 / 0.35)
    dec = [r for r in rows if r["target"].startswith("ctx decode")]
    assert [(r["step"], r["met"]) for r in dec] == [(1, True), (2, False)]  # step 3: no ctx
    pause = [r for r in rows if r["target"].startswith("pause")]
    assert [(r["step"], r["met"]) for r in pause] == [(1, True), (2, False), (3, True)]
    text = report.render({"created": 0.0, "machine": {"cpus": 1, "platform": "p"}, "seconds": 1.0,
                          "runs": [], "targets": rows,
                          "projection": {"assumptions": [], "runs": {}}}, [])
    assert "weighthub_v1 (worst step's ratio): t 1.100" in text


def test_speed_steps_prefer_one_to_three_percent() -> None:
    steps = [{"step": i, "change_rate": r} for i, r in enumerate([0.06, 0.035, 0.025, 0.012, 0.019], 1)]
    assert [s["step"] for s in runner.speed_steps(steps, 2)] == [3, 5]  # nearest 2%, by step
    assert [s["step"] for s in runner.speed_steps(steps, 9)] == [3, 4, 5]
    assert [s["step"] for s in runner.speed_steps(steps[:2], 2)] == [2]  # none inside: nearest


# -- a whole tiny run: the JSON contract -----------------------------------------------------------


class _Traj:
    def __init__(self, name: str, states: list[dict[str, torch.Tensor]]) -> None:
        self.name, self.meta, self._states = name, {"model": "tiny"}, states

    def __len__(self) -> int:
        return len(self._states)

    def state(self, i: int) -> dict[str, torch.Tensor]:
        return self._states[i]


def _tiny_trajectory(steps: int = 3) -> _Traj:
    g = torch.Generator().manual_seed(0)
    state = {"a.weight": (torch.randn(300, 200, generator=g) * 0.02).bfloat16(),
             "b.weight": (torch.randn(5000, generator=g)).bfloat16()}
    states = [state]
    for s in range(steps):
        nxt = {}
        for name, t in states[-1].items():
            t = t.clone()
            flat = t.view(-1).view(torch.int16)
            mask = torch.rand(flat.shape, generator=g) < 0.02 * (s + 1)
            flat[mask] += 1
            nxt[name] = t
        states.append(nxt)
    return _Traj("tiny", states)


@pytest.fixture(scope="module")
def tiny_doc() -> dict[str, Any]:
    cfg = runner.BenchConfig(reps=1, timed_steps=1, compose=(2, 8))
    return runner.run_bench([(_tiny_trajectory(), "real")], cfg)


def test_json_contract(tiny_doc: dict[str, Any]) -> None:
    doc = json.loads(json.dumps(tiny_doc))  # serializable as is
    (run,) = doc["runs"]
    assert run["trajectory"] == "tiny" and 0 < run["change_rate"] < 0.2
    assert set(run["codecs"]) == set(runner.CODECS)
    changed = sum(s["changed"] for s in run["steps"])
    bound = run["codecs"]["bound_ctx"]["payload_bytes"]
    for name in ("weighthub", "weighthub_range", "weighthub_v1", "weighthub_fast", "dense",
                 "dense_zstd", "sparserl", "sparserl_zstd", "nemo", "bound_order0", "bound_ctx"):
        c = run["codecs"][name]
        assert c["payload_bytes"] > 0
        assert c["dense_bytes"] == 3 * (300 * 200 + 5000) * 2
        assert c["bits_per_changed_word"] == pytest.approx(8 * c["payload_bytes"] / changed)
        assert c["to_bound_ctx"] == pytest.approx(c["payload_bytes"] / bound)
    assert run["codecs"]["sparserl"]["bits_per_changed_word"] == pytest.approx(48.0)  # 4+2 bytes
    assert doc["config"]["policies"]["weighthub_v1"]["ctx"] is False
    assert doc["config"]["policies"]["weighthub"]["ctx"] is True
    assert doc["config"]["policies"]["weighthub"]["coder"] == "ans"
    assert doc["config"]["policies"]["weighthub_range"] == {**doc["config"]["policies"]["weighthub"],
                                                           "coder": "range"}
    assert doc["config"]["policies"]["weighthub_fast"] == {**doc["config"]["policies"]["weighthub"],
                                                          "groups": False, "ctx": False}
    # coder speed on the one step with 1-3% changed (the tiny steps change ~2%, 4%, 6%)
    (speed,) = run["codec_speed"]
    step = run["steps"][speed["step"] - 1]
    assert speed["step"] == 1 and speed["in_range"] and speed["change_rate"] == step["change_rate"]
    assert speed["changed"] == step["changed"] and speed["state_bytes"] == step["numel"] * 2
    assert set(speed["gbps"]) == {"xor", "scan", "encode_compact", "encode_fast", "pause_staged",
                                  "pause_fast"}
    assert all(0 < f["worst"] <= f["median"] <= f["best"] for f in speed["gbps"].values())
    assert speed["ratio_to_xor"]["encode_compact"] == pytest.approx(
        speed["gbps"]["encode_compact"]["best"] / speed["gbps"]["xor"]["best"])
    assert run["codecs"]["weighthub"]["encode_gbps"] > 0
    assert run["codecs"]["weighthub"]["apply_gbps"] > 0
    assert len(run["steps"]) == 3 and "throughput" in run["steps"][-1]
    assert [c["k"] for c in run["composition"]] == [2]  # 8 steps do not fit
    c = run["composition"][0]
    assert c["composed_bytes"] > 0 and c["singles_bytes"] > 0
    assert run["e2e_seconds"]["median"] > 0
    assert doc["projection"]["runs"]["tiny"]
    codecs = run["codecs"]
    assert codecs["weighthub"]["payload_bytes"] < codecs["nemo"]["payload_bytes"] < codecs["dense"][
        "payload_bytes"]
    # empirical entropies: positions independent of the exponent make the two bounds close
    assert codecs["bound_ctx"]["payload_bytes"] == pytest.approx(
        codecs["bound_order0"]["payload_bytes"], rel=0.1)


def test_report_and_plots(tiny_doc: dict[str, Any], tmp_path: Any) -> None:
    from weighthub.bench import plots

    pytest.importorskip("matplotlib")
    names = plots.write_plots(tiny_doc, tmp_path)
    assert names == ["payload.png", "throughput.png", "projection.png"]
    assert all((tmp_path / n).stat().st_size > 1000 for n in names)
    text = report.render(tiny_doc, names)
    for heading in ("## Targets", "## Payload", "## Throughput", "## Coder speed", "## Projection",
                    "## Bounds"):
        assert heading in text
    assert "| weighthub | weighthub_range | weighthub_v1 | weighthub_fast |" in text
    # every goal is explained, and the report says it measures rather than gates
    targets_section = text.split("## Targets", 1)[1].split("## Payload", 1)[0]
    assert "does not gate" in targets_section
    for label, *_ in (*targets.SIZE_TARGETS, *targets.SPEED_TARGETS, *targets.CODEC_SPEED_TARGETS):
        assert f"- **{label}**:" in targets_section


def test_cli_refuses_unwritable_output_before_work(tmp_path: Any, capsys: Any) -> None:
    from weighthub.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["bench", "--quick", "--json", str(blocker / "out.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("weighthub: error: cannot write benchmark output") and "\n" not in err


def test_codec_speed_times_ans_and_range_side_by_side() -> None:
    """An Adam-like bf16 step (small relative moves, ~2% of words change) is context-coded; the
    figures cover both coders on the same tensors and both decodes were checked bit-exact."""
    from weighthub.bench import codec_speed, throughput
    from weighthub.tensors import dtype_of

    g = torch.Generator().manual_seed(3)
    old = (torch.randn(400, 300, generator=g) * 0.02).bfloat16()
    step = torch.randn(old.shape, generator=g) * 2e-6  # lr 2e-6, |Adam update| ~ lr
    new = (old.float() + step).bfloat16()
    bits = [t.view(torch.int16).numpy().view(np.uint16).reshape(-1).copy() for t in (old, new)]
    speed = codec_speed.measure([throughput.Pair(bits[0], bits[1], dtype_of(old))], reps=1)
    ctx = speed["ctx"]
    assert 0.005 < speed["change_rate"] < 0.2 and ctx["changed"] == speed["changed"]
    assert set(ctx["mbps"]) == {"ctx_encode", "ctx_decode", "ctx_stage", "range_encode",
                                "range_decode"}
    assert all(0 < f["worst"] <= f["best"] for f in ctx["mbps"].values())
    # both coders sit far below 4 index bytes + one value word per change
    assert 0 < ctx["wire_bytes"] < ctx["compact_stream_bytes"] / 2
    assert 0 < ctx["range_wire_bytes"] < ctx["compact_stream_bytes"] / 2
