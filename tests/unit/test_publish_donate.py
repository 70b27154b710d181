"""Donated states (`publish(state, donate=True)`): the publisher keeps the caller's tensors as
its baseline instead of a copy, never writes into them, and a donated tensor modified anyway
is not published silently: receivers refuse the next version and stay where they were."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from weighthub.errors import WeighthubError
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store.memory import MemoryStore
from weighthub.targets import StateDictTarget
from weighthub.tensors import bits


def _trajectory(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Fresh bf16 casts of moving fp32 masters, as a trainer makes them."""
    g = torch.Generator().manual_seed(seed)
    master = {"a": torch.randn(64, 64, generator=g), "b": torch.randn(300, generator=g)}
    out = []
    for _ in range(n):
        for t in master.values():
            t += 0.02 * torch.randn(t.shape, generator=g)
        out.append({k: v.to(torch.bfloat16) for k, v in master.items()})
    return out


def _same(state: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(np.array_equal(bits(state[k]), bits(v)) for k, v in want.items())


def test_a_donated_state_is_the_baseline_and_receivers_stay_bit_exact() -> None:
    store = MemoryStore()
    pub = Publisher(store)
    target = StateDictTarget({})
    receiver = Receiver(store, target)
    states = _trajectory(4)
    for state in states:
        pub.publish(state, donate=True)
        receiver.sync()
        assert _same(target.state, state)
        # no copy was made: the baseline is the state's own memory
        base = pub._baseline
        assert base is not None and all(np.shares_memory(base.bits[k], bits(v))
                                        for k, v in state.items())


def test_the_publisher_never_writes_into_a_donated_state() -> None:
    store = MemoryStore()
    pub = Publisher(store, skip_every=2, anchor_every=2)
    states = _trajectory(5)
    kept = [{k: v.clone() for k, v in s.items()} for s in states]
    for i, state in enumerate(states):
        pub.publish(state, donate=i % 2 == 0)  # donated, then copied, then donated...
    for state, was in zip(states, kept, strict=True):
        assert _same(state, was)  # every tensor the caller handed over is as it was
    target = StateDictTarget({})
    Receiver(store, target).sync()
    assert _same(target.state, states[-1])


def test_a_donated_state_modified_anyway_is_refused_by_receivers() -> None:
    store = MemoryStore()
    pub = Publisher(store)
    target = StateDictTarget({})
    receiver = Receiver(store, target)
    v0, v1 = _trajectory(2)
    pub.publish(v0, donate=True)
    receiver.sync()
    v0["a"].view(torch.int16)[3, :7] ^= 0x15  # the caller breaks the contract
    pub.publish(v1)
    held = target.held()
    with pytest.raises(WeighthubError, match="digest"):
        receiver.sync()
    assert target.held() == held and _same(target.state, _trajectory(1)[0])  # still version 0
