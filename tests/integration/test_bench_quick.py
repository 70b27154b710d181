"""`weighthub bench --quick` end to end in a subprocess: the JSON contract and every output file.

Uses the real QUICK trajectory set (MiniLM fine-tuning steps, built into the trajectory cache on
first use, so the first run on a machine is slower) and synthetic deltas on its weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from deadlines import LONG_PROCESS_S, PROCESS_S

pytest.importorskip("weighthub.bench.trajectories")
pytest.importorskip("matplotlib")

pytestmark = pytest.mark.slow

CODECS = ("weighthub", "dense", "dense_zstd", "sparserl", "sparserl_zstd", "nemo", "bound_order0",
          "bound_ctx")


def test_bench_quick_writes_json_report_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "weighthub.cli", "bench", "--quick", "--json",
                           str(out)], capture_output=True, text=True, timeout=LONG_PROCESS_S,
                          env={**os.environ, "PYTHONFAULTHANDLER": "1"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[bench" in proc.stderr  # progress is shown
    doc = json.loads(out.read_text())
    assert doc["runs"]
    kinds = {r["kind"] for r in doc["runs"]}
    assert kinds == {"real", "synthetic"}
    for run in doc["runs"]:
        assert isinstance(run["trajectory"], str) and 0 <= run["change_rate"] <= 1
        for name in CODECS:
            assert run["codecs"][name]["payload_bytes"] >= 0
            assert run["codecs"][name]["dense_bytes"] > 0
        assert run["codecs"]["weighthub"]["encode_gbps"] > 0
        assert run["codecs"]["weighthub"]["apply_gbps"] > 0
    for name in ("report.md", "payload.png", "throughput.png", "projection.png"):
        assert (tmp_path / name).stat().st_size > 0, name


def test_bench_unwritable_output_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    proc = subprocess.run([sys.executable, "-m", "weighthub.cli", "bench", "--quick", "--out",
                           str(blocker / "sub")], capture_output=True, text=True, timeout=PROCESS_S)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
