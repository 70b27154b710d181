"""Read leases: dense reads see the held version; an apply waits for readers, for a bounded time."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from weighthub.cluster.leases import LeasedTarget, ReadLeases
from weighthub.errors import LimitError, PeerUnavailable
from weighthub.targets import Held, StateDictTarget, Target
from weighthub.tensors import bits
from weighthub.testing import TargetTests


def held_target(version: int = 3) -> StateDictTarget:
    state = {"w": torch.arange(1000, dtype=torch.int32)}
    return StateDictTarget(state, Held("mem://x", "m", version, "r" * 32))


def test_reads_serve_the_held_version_only() -> None:
    leases = ReadLeases(held_target())
    raw = bits(torch.arange(1000, dtype=torch.int32)).view(np.uint8)
    assert leases.read(3, "a", "w", 8, 40) == raw[8:40].tobytes()
    with pytest.raises(PeerUnavailable, match="serving version 3, asked for dense version 2"):
        leases.read(2, "a", "w", 0, 4)
    with pytest.raises(LimitError, match="no tensor"):
        leases.read(3, "a", "v", 0, 4)
    with pytest.raises(LimitError, match="outside"):
        leases.read(3, "a", "w", 0, 4001)
    with pytest.raises(LimitError, match="lease"):
        leases.read(3, "", "w", 0, 4)


def test_an_apply_waits_for_an_open_lease_until_it_is_released() -> None:
    target = held_target()
    leases = ReadLeases(target, wait_s=30)
    leased = LeasedTarget(target, leases)
    leases.read(3, "joiner", "w", 0, 4)
    opened = threading.Event()

    def apply() -> None:
        leased.open(target.specs() or [])
        opened.set()

    t = threading.Thread(target=apply)
    t.start()
    time.sleep(0.3)
    assert not opened.is_set()
    assert leases.read(3, "joiner", "w", 0, 4)  # the lease holder keeps reading v3
    with pytest.raises(PeerUnavailable, match="being replaced"):
        leases.read(3, "latecomer", "w", 0, 4)
    leases.release("joiner")
    assert opened.wait(5) and leased.last_wait_clean
    with pytest.raises(PeerUnavailable, match="serving nothing"):  # bits are changing
        leases.read(3, "joiner", "w", 0, 4)
    leased.commit(Held("mem://x", "m", 4, "s" * 32))
    t.join(5)
    with pytest.raises(PeerUnavailable, match="serving version 4"):
        leases.read(3, "joiner", "w", 0, 4)
    assert leases.read(4, "next", "w", 0, 4)


def test_a_stuck_reader_delays_the_apply_by_at_most_wait_s() -> None:
    target = held_target()
    leases = ReadLeases(target, ttl_s=60, wait_s=0.5)
    leased = LeasedTarget(target, leases)
    leases.read(3, "stuck", "w", 0, 4)
    leased.open(target.specs() or [])
    # waited out wait_s, not the lease's 60 s ttl (the wait's own clock, not a loaded machine's)
    assert not leased.last_wait_clean and 0.5 <= leases.last_wait_s < 30
    leased.abort()
    assert leases.read(3, "again", "w", 0, 4)  # abort: still v3, reads resume


def test_an_expired_lease_does_not_hold_the_apply() -> None:
    target = held_target()
    leases = ReadLeases(target, ttl_s=0.2, wait_s=30)
    leases.read(3, "gone", "w", 0, 4)
    time.sleep(0.3)
    assert leases.begin_apply() and leases.last_wait_s < 15  # not the 30 s wait_s
    leases.end_apply()


class TestLeasedTargetKit(TargetTests):
    """The shipped Target kit (weighthub.testing) on a leased target; after every commit or
    abort the lease gate must be open again (reads of the held version served)."""

    def make_target(self) -> Target:
        inner = StateDictTarget({})
        self.leases = ReadLeases(inner, wait_s=5)
        return LeasedTarget(inner, self.leases)

    def test_gate_reopens_after_commit_and_abort(self) -> None:
        target = self.make_target()
        self.commit_version(target, seed=1, version=8)
        assert self.leases.held_versions() == [8]
        target.open(target.specs() or [])
        assert self.leases.held_versions() == []  # applying: nothing served
        target.abort()
        assert self.leases.held_versions() == [8]
        name = self.model_specs()[0].name
        assert self.leases.read(8, "reader", name, 0, 4)
