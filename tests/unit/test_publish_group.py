"""A group of two ranks (threads sharing one process) runs the publisher pipeline without
torch.distributed: the same code the single-process Publisher runs (the group of one) commits
deltas, anchors and skip deltas from row-sharded and column-sharded (boxed) tensors, digest for
digest what one process publishes, and receivers that route through any of them end bit-exact.
The gloo-process version of this, with DTensors, is tests/integration/test_sharded_publish.py."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from store_golden import masked_objects
from weighthub import catalog
from weighthub.layout import ShardBox
from weighthub.publish import Publisher, PublishOptions, PublishResult, ShardedPublisher
from weighthub.receive import Receiver
from weighthub.store.memory import MemoryStore
from weighthub.targets import StateDictTarget
from weighthub.tensors import bits

SPAN = 4096
WORLD = 2
WAIT_S = 60.0


class ThreadGroup:
    """The collective seam (publish.group.Group) for ranks that are threads of one process."""

    def __init__(self, shared: dict[str, Any], rank: int) -> None:
        self.shared, self.rank, self.world = shared, rank, WORLD

    def all_gather(self, obj: Any, doing: str) -> list[Any]:
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = obj
        barrier.wait(WAIT_S)
        out = list(slots)
        barrier.wait(WAIT_S)  # nobody overwrites a slot before every rank has read them all
        return out

    def broadcast(self, obj: Any, src: int, doing: str) -> Any:
        return self.all_gather(obj, doing)[src]


def _states() -> list[dict[str, torch.Tensor]]:
    """Step 3 rewrites a lot and step 4 undoes most of it: the skip delta 2 → 4 is the cheap route."""
    g = torch.Generator().manual_seed(5)
    s = {"cols.weight": torch.randn(24, 40, generator=g).to(torch.bfloat16),
         "rows.weight": torch.randn(50, 30, generator=g),
         "bias": torch.randn(13, generator=g).to(torch.float16)}
    out = [s]
    for step in range(1, 7):
        prev = out[2] if step == 4 else out[-1]
        nxt = {n: t.clone() for n, t in prev.items()}
        for t in nxt.values():
            w = t.view(torch.int16 if t.element_size() == 2 else torch.int32).reshape(-1)
            rate = 0.6 if step == 3 else 0.02
            hit = torch.rand(w.numel(), generator=g) < rate
            w[hit] += 1
        out.append(nxt)
    return out


def _boxes(rank: int) -> dict[str, ShardBox]:
    return {"cols.weight": ShardBox((24, 40), (0, 20 * rank), (24, 20)),  # column shards: boxed
            "rows.weight": ShardBox((50, 30), (25 * rank, 0), (25, 30)),  # row shards: ranges
            "bias": ShardBox((13,), (0,), (13,), primary=rank == 0)}  # a replica


def _local(state: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    return {n: state[n][b.slices].clone() for n, b in _boxes(rank).items()}


def _group_publish(store: MemoryStore, opts: PublishOptions) -> list[list[PublishResult]]:
    shared: dict[str, Any] = {"slots": [None] * WORLD, "barrier": threading.Barrier(WORLD)}
    results: list[list[PublishResult]] = [[] for _ in range(WORLD)]
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        pub = ShardedPublisher.on_group(store, ThreadGroup(shared, rank), options=opts)
        try:
            for state in _states():
                results[rank].append(pub.publish(_local(state, rank), shard_map=_boxes(rank)))
        except BaseException as exc:
            errors.append(exc)
            shared["barrier"].abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 4)
    assert not errors, errors
    return results


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(bits(a[n]), bits(b[n])) for n in a)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_group_publishes_what_one_process_does_with_anchors_and_skip_deltas(backend: str) -> None:
    """backend "torch": every rank scans its shards with the device code (row ranges and
    column boxes), as CUDA trainer ranks do; the result is the single host process's."""
    opts = PublishOptions(anchor_every=3, skip_every=2, delta_span_bytes=SPAN,
                          full_span_bytes=SPAN, workers=2, backend=backend)
    grouped, single = MemoryStore(), MemoryStore()
    results = _group_publish(grouped, opts)
    assert [r.version for r in results[0]] == [r.version for r in results[1]] == list(range(7))
    solo = Publisher(single, anchor_every=3, skip_every=2, delta_span_bytes=SPAN,
                     full_span_bytes=SPAN)
    for state in _states():
        solo.publish(state)
    if backend == "torch":  # byte for byte what the same group stores from host scans
        on_host = MemoryStore()
        _group_publish(on_host, replace(opts, backend="host"))
        assert masked_objects(grouped) == masked_objects(on_host)
    for v in range(7):
        reps = {r.base for r in catalog.representations(grouped, v)}
        assert reps == {r.base for r in catalog.representations(single, v)}, v
        mg, ms = catalog.primary_manifest(grouped, v), catalog.primary_manifest(single, v)
        assert (mg.root, mg.base, mg.changed) == (ms.root, ms.base, ms.changed), v
        for r in catalog.representations(grouped, v):  # extras carry the version's digests
            m = catalog.read_manifest(grouped, r.key)
            assert m.root == mg.root and [t.digest for t in m.tensors] == [
                t.digest for t in mg.tensors], (v, r.key)
    assert {r.base for r in catalog.representations(grouped, 4)} == {3, 2}  # skip delta 2 → 4
    assert {r.base for r in catalog.representations(grouped, 6)} == {5, 4, None}  # skip + anchor
    states = _states()
    # a receiver at 2 routes through the skip delta; a newcomer starts from the anchor at 3
    held = StateDictTarget({})
    rx = Receiver(grouped, held)
    rx.sync(2)
    assert [r.base for r in catalog.plan(grouped, 2, 4)] == [2]
    rx.sync(4)
    assert _same_bits(held.state, states[4])
    assert [r.base for r in catalog.plan(grouped, None, 3)] == [None]
    newcomer = StateDictTarget({})
    Receiver(grouped, newcomer).sync(5)
    assert _same_bits(newcomer.state, states[5])
