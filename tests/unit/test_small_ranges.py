"""Small ranges coded in bulk (codec.small): the same segments, bytes and digest changes as
encode_segment_tracked gives range by range, in one kernel call per chunk and dtype."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import weighthub.codec.small as small_mod
import weighthub.publish.stream as stream_mod
from store_golden import masked_objects
from weighthub.codec import Segment
from weighthub.codec.coding import ENCODE_PROFILES, EncodePolicy
from weighthub.codec.encode import SMALL_RANGE, encode_segment_tracked
from weighthub.codec.small import SmallRange, bulk_ready, codes_in_bulk, encode_small
from weighthub.errors import UsageError
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import MemoryStore
from weighthub.targets import StateDictTarget
from weighthub.tensors import DTYPES, DType, bits

POLICIES = {
    "fast": ENCODE_PROFILES["fast"],
    "compact": ENCODE_PROFILES["compact"],  # float ranges context-coded (ans) where smaller
    "compact-shared": replace(ENCODE_PROFILES["compact"], shared_tables=True),
    "grouped": ENCODE_PROFILES["grouped"],
    "overwrite-only": EncodePolicy(mask_ops=False, ctx=False),
    # a few changes already make grouped positions a candidate (those ranges fall back), and
    # the value coding is chosen from every 7th pair
    "sampled-grouping": EncodePolicy(ctx=False, value_sample=7, min_group_count=20),
}


def _same(a: Segment | None, b: Segment | None) -> bool:
    if a is None or b is None:
        return a is b
    return ((a.tensor, a.start, a.stop, a.op, a.positions, a.values, a.count)
            == (b.tensor, b.start, b.stop, b.op, b.positions, b.values, b.count)
            and np.array_equal(a.pos_bytes, b.pos_bytes)
            and np.array_equal(a.val_bytes, b.val_bytes))


def _ranges(dtype: DType, count: int, seed: int) -> list[SmallRange]:
    """Random words; per range a size up to SMALL_RANGE, a change rate from none to all, and
    changes of one kind (+1, random xor, -3)."""
    rng = np.random.default_rng(seed)
    u = dtype.uint
    top = np.iinfo(u).max
    out = []
    for t in range(count):
        n = int(rng.integers(1, SMALL_RANGE + 1))
        old = rng.integers(0, top, n, dtype=u, endpoint=True)
        new = old.copy()
        hit = rng.random(n) < rng.choice([0.0, 0.001, 0.02, 0.1, 0.5, 1.0])
        kind = int(rng.integers(0, 3))
        if kind == 0:
            new[hit] += u(1)
        elif kind == 1:
            new[hit] ^= rng.integers(0, top, int(hit.sum()), dtype=u, endpoint=True)
        else:
            new[hit] -= u(3)
        out.append(SmallRange(t, int(rng.integers(0, 1 << 40)), old, new))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_bulk_coding_is_the_range_by_range_coding(dtype: DType, policy: str) -> None:
    pol = POLICIES[policy]
    assert codes_in_bulk(pol, dtype)
    ranges = _ranges(dtype, 40, hash((dtype.name, policy)) % 2**32)
    got = encode_small(ranges, dtype, pol)
    assert len(got) == len(ranges)
    for r, (seg, change) in zip(ranges, got, strict=True):
        want, want_change = encode_segment_tracked(r.old, r.new, dtype, tensor=r.tensor,
                                                   start=r.start, policy=pol)
        assert _same(seg, want), (r.new.size, seg, want)
        assert change == want_change


def test_the_codings_each_outcome_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """No change, sparse gaps, a bitmap and dense (nothing smaller) in one call; a range handed
    back to encode_range where grouped positions are a candidate."""
    bf16 = DTYPES[0]
    rng = np.random.default_rng(5)
    old = rng.integers(0, 1 << 16, (5, 4096), dtype=np.uint16)
    new = old.copy()
    new[1, ::100] += 1  # 41 changes: gaps
    new[2, ::4] += 1  # 1 in 4: a bitmap
    new[3] = rng.integers(0, 1 << 16, 4096, dtype=np.uint16)  # all of it: dense
    new[4, ::8] += 1  # 512 changes ≥ min_group_count: encode_range decides
    ranges = [SmallRange(i, 0, old[i], new[i]) for i in range(5)]
    handed_back: list[int] = []

    def one_range(*args, **kwargs):  # type: ignore[no-untyped-def]
        handed_back.append(kwargs["tensor"])
        return encode_segment_tracked(*args, **kwargs)

    monkeypatch.setattr(small_mod, "encode_segment_tracked", one_range)
    got = [seg for seg, _ in encode_small(ranges[:4], bf16, ENCODE_PROFILES["fast"])]
    assert got[0] is None
    assert [s.positions.name for s in got[1:]] == ["GAPS", "BITMAP", "ALL"]
    assert handed_back == []
    # with grouped positions allowed, from 256 changes on
    few, many = (seg for seg, _ in encode_small([ranges[1], ranges[4]], bf16,
                                                ENCODE_PROFILES["grouped"]))
    assert handed_back == [4] and many is not None and many.count == 512
    assert few is not None and few.positions.name == "GAPS"


def test_small_float_ranges_are_context_coded_in_bulk_where_smaller() -> None:
    """Under `compact`, a bf16 range of trained-looking weights with a few ulp changes codes
    `ans` in the bulk call, as range by range; the range coder's ranges are refused."""
    bf16 = DTYPES[0]
    rng = np.random.default_rng(9)
    old = bits(torch.randn(4000, dtype=torch.bfloat16) * 0.02).copy()
    new = old.copy()
    hit = rng.random(old.size) < 0.05
    new[hit] ^= rng.integers(1, 4, int(hit.sum())).astype(np.uint16)
    ranges = [SmallRange(0, 3, old, new)]
    (seg, change), = encode_small(ranges, bf16, ENCODE_PROFILES["compact"])
    want, want_change = encode_segment_tracked(old, new, bf16, tensor=0, start=3,
                                               policy=ENCODE_PROFILES["compact"])
    assert seg is not None and seg.positions.name == "ANS" and _same(seg, want)
    assert change == want_change
    with pytest.raises(UsageError, match="range"):
        encode_small(ranges, bf16, replace(ENCODE_PROFILES["compact"], coder="range"))
    assert not codes_in_bulk(replace(ENCODE_PROFILES["compact"], coder="range"), bf16)


def test_bad_ranges_are_not_taken() -> None:
    a = np.zeros(100, np.uint16)
    assert bulk_ready(a, a.copy())
    assert not bulk_ready(a[::2], a[::2].copy())  # strided
    assert not bulk_ready(a, np.zeros(99, np.uint16))
    assert not bulk_ready(a, np.zeros(100, np.uint32))
    assert not bulk_ready(np.zeros(SMALL_RANGE + 1, np.uint16), np.zeros(SMALL_RANGE + 1, np.uint16))
    assert not bulk_ready(a[:0], a[:0])
    assert encode_small([], DTYPES[0], ENCODE_PROFILES["fast"]) == []
    with pytest.raises(UsageError, match="width"):
        encode_small([SmallRange(0, 0, np.zeros(4, np.uint32), np.ones(4, np.uint32))], DTYPES[0],
                     ENCODE_PROFILES["fast"])


def _model(seed: int) -> dict[str, torch.Tensor]:
    """Small tensors of several dtypes beside a large one (coded range by range)."""
    g = torch.Generator().manual_seed(seed)
    out = {f"e.{i}.w": torch.randn(int(torch.randint(1, 4097, (1,), generator=g)),
                                   generator=g).to(torch.bfloat16) for i in range(40)}
    out |= {f"n.{i}": torch.randn(384, generator=g) for i in range(10)}  # f32
    out["steps"] = torch.randint(0, 1000, (3,), generator=g)
    out["big"] = torch.randn(100_000, generator=g).to(torch.bfloat16)
    return out


def _step(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {n: t.clone() for n, t in state.items()}
    for t in out.values():
        w = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
        w[torch.rand(w.shape, generator=g) < 0.03] += 1
    return out


@pytest.mark.parametrize("policy", ["fast", "compact"])
def test_a_publisher_stores_the_bytes_it_stored_range_by_range(
        policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    states = [_model(0)]
    for seed in (1, 2, 3):
        states.append(_step(states[-1], seed))

    def publish() -> MemoryStore:
        store = MemoryStore()
        pub = Publisher(store, policy=ENCODE_PROFILES[policy], delta_span_bytes=64 << 10)
        for s in states:
            pub.publish(s)
        return store

    bulk = publish()
    with monkeypatch.context() as m:
        m.setattr(stream_mod, "coded_in_bulk", lambda *a: {})
        one_by_one = publish()
    assert masked_objects(bulk) == masked_objects(one_by_one)
    target = StateDictTarget({})
    Receiver(bulk, target).sync(3)
    assert all(np.array_equal(bits(target.state[n]), bits(t)) for n, t in states[3].items())
