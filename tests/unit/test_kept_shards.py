"""A publisher's `KeptShards`: resolve takes what it found for a tensor last time while the
tensor keeps its storage, dtype, shape and strides, and finds it again when any of them
changes; the words are always the tensor's own."""

from __future__ import annotations

import numpy as np
import torch

from weighthub.layout import ShardBox
from weighthub.publish import Publisher
from weighthub.publish.shards import KeptShards, resolve
from weighthub.receive import Receiver
from weighthub.store import MemoryStore
from weighthub.targets import StateDictTarget
from weighthub.tensors import bits


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(8, 16, generator=g).to(torch.bfloat16),
            "b": torch.randn(40, generator=g),
            "c": torch.randn(6, 5, generator=g).to(torch.float16).t(),  # strided: a copy
            "d": torch.randn(12, generator=g, requires_grad=True)}


def _same(got: tuple, want: tuple) -> None:
    (gs, gt), (ws, wt) = got, want
    assert gt == wt and list(gs) == list(ws)
    for name, shard in gs.items():
        assert (shard.spec, shard.box) == (ws[name].spec, ws[name].box)
        assert shard.new.dtype == ws[name].new.dtype
        assert np.array_equal(shard.new, ws[name].new)


def test_kept_shards_resolve_as_a_fresh_resolve_and_view_the_tensors() -> None:
    state = _state()
    kept: KeptShards = {}
    first = resolve(state, None, whole=True, kept=kept)
    assert set(kept) == {"a", "b", "d"}  # "c" is strided: its words are a copy, not kept
    again = resolve(state, None, whole=True, kept=kept)
    _same(again, resolve(state, None, whole=True))
    _same(again, first)
    shards = again[0]
    for name in ("a", "b", "d"):  # the tensor's own memory: an in-place step shows through
        assert shards[name].new.ctypes.data == state[name].data_ptr()
    with torch.no_grad():
        state["a"].view(-1)[5] += 1
    assert np.array_equal(resolve(state, None, whole=True, kept=kept)[0]["a"].new, bits(state["a"]))


def test_a_changed_tensor_is_resolved_again_and_gone_names_are_dropped() -> None:
    state = _state()
    kept: KeptShards = {}
    resolve(state, None, whole=True, kept=kept)
    state["a"] = state["a"].clone()  # new storage
    state["b"] = state["b"].to(torch.bfloat16)  # another dtype
    del state["d"]
    shards, table = resolve(state, None, whole=True, kept=kept)
    assert set(kept) == {"a", "b"}
    assert shards["a"].new.ctypes.data == state["a"].data_ptr()
    assert shards["b"].spec.dtype.name == "BF16" and ("b", "BF16", (40,)) in table
    _same((shards, table), resolve(state, None, whole=True))
    box = ShardBox((40,), (0,), (40,))
    with_box = resolve(state, {"b": box}, whole=True, kept=kept)  # a shard_map entry: a new key
    assert with_box[0]["b"].box == box


def test_a_publisher_reusing_its_tensors_stays_bit_exact() -> None:
    """Three versions published from the same tensors changed in place, then from new ones."""
    state = {n: t.detach() for n, t in _state().items()}
    store = MemoryStore()
    pub = Publisher(store)
    target = StateDictTarget({})
    rx = Receiver(store, target)
    for step in range(4):
        if step == 3:
            state = {n: t.clone() for n, t in state.items()}
        for t in state.values():  # in place (the strided one by a column)
            if t.is_contiguous():
                t.view(-1)[step::7] += 1
            else:
                t[..., step] += 1
        pub.publish(state)
        rx.sync()
        assert all(np.array_equal(bits(target.state[n]), bits(t.contiguous()))
                   for n, t in state.items())
