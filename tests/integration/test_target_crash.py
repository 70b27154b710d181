"""A safetensors target shared by processes, and killed in the middle of its transactions.

Real receiver processes (`target_child.py`) pull from a local store into one file:

* two pulls toward different versions at once: the target's lock serializes them; both end
  well and the file's bits are exactly the version its sidecar claims (by digest), or a pull
  that could not wait long enough is refused with a message saying what the file holds;
* a pull killed with SIGKILL at each point of its commit (in-place and atomic, and while
  materializing): the next open recovers from the crash journal without the network, to the
  old version or, if the new one's claim was durable, the new one, bit-exact; no temporary is
  left; the next pull is a delta from there (the base is not fetched again).
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from deadlines import PROCESS_S

import weighthub
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import LocalStore
from weighthub.targets.safetensors_file import SafetensorsTarget, load_checkpoint
from weighthub.tensors import bits

pytestmark = pytest.mark.slow

CHILD = str(Path(__file__).with_name("target_child.py"))
SRC = str(Path(weighthub.__file__).resolve().parents[1])  # the weighthub under test, for children


def make_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(256, 256, generator=g).bfloat16(),
            "mlp.weight": torch.randn(128, 384, generator=g).bfloat16(),
            "norm.weight": torch.randn(4096, generator=g),
            "step": torch.arange(8, dtype=torch.int64)}


def step(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """~3% of words move by ±1 on the integer view; the int64 counter advances."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in state.items():
        t = t.clone()
        b = bits(t)
        idx = rng.choice(b.size, max(1, b.size // 32), replace=False)
        b[idx] += b.dtype.type(1)
        out[name] = t
    return out


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for n in sorted(state):
        h.update(n.encode() + b"\0" + bits(state[n].contiguous()).tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A local store with versions 0..3 (a full version, then deltas) and their digests."""
    root = tmp_path_factory.mktemp("store")
    pub = Publisher(LocalStore(root))
    states = [make_state(0)]
    for v in range(1, 4):
        states.append(step(states[-1], v))
    for s in states:
        pub.publish(s)
    return root, [digest(s) for s in states]


class Child:
    """A target_child.py process; killed (its whole group) when the test ends."""

    def __init__(self, *args: object) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.proc = subprocess.Popen([sys.executable, CHILD, *map(str, args)], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)

    def line(self, *keys: str, timeout: float = PROCESS_S) -> dict[str, Any]:
        """The next JSON line it prints with one of `keys` (any, if none): a hang guard, not a
        speed check."""
        assert self.proc.stdout is not None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                text = self.proc.stdout.readline()
                if not text:
                    break
                doc = json.loads(text) if text.startswith("{") else None
                if doc is not None and (not keys or set(keys) & set(doc)):
                    return doc
        err = self.proc.stderr.read() if self.proc.poll() is not None and self.proc.stderr else ""
        raise AssertionError(f"child printed no {keys or 'line'} within {timeout:g}s: {err[-2000:]}")

    def exited_within(self, seconds: float) -> bool:
        try:
            self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=PROCESS_S)

    def finish(self) -> None:
        self.proc.communicate(timeout=PROCESS_S)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for c in started:
        c.kill9()
        for f in (c.proc.stdout, c.proc.stderr):
            if f is not None:
                f.close()


def held_bits(out: Path) -> tuple[int, str]:
    """(version the sidecar claims, digest of the file's bits), after recovery if needed."""
    held = SafetensorsTarget(out).held()
    assert held is not None, f"{out} holds no version"
    return held.version, digest(load_checkpoint(out))


def pull(store: Path, out: Path, version: int) -> tuple[int | None, int]:
    r = Receiver(LocalStore(store, create=False), SafetensorsTarget(out), verify_base=True).sync(version)
    return r.from_version, r.bytes_fetched


def test_two_pulls_toward_different_versions_leave_the_file_as_its_sidecar_says(
        history: tuple[Path, list[str]], tmp_path: Path, children: list[Child]) -> None:
    store, digests = history
    out = tmp_path / "out.safetensors"
    pull(store, out, 0)
    go, start = tmp_path / "go", tmp_path / "start"
    first = Child(store, out, 1, "--cli", "--pause", "opened", "--go", go)
    second = Child(store, out, 3, "--cli", "--say-opening", "--after", start)
    children += [first, second]
    assert first.line("paused", "exit") == {"paused": "opened"}  # mid-transaction, toward 1
    start.touch()
    assert second.line("opening")
    # ordering only: the second either waits for the first's lock (then it is still running)
    # or, with no lock, runs its whole transaction meanwhile; then the first goes on
    second.exited_within(2.0)
    go.touch()
    # both pulls succeed: the second waited for the first, then went on from what it committed
    assert first.line("exit") == {"exit": 0} and second.line("exit") == {"exit": 0}
    for c in (first, second):
        c.finish()
    version, bits_digest = held_bits(out)
    assert bits_digest == digests[version], f"sidecar claims {version}, bits are another version"
    assert version == 3
    assert pull(store, out, 2)[0] == 3  # and the next pull works from there
    assert held_bits(out) == (2, digests[2])


def test_a_pull_that_cannot_wait_is_refused_saying_what_the_file_holds(
        history: tuple[Path, list[str]], tmp_path: Path, children: list[Child]) -> None:
    store, digests = history
    out = tmp_path / "out.safetensors"
    pull(store, out, 0)
    start = tmp_path / "start"
    first = Child(store, out, 1, "--pause", "opened")
    second = Child(store, out, 2, "--lock-timeout", 0.5, "--after", start)
    children += [first, second]
    assert first.line("paused", "pulled", "error") == {"paused": "opened"}
    start.touch()
    err = second.line("error", "pulled")["error"]
    assert err.startswith("TargetBusy: out.safetensors in ") and "another process (pid " in err
    assert "it holds version 0 (root " in err and "consistent; nothing was changed" in err, err
    first.kill9()  # the kernel drops a dead holder's lock: nothing to wait for
    assert held_bits(out) == (0, digests[0])
    assert pull(store, out, 2)[0] == 0 and held_bits(out) == (2, digests[2])


# (mode, starting version (None: materializing), pause point, version held after the kill)
KILLS = [
    ("in-place", 1, "opened", 1),
    ("in-place", 1, "journaled", 1),
    ("in-place", 1, "mid-apply", 1),
    ("in-place", 1, "applied", 1),
    ("in-place", 1, "claimed", 2),
    ("atomic", 1, "journaled", 1),
    ("atomic", 1, "renamed", 2),
    ("in-place", None, "renamed", 2),
]


def test_kill9_at_each_point_of_a_commit_recovers_without_network(
        history: tuple[Path, list[str]], tmp_path: Path, children: list[Child]) -> None:
    store, digests = history
    outs = []
    for i, (mode, start, point, _) in enumerate(KILLS):  # all at once: one start-up's wait
        out = tmp_path / f"k{i}" / "out.safetensors"
        out.parent.mkdir()
        if start is not None:
            pull(store, out, start)
        children.append(Child(store, out, 2, "--mode", mode, "--pause", point))
        outs.append(out)
    for child, (_, _, point, _) in zip(children, KILLS, strict=True):
        assert child.line("paused", "pulled", "error") == {"paused": point}
        child.kill9()
    for out, (mode, start, point, after) in zip(outs, KILLS, strict=True):
        case = f"{mode} from {start}, killed at {point}"
        target = SafetensorsTarget(out)
        held = target.held()  # recovers from the journal, if there is one: no store involved
        assert held is not None and held.version == after, (case, held, target.recovered)
        assert digest(load_checkpoint(out)) == digests[after], case
        if point in ("mid-apply", "applied"):  # the file held mixed bits: restored from the journal
            assert "rolled back to version 1" in (target.recovered or ""), case
        target.open(target.specs() or [])  # a transaction sweeps the dead one's temporaries
        target.abort()
        left = [p.name for p in out.parent.iterdir()
                if p.name.startswith(".") and not p.name.endswith(".weighthub-lock")]
        assert left == [], (case, left)
        # the next pull is a delta from what it holds (nothing fetched again from scratch)
        source, fetched = pull(store, out, 3)
        assert source == after and held_bits(out) == (3, digests[3]), case
        assert fetched < os.path.getsize(out) / 4, case
