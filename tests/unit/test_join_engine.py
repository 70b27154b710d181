"""Elastic join as a source of the one engine, with holders faked in-process.

The real thing (processes, sockets, leases on live holders) is tested in
tests/integration/test_node.py and test_net_faults.py; these pin what the join's source does
and that the engine commits or rolls back for it: striping, failover, a lying holder excluded
and its tensors re-read, lease release, an empty target after any failure.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

import weighthub.cluster.join as join_mod
import weighthub.receive.apply as apply_mod
from weighthub.cluster.join import as_full_representation, join_from_holders
from weighthub.errors import ApplyError, IntegrityError, PeerTimeout, PeerUnavailable, UsageError
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import MemoryStore
from weighthub.targets import Held, StateDictTarget
from weighthub.tensors import bits


def make_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"embed": torch.randn(200, 64, generator=g).to(torch.bfloat16),
            "norm": torch.randn(3000, generator=g),
            "empty": torch.zeros(0),
            "counts": torch.arange(777, dtype=torch.int64)}


class Holders:
    """Fake chunk servers: addr → behaviour ('good', 'liar', 'dead')."""

    def __init__(self, state: dict[str, torch.Tensor], kinds: dict[str, str]) -> None:
        self.raw = {n: bits(t).tobytes() for n, t in state.items()}
        self.kinds = kinds
        self.reads: dict[str, int] = {a: 0 for a in kinds}
        self.released: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def client(self, addr: str, secret: bytes, *, timeouts: Any) -> Any:
        holders = self

        class Client:
            def dense_range(self, version: int, tensor: str, start: int, stop: int, *,
                            lease: str) -> bytes:
                kind = holders.kinds[addr]
                if kind == "dead":
                    raise PeerTimeout(f"{addr}: timed out")
                with holders.lock:
                    holders.reads[addr] += 1
                data = holders.raw[tensor][start:stop]
                if kind == "liar" and data:
                    data = bytes([data[0] ^ 1]) + data[1:]
                return data

            def release(self, lease: str) -> None:
                with holders.lock:
                    holders.released.append((addr, lease))
        return Client()


@pytest.fixture
def published() -> tuple[MemoryStore, dict[str, torch.Tensor]]:
    store = MemoryStore("join")
    state = make_state()
    Publisher(store).publish(state)
    return store, state


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(bits(a[n]), bits(b[n])) for n in a)


def test_join_stripes_over_holders_and_commits_through_the_engine(published, monkeypatch) -> None:
    store, state = published
    holders = Holders(state, {"a:1": "good", "b:1": "good"})
    monkeypatch.setattr(join_mod, "PeerClient", holders.client)
    target = StateDictTarget({})
    r = join_from_holders(target, store, 0, ["a:1", "b:1"], b"s", stripes=2, range_bytes=4096,
                          lease="L")
    assert same(target.state, state)
    held = target.held()
    assert held is not None and (held.store, held.version) == (store.url, 0)
    assert set(r.bytes_by_holder) == {"a:1", "b:1"} and r.excluded == []
    assert r.bytes == sum(bits(t).nbytes for t in state.values())
    assert sorted(holders.released) == [("a:1", "L"), ("b:1", "L")]
    # a Receiver takes over from the joined version
    Receiver(store, target).sync(0)


def test_a_lying_and_a_dead_holder_are_excluded(published, monkeypatch) -> None:
    store, state = published
    holders = Holders(state, {"liar:1": "liar", "dead:1": "dead", "good:1": "good"})
    monkeypatch.setattr(join_mod, "PeerClient", holders.client)
    target = StateDictTarget({})
    # one range per tensor: a tensor is served by one holder (one that co-served a tensor
    # with a liar is excluded with it: the manifest has no per-range digests)
    r = join_from_holders(target, store, 0, ["liar:1", "dead:1", "good:1"], b"s", stripes=3,
                          range_bytes=1 << 20)
    assert same(target.state, state)
    assert r.excluded == ["dead:1", "liar:1"] and r.bytes_by_holder["good:1"] > 0
    assert {a for a, _lease in holders.released} == {"liar:1", "dead:1", "good:1"}


def test_only_liars_fail_the_join_and_leave_the_target_empty(published, monkeypatch) -> None:
    store, state = published
    holders = Holders(state, {"x:1": "liar", "y:1": "liar"})
    monkeypatch.setattr(join_mod, "PeerClient", holders.client)
    target = StateDictTarget({})
    with pytest.raises(PeerUnavailable):  # both excluded after the first round of re-reads
        join_from_holders(target, store, 0, ["x:1", "y:1"], b"s", range_bytes=4096)
    assert target.state == {} and target.held() is None
    assert {a for a, _lease in holders.released} == {"x:1", "y:1"}


def test_a_failed_apply_rolls_the_join_back(published, monkeypatch) -> None:
    store, state = published
    holders = Holders(state, {"a:1": "good"})
    monkeypatch.setattr(join_mod, "PeerClient", holders.client)
    real = apply_mod.apply_segment
    calls = {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost")
        return real(*args, **kwargs)
    monkeypatch.setattr(apply_mod, "apply_segment", flaky)
    target = StateDictTarget({})
    with pytest.raises(ApplyError, match="rolled back"):
        join_from_holders(target, store, 0, ["a:1"], b"s")
    assert target.state == {} and target.held() is None
    assert holders.released == [("a:1", holders.released[0][1])]


def test_join_refuses_a_held_target_and_a_manifest_contradicting_its_root(published) -> None:
    store, state = published
    held = StateDictTarget({n: t.clone() for n, t in state.items()},
                           held=Held(store.url, "m", 0, "00"))
    with pytest.raises(UsageError, match="empty target"):
        join_from_holders(held, store, 0, ["a:1"], b"s")
    from weighthub import catalog
    m = catalog.primary_manifest(store, 0)
    import msgspec
    forged = msgspec.structs.replace(m, root="ab" * 16)
    with pytest.raises(IntegrityError, match="make root"):
        as_full_representation(forged)
    full = as_full_representation(m)
    assert full.base is None and [c.covers for c in full.chunks] == [
        [(i, 0, s.numel)] for i, s in enumerate(m.specs())]
