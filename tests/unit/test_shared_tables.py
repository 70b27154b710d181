"""Chunks of many small ranges share one zstd table: `compact` codes them as order-0 streams.

Context-coding each small range on its own (its adaptive models start from nothing in every
segment) cost 14-24% more bytes than `fast` on models of thousands of 2-4k-element tensors;
`publish.stream.chunk_policy` sets `EncodePolicy.shared_tables` for such chunks, and chunks of
large ranges (where a few small ones' streams go raw) or of one small range keep the choice by
what each range writes.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import weighthub.publish.stream as stream_mod
from store_golden import masked_objects
from weighthub.codec import Positions, encode_segment
from weighthub.codec.coding import ENCODE_PROFILES, EncodePolicy
from weighthub.layout import Piece
from weighthub.publish import Publisher
from weighthub.publish.shards import whole_box
from weighthub.publish.stream import chunk_policy
from weighthub.receive import Receiver
from weighthub.store import MemoryStore
from weighthub.targets import StateDictTarget
from weighthub.tensors import DTYPE_BY_NAME, bits

COMPACT, FAST = ENCODE_PROFILES["compact"], ENCODE_PROFILES["fast"]
BF16 = DTYPE_BY_NAME["BF16"]


def _pieces(*sizes: int) -> list[Piece]:
    return [Piece(i, whole_box((n,)), 0, n) for i, n in enumerate(sizes)]


@pytest.mark.parametrize(("sizes", "shared"), [
    ((4096,) * 8, True),  # eight small tensors
    ((4096,) * 7, False),  # too few to amortize a table
    ((4096,) * 8 + (40_000,), False),  # most elements in a large range: its context coding wins
    ((4096,) * 10 + (40_000,), True),
    ((4096,), False),  # one range pays a table of its own
    ((4097,) * 20, False),  # not small: compared by estimates that count their tables
])
def test_the_chunk_shares_tables_where_most_of_it_is_small_ranges(sizes: tuple[int, ...],
                                                                 shared: bool) -> None:
    assert chunk_policy(_pieces(*sizes), COMPACT).shared_tables is shared


def test_a_policy_without_context_coding_or_already_shared_is_kept() -> None:
    small = _pieces(*(512,) * 64)
    for policy in (FAST, ENCODE_PROFILES["grouped"], replace(COMPACT, shared_tables=True)):
        assert chunk_policy(small, policy) is policy


def _pair(n: int, rate: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    old = (rng.standard_normal(n).astype(np.float32) * 0.05).view(np.uint32) >> 16
    old = old.astype(np.uint16)
    new = old.copy()
    hit = rng.random(n) < rate
    new[hit] += rng.integers(-2, 3, int(hit.sum())).astype(np.uint16)
    return old, new


def test_a_small_range_is_context_coded_only_where_it_writes_alone() -> None:
    """The same 4096-element range at 3% changed: context-coded when its streams would be
    written as they are, order-0 when they share a table."""
    old, new = _pair(4096, 0.03, 1)
    alone = encode_segment(old, new, BF16, tensor=0, start=0, policy=COMPACT)
    shared = encode_segment(old, new, BF16, tensor=0, start=0,
                            policy=replace(COMPACT, shared_tables=True))
    assert alone is not None and shared is not None
    assert alone.positions == Positions.ANS
    assert shared.positions == Positions.GAPS and shared.count == alone.count


def _model(tensors: int, elements: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"experts.{i}.w": (torch.randn(elements, generator=g) * 0.05).to(torch.bfloat16)
            for i in range(tensors)}


def _step(state: dict[str, torch.Tensor], rate: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {n: t.clone() for n, t in state.items()}
    for t in out.values():
        words = t.view(torch.int16)
        hit = torch.rand(words.shape, generator=g) < rate
        words[hit] += torch.randint(-2, 3, (int(hit.sum()),), generator=g, dtype=torch.int16)
    return out


@pytest.mark.parametrize("rate", [0.02, 0.05])
def test_compact_never_sends_more_than_fast_on_many_small_tensors(
        rate: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """256 tensors of 4096 elements: `compact` codes them as `fast` does (order-0 streams under
    one table per chunk), where context-coding each (chunks deciding nothing) cost more bytes
    than `fast`; receivers end bit-exact. (At 10% changed a step, context-coding each was 2%
    smaller: RL steps change 0.3-5%.)"""
    states = [_model(256, 4096, 0)]
    for seed in (1, 2):
        states.append(_step(states[-1], rate, seed))

    def payloads(policy: EncodePolicy) -> list[int]:
        store = MemoryStore()
        pub = Publisher(store, policy=policy)
        sizes = [pub.publish(s).payload_bytes for s in states][1:]
        target = StateDictTarget({})
        Receiver(store, target).sync(2)
        assert all(np.array_equal(bits(target.state[n]), bits(t)) for n, t in states[2].items())
        return sizes

    compact, fast = payloads(COMPACT), payloads(FAST)
    with monkeypatch.context() as m:
        m.setattr(stream_mod, "chunk_policy", lambda pieces, policy: policy)
        alone = payloads(COMPACT)
    assert all(c <= f for c, f in zip(compact, fast, strict=True)), (compact, fast)
    assert all(c < 0.95 * a for c, a in zip(compact, alone, strict=True)), (compact, alone)


def test_the_device_scan_writes_the_same_frames() -> None:
    """chunk_policy decides from pieces, so a trainer scanning on a device (the torch code, here
    on CPU tensors) stores the host scan's bytes, shared tables and all."""
    states = [_model(64, 4096, 3)]
    states.append(_step(states[-1], 0.02, 4))
    stores = []
    for backend in ("host", "torch"):
        store = MemoryStore()
        pub = Publisher(store, backend=backend)
        for s in states:
            pub.publish(s)
        stores.append(masked_objects(store))
    assert stores[0] == stores[1]
