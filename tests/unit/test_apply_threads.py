"""How many threads apply a step (`receive.apply.apply_threads`): one for a delta whose tensors
change few words each (two threads would spend more on GIL hand-overs than they gain), every
worker otherwise; the bits are the same either way."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import weighthub.receive.apply as apply_mod
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import MemoryStore
from weighthub.targets import StateDictTarget


@pytest.mark.parametrize(("every", "backend", "threads"), [
    (64, "auto", 1),  # 64 changes a tensor: one thread
    (2, "auto", 2),  # 2048 a tensor: both
    (64, "torch", 2),  # device words keep every worker
])
def test_the_apply_threads_follow_the_changes_per_tensor(every: int, backend: str, threads: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(every)
    state = {f"t{i}": torch.randn(4096, generator=gen).to(torch.bfloat16) for i in range(8)}
    store = MemoryStore()
    pub = Publisher(store, delta_span_bytes=8192)  # one tensor per chunk
    pub.publish(state)
    for t in state.values():
        t.view(torch.int16)[::every] += 1
    pub.publish(state)
    pools: list[int] = []

    class Recording(ThreadPoolExecutor):
        def __init__(self, max_workers: int) -> None:
            pools.append(max_workers)
            super().__init__(max_workers)

    target = StateDictTarget({}, backend=backend)
    rx = Receiver(store, target, apply_workers=2)
    monkeypatch.setattr(apply_mod, "ThreadPoolExecutor", Recording)
    rx.sync(0)
    rx.sync(1)
    assert pools == [2, threads]  # the full version on both; the delta as its changes say
    assert all(torch.equal(target.state[k].view(torch.int16), v.view(torch.int16))
               for k, v in state.items())
