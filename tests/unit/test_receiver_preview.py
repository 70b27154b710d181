"""`Receiver.preview`: a staged version applied and verified on a scratch copy kept by the
caller, the target untouched; the scratch copied afresh only when it does not hold the staged
version's base."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weighthub.errors import BaseMismatch, UsageError
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import LocalStore
from weighthub.targets.state_dict import StateDictTarget


def _states(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(64, 32, generator=g).to(torch.bfloat16),
             "b": torch.randn(100, generator=g).to(torch.bfloat16)}
    out = [state]
    for _ in range(n - 1):
        nxt = {k: v.clone() for k, v in out[-1].items()}
        for v in nxt.values():
            flat = v.view(torch.int16).view(-1)
            flat[torch.randperm(flat.numel(), generator=g)[:7]] += 1
        out.append(nxt)
    return out


def _bits(state: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {k: v.view(torch.int16).flatten().tolist() for k, v in state.items()}


def test_preview_applies_on_the_scratch_and_reuses_it(tmp_path: Path) -> None:
    states = _states(4)
    store = LocalStore(tmp_path / "store")
    pub = Publisher(store)
    for s in states:
        pub.publish(s)
    target = StateDictTarget({})
    receiver = Receiver(store, target)
    receiver.sync(0)
    scratch = StateDictTarget({})
    staged = receiver.stage(1)
    receiver.preview(staged, scratch, target.state)
    assert _bits(scratch.state) == _bits(states[1]) and _bits(target.state) == _bits(states[0])
    assert scratch.held().version == 1
    receiver.apply(staged)
    buffers = {n: t.data_ptr() for n, t in scratch.state.items()}
    staged = receiver.stage(3)  # two deltas from the version the scratch holds: no copy
    receiver.preview(staged, scratch, target.state)
    assert _bits(scratch.state) == _bits(states[3]) and scratch.held().version == 3
    assert {n: t.data_ptr() for n, t in scratch.state.items()} == buffers
    # not committed: the next staging is against v1 again, and the scratch is copied back first
    staged = receiver.stage(2)
    receiver.preview(staged, scratch, target.state)
    assert _bits(scratch.state) == _bits(states[2]) and _bits(target.state) == _bits(states[1])
    assert {n: t.data_ptr() for n, t in scratch.state.items()} == buffers  # into its buffers


def test_preview_refuses_a_moved_target_and_another_store(tmp_path: Path) -> None:
    states = _states(3)
    stores = [LocalStore(tmp_path / "s0"), LocalStore(tmp_path / "s1")]
    for store in stores:
        pub = Publisher(store)
        for s in states:
            pub.publish(s)
    target = StateDictTarget({})
    receiver = Receiver(stores[0], target)
    receiver.sync(0)
    staged = receiver.stage(1)
    receiver.sync(2)  # the target moved on
    scratch = StateDictTarget({})
    with pytest.raises(BaseMismatch, match="stage it again"):
        receiver.preview(staged, scratch, target.state)
    other = Receiver(stores[1], target).stage(1)
    with pytest.raises(UsageError, match="staged from"):
        receiver.preview(other, scratch, target.state)
    assert scratch.state == {} and _bits(target.state) == _bits(states[2])
