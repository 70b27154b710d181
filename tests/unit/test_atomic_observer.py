"""Invariant 2 (atomic): an observer sees all of v−1 or all of v, never a mix.

An observer thread reads the target over and over while a receiver applies many versions
(forward deltas, chains, a backward route, a failed apply rolled back). Reading under
`Receiver.lock`, every snapshot must be exactly one published version, and the version the
target reports. The control test shows the check is not vacuous: the same observer reading
without the lock, at a moment held open inside an apply, does see a mix.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import weighthub.receive.apply as apply_mod
from weighthub.digest import tensor_digest
from weighthub.errors import ApplyError
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import MemoryStore
from weighthub.targets import StateDictTarget
from weighthub.tensors import bits

SPAN = 8 << 10  # small chunks: every version applies as many chunks and segments
VERSIONS = 12


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(128, 96, generator=g).to(torch.bfloat16),
            "mlp": torch.randn(96, 96, generator=g).to(torch.bfloat16),
            "norm": torch.randn(6000, generator=g),
            "counts": torch.randint(-(2**40), 2**40, (2000,), generator=g)}


def step(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Every tensor changes (±1 ulp at 3% of its words): a half-applied version is visible."""
    rng = np.random.default_rng(seed)
    out = {n: t.clone() for n, t in state.items()}
    for t in out.values():
        b = bits(t)
        idx = rng.choice(b.size, max(2, b.size * 3 // 100), replace=False)
        b[idx] += b.dtype.type(1)
    return out


def published() -> tuple[MemoryStore, list[dict[str, bytes]]]:
    store = MemoryStore("atomic")
    pub = Publisher(store, delta_span_bytes=SPAN, full_span_bytes=SPAN)
    state = make_state()
    digests = []
    for v in range(VERSIONS):
        if v:
            state = step(state, v)
        assert pub.publish(state).version == v
        digests.append({n: tensor_digest(t) for n, t in state.items()})
    return store, digests


def classify(snapshot: dict[str, bytes], versions: list[dict[str, bytes]]) -> set[int]:
    """The versions a snapshot is all of (empty: a mix, or bits no version has)."""
    return {v for v, d in enumerate(versions) if d == snapshot}


class Observer(threading.Thread):
    """Reads the target until stopped; records every snapshot that is not one whole version."""

    def __init__(self, target: StateDictTarget, versions: list[dict[str, bytes]],
                 lock: threading.Lock | None) -> None:
        super().__init__(daemon=True)
        self.target, self.versions, self.lock = target, versions, lock
        self.stop = threading.Event()
        self.reads = 0
        self.bad: list[str] = []

    def read(self) -> None:
        held = self.target.held()
        snap = {n: tensor_digest(t) for n, t in self.target.state.items()}
        found = classify(snap, self.versions)
        if not found:
            self.bad.append(f"read {self.reads}: a mix (held {held and held.version})")
        elif held is None or held.version not in found:
            self.bad.append(f"read {self.reads}: bits of {sorted(found)}, held says "
                            f"{held and held.version}")
        self.reads += 1

    def run(self) -> None:
        while not self.stop.is_set():
            if self.lock is None:
                self.read()
            else:
                with self.lock:
                    self.read()


def slowed(monkeypatch: pytest.MonkeyPatch, hook: Callable[[], None]) -> None:
    """Run `hook` after every segment applied: widens the window an unlocked read could hit."""
    real = apply_mod.apply_segment

    def slow(*args: Any, **kwargs: Any) -> Any:
        entry = real(*args, **kwargs)
        hook()
        return entry

    monkeypatch.setattr(apply_mod, "apply_segment", slow)


def test_an_observer_under_the_lock_never_sees_a_mix(monkeypatch: pytest.MonkeyPatch) -> None:
    store, versions = published()
    target = StateDictTarget({})
    rx = Receiver(store, target, apply_workers=2)
    rx.sync(0)
    pause = threading.Event()
    flaky = {"n": 0, "fail_at": 0}

    def after_segment() -> None:
        pause.wait(0.0005)
        flaky["n"] += 1
        if flaky["n"] == flaky["fail_at"]:
            raise RuntimeError("device lost")
    slowed(monkeypatch, after_segment)
    observer = Observer(target, versions, rx.lock)
    observer.start()
    try:
        for v in (1, 2, 4, 5, 8, 9, 10, 11):  # single deltas and chains
            rx.sync(v)
        rx.sync(7)  # back: a backward route or an anchor and deltas
        flaky["fail_at"] = flaky["n"] + 5
        with pytest.raises(ApplyError):
            rx.sync(11)  # fails after a few segments: rolled back to 7 under the lock
        assert rx.version == 7
        rx.sync(11)
    finally:
        observer.stop.set()
        observer.join(30)
    assert not observer.is_alive()
    assert observer.bad == [], observer.bad[:5]
    assert observer.reads >= 10  # it really read during the run
    assert rx.version == 11 and classify(
        {n: tensor_digest(t) for n, t in target.state.items()}, versions) == {11}


def test_the_observer_would_see_a_mix_without_the_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: hold an apply open after its first segment and read without the lock."""
    store, versions = published()
    target = StateDictTarget({})
    rx = Receiver(store, target, apply_workers=1)
    rx.sync(0)
    mid, seen = threading.Event(), threading.Event()

    def hold_open() -> None:
        if not mid.is_set():
            mid.set()
            assert seen.wait(10), "the observer never read"
    slowed(monkeypatch, hold_open)
    observer = Observer(target, versions, lock=None)

    def read_midway() -> None:
        assert mid.wait(10)
        observer.read()
        seen.set()
    reader = threading.Thread(target=read_midway, daemon=True)
    reader.start()
    rx.sync(1)
    reader.join(10)
    assert observer.reads == 1 and observer.bad and "a mix" in observer.bad[0], observer.bad
    # and read under the lock after the commit, the same check passes
    locked = Observer(target, versions, rx.lock)
    with rx.lock:
        locked.read()
    assert locked.bad == []
