"""`weighthub bench gpu` at tiny sizes: the JSON has every figure, the receiver is bit-exact and
both publisher backends store the same bytes; without CUDA it refuses in one line (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from weighthub.bench import gpu_states
from weighthub.cli import main

PRIMITIVES = ("copy_gbps", "extract_gbps", "extract_over_copy", "digest_gbps", "digest_over_copy",
              "copy_seconds", "extract_seconds", "digest_seconds")
PUBLISH = ("seconds", "commit_seconds", "payload_bytes", "dense_bytes", "payload_over_dense",
           "changed", "chunks", "encode_seconds", "upload_seconds", "stream_seconds",
           "memory_fraction")
RECEIVER = ("stage_seconds", "stage_wall_seconds", "apply_seconds", "verify_seconds",
            "pause_seconds", "bytes_fetched", "stage_memory_fraction", "pause_memory_fraction")


def _run(tmp_path: Path, device: str, rates: str) -> dict[str, Any]:
    out = tmp_path / "gpu.json"
    assert main(["bench", "gpu", "--device", device, "--tiny", "--rates", rates,
                 "--json", str(out)]) == 0
    return json.loads(out.read_text())


def _check(doc: dict[str, Any], rates: list[float], *, cuda: bool) -> None:
    assert doc["failures"] == []
    assert doc["config"]["tensors"] == len(gpu_states.llama_specs(gpu_states.TINY))
    assert doc["rates"] == rates and len(doc["steps"]) == len(rates)
    m = doc["machine"]
    assert m["torch"] == torch.__version__ and m["cores"] >= 1 and m["workers"] >= 1
    assert (m["gpu"] is not None) == cuda and doc["on_cpu"] == (not cuda)
    full = doc["full"]
    assert full["bit_exact"] and full["payload_identical"] and full["chunks_identical"]
    for side in ("publish_device", "publish_host"):
        assert set(PUBLISH) <= set(full[side]) and full[side]["base"] is None
    assert full["receiver_sync"]["seconds"] > 0
    for step, rate in zip(doc["steps"], rates, strict=True):
        assert step["rate"] == rate
        assert abs(step["changed_fraction"] - rate) < 0.2 * rate
        assert 0.8 < step["one_ulp_fraction"] < 0.95
        for key in PRIMITIVES:
            assert step[key] > 0, key
        for side in ("publish_device", "publish_host"):
            assert set(PUBLISH) <= set(step[side]) and step[side]["base"] is not None
            assert 0 < step[side]["payload_over_dense"] < 0.2
        assert step["publish_device"]["payload_bytes"] == step["publish_host"]["payload_bytes"]
        assert step["payload_identical"] and step["chunks_identical"]
        assert step["digests_match_manifest"] is True
        rec = step["receiver"]
        assert set(RECEIVER) <= set(rec) and rec["bit_exact"] is True
        assert rec["pause_seconds"] > 0
        memory = [step["publish_device"]["memory_fraction"], rec["stage_memory_fraction"],
                  rec["pause_memory_fraction"]]
        assert all(x is not None and x >= 0 for x in memory) if cuda else memory == [None] * 3
    assert len(doc["targets"]) == 5 * len(rates)
    assert all(t["met"] is None for t in doc["targets"])  # goals are stated for 8B on a GPU


@pytest.mark.timeout(120)
def test_tiny_run_on_cpu(tmp_path: Path, capsys: Any) -> None:
    doc = _run(tmp_path, "cpu", "0.02")
    _check(doc, [0.02], cuda=False)
    assert doc["device_backend"] == "torch" and "not comparable" in doc["note"]
    table = capsys.readouterr().out
    assert "receiver pause s" in table and "not comparable to a GPU" in table


def test_without_cuda_refuses_in_one_line(tmp_path: Path, capsys: Any,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "gpu", "--tiny", "--json", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("weighthub: error: bench gpu: no CUDA device") and "\n" not in err
    assert "--device cpu" in err and not (tmp_path / "x.json").exists()


@pytest.mark.timeout(120)
def test_a_wrong_bit_fails_the_run_after_the_json(tmp_path: Path, capsys: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_states, "bit_equal", lambda got, want: ["model.norm.weight"])
    out = tmp_path / "gpu.json"
    assert main(["bench", "gpu", "--device", "cpu", "--tiny", "--rates", "0.02",
                 "--json", str(out)]) == 3
    doc = json.loads(out.read_text())
    assert doc["full"]["bit_exact"] is False and doc["steps"][0]["receiver"]["bit_exact"] is False
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("weighthub: error: IntegrityError: bench gpu: ") and "model.norm" in err


def test_bad_options_are_usage_errors(tmp_path: Path, capsys: Any) -> None:
    for args in (["--rates", "0.5,2"], ["--rates", "x"], ["--layers", "0"],
                 ["--json", str(tmp_path / "missing" / "x.json")]):
        assert main(["bench", "gpu", "--device", "cpu", "--tiny", *args]) == 2, args
        assert capsys.readouterr().err.startswith("weighthub: error: ")


def test_stepped_state_is_deterministic_and_mostly_one_ulp() -> None:
    v0 = gpu_states.initial_state(gpu_states.TINY.with_layers(1), torch.device("cpu"), seed=3)
    a, stats = gpu_states.stepped_state(v0, 0.05, seed=4)
    b, _ = gpu_states.stepped_state(v0, 0.05, seed=4)
    assert gpu_states.bit_equal(a, b) == []
    changed = sum(int((a[n].view(torch.int16) != v0[n].view(torch.int16)).sum()) for n in v0)
    assert changed == stats.changed and 0.045 < stats.changed_fraction < 0.055
    assert 0.85 < stats.one_ulp_fraction < 0.93
    assert gpu_states.bit_equal(a, v0) == sorted(v0)  # every tensor got some change


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_tiny_run_on_cuda(tmp_path: Path) -> None:
    doc = _run(tmp_path, "cuda", "0.015,0.04")
    _check(doc, [0.015, 0.04], cuda=True)
    assert doc["device_backend"] == "auto" and doc["machine"]["gpu_memory_bytes"] > 0
