"""Prepared segments (codec.prepared): decoded against the held words while staging, scattered in
the pause. They must write exactly the fused kernel's bits, fold the same digest halves, roll
back exactly, refuse what the fused kernel refuses, and refuse a target changed since staging."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from weighthub.codec import Positions, UndoLog, apply_segment, encode_segment, regap_segment
from weighthub.codec.coding import EncodePolicy
from weighthub.codec.prepared import prepare_segment
from weighthub.codec.segment import Segment
from weighthub.errors import BaseMismatch, FormatError, IntegrityError
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import MemoryStore
from weighthub.targets import StateDictTarget
from weighthub.tensors import DType, dtype_named

FAST = EncodePolicy(groups=False, ctx=False)
CASES = [("BF16", FAST), ("F32", FAST), ("I8", FAST), ("F64", FAST),
         ("BF16", EncodePolicy(groups=False, ctx=False, mask_ops=False))]  # overwrite


def _pair(name: str, n: int, rate: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    dtype = dtype_named(name)
    rng = np.random.default_rng(seed)
    old = rng.integers(0, np.iinfo(dtype.uint).max, n, dtype=dtype.uint, endpoint=True)
    new = old.copy()
    at = rng.random(n) < rate
    new[at] ^= rng.integers(1, 1 << min(8 * dtype.width, 20), int(at.sum())).astype(dtype.uint)
    return old, new


@pytest.mark.parametrize(("name", "policy"), CASES)
@pytest.mark.parametrize("rate", [0.001, 0.01, 0.04])
def test_prepared_writes_and_folds_what_the_fused_kernel_does(name: str, policy: EncodePolicy,
                                                              rate: float) -> None:
    dtype = dtype_named(name)
    old, new = _pair(name, 50_000, rate, seed=int(rate * 1000))
    seg = encode_segment(old, new, dtype, tensor=0, start=777, policy=policy)
    assert seg is not None and seg.positions == Positions.GAPS
    prep = prepare_segment(seg, old, dtype, "t")
    assert prep is not None and prep.pos.size == seg.count
    fused, scattered = old.copy(), old.copy()
    lanes = [np.zeros(2, np.uint64) for _ in range(4)]
    undo_f, undo_s = UndoLog(), UndoLog()
    apply_segment(seg, fused, dtype, undo_f, "t", dnew=lanes[0], dold=lanes[1])
    apply_segment(seg, scattered, dtype, undo_s, "t", dnew=lanes[2], dold=lanes[3], prepared=prep)
    assert np.array_equal(fused, new) and np.array_equal(scattered, new)
    assert np.array_equal(lanes[0], lanes[2]) and np.array_equal(lanes[1], lanes[3])
    undo_s.rollback()
    assert np.array_equal(scattered, old)


def test_a_target_changed_since_staging_is_refused_and_rolled_back() -> None:
    dtype = dtype_named("BF16")
    old, new = _pair("BF16", 20_000, 0.05, seed=1)
    seg = encode_segment(old, new, dtype, tensor=0, start=0, policy=FAST)
    prep = prepare_segment(seg, old, dtype, "t")
    assert seg is not None and prep is not None
    dst = old.copy()
    victim = int(prep.pos[prep.pos.size // 2])
    dst[victim] ^= 1  # someone wrote into the weights after staging
    before = dst.copy()
    undo = UndoLog()
    with pytest.raises(BaseMismatch, match=f"element {victim} of the segment no longer holds"):
        apply_segment(seg, dst, dtype, undo, "t", prepared=prep)
    assert not np.array_equal(dst, before)  # the words before it were written ...
    undo.rollback()
    assert np.array_equal(dst, before)  # ... and are restored exactly


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_staged_words_changed_before_the_pause_are_caught_by_the_seal(where: str) -> None:
    """The digest change was staged too: only the seal shows that the scatter wrote other
    words than those it was computed from (a bug reusing a buffer, a bit flip)."""
    dtype = dtype_named("BF16")
    old, new = _pair("BF16", 20_000, 0.05, seed=4)
    seg = encode_segment(old, new, dtype, tensor=0, start=123, policy=FAST)
    prep = prepare_segment(seg, old, dtype, "t")
    assert seg is not None and prep is not None
    k = {"first": 0, "middle": prep.pos.size // 2, "last": prep.pos.size - 1}[where]
    prep.new[k] ^= 0x0100  # the staged word that will be written, changed in memory
    dst = old.copy()
    undo = UndoLog()
    with pytest.raises(IntegrityError, match="not the ones staged"):
        apply_segment(seg, dst, dtype, undo, "t", prepared=prep)
    undo.rollback()
    assert np.array_equal(dst, old)


def _refused_while_staging(seg: Segment, old: np.ndarray, dtype: DType, match: str) -> None:
    held = old.copy()
    with pytest.raises(FormatError, match=match):
        prepare_segment(seg, held, dtype, "t")
    assert np.array_equal(held, old)  # staging reads only


@pytest.mark.parametrize(("edit", "match"), [
    (lambda s: dataclasses.replace(s, pos_bytes=s.pos_bytes[:-1]), "corrupt segment|-byte gap"),
    (lambda s: dataclasses.replace(s, val_bytes=s.val_bytes[:-1]), "corrupt segment"),
    (lambda s: dataclasses.replace(s, val_bytes=np.concatenate([s.val_bytes, s.val_bytes[:1]])),
     "corrupt segment"),
    (lambda s: dataclasses.replace(s, count=s.count + 1), "corrupt segment|-byte gap"),
    (lambda s: dataclasses.replace(s, count=s.pos_bytes.size + 1), "-byte gap stream"),
    (lambda s: dataclasses.replace(s, pos_bytes=np.concatenate(
        [s.pos_bytes[:-1], np.array([0xFF, 0xFF, 0x7F], np.uint8)])), "corrupt segment"),
])
def test_hostile_streams_are_refused_while_staging(edit, match: str) -> None:  # type: ignore[no-untyped-def]
    dtype = dtype_named("BF16")
    old, new = _pair("BF16", 4000, 0.05, seed=2)
    seg = encode_segment(old, new, dtype, tensor=0, start=0, policy=FAST)
    assert seg is not None and seg.positions == Positions.GAPS
    _refused_while_staging(edit(seg), old, dtype, match)


def _float_pair(name: str, n: int, rate: float, kind: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Trained-weight-like words changed by ±1 ulp ("add") or in their low mantissa bits
    ("xor"), large ones far more often (as updates scaled by the weight), so the old exponents
    carry context and the encoder picks a context coding."""
    dtype = dtype_named(name)
    g = torch.Generator().manual_seed(seed)
    floats = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16 if name == "BF16" else torch.float32)
    old = floats.view(torch.int16 if name == "BF16" else torch.int32).numpy().view(dtype.uint).copy()
    rng = np.random.default_rng(seed)
    large = floats.float().abs().numpy() > 0.03
    at = np.flatnonzero(rng.random(n) < np.where(large, 4 * rate, rate / 10))
    new = old.copy()
    if kind == "add":
        new[at] += rng.choice(np.array([1, np.iinfo(dtype.uint).max], dtype.uint), at.size)
    else:
        new[at] ^= rng.integers(1, 1 << 6, at.size).astype(dtype.uint)
    return old, new


@pytest.mark.parametrize("coder", ["ans", "range"])
@pytest.mark.parametrize("kind", ["add", "xor"])
@pytest.mark.parametrize("name", ["BF16", "F32"])
def test_context_coded_segments_prepare_straight_from_their_coder(coder: str, kind: str,
                                                                  name: str) -> None:
    """Staging places a ctx/ans segment's changes straight into prepared words: the same
    arrays, digest halves, seal and written bits as preparing its re-coding as plain gaps."""
    dtype = dtype_named(name)
    old, new = _float_pair(name, 60_000, 0.03, kind, seed=len(coder) + len(kind))
    seg = encode_segment(old, new, dtype, tensor=0, start=4321, policy=EncodePolicy(coder=coder))
    assert seg is not None and seg.positions == (Positions.ANS if coder == "ans" else Positions.CTX)
    direct = prepare_segment(seg, old, dtype, "t")
    via_gaps = prepare_segment(regap_segment(seg, old, dtype, "t"), old, dtype, "t")
    assert direct is not None and via_gaps is not None
    for field in ("pos", "old", "new", "old_lanes", "new_lanes"):
        assert np.array_equal(getattr(direct, field), getattr(via_gaps, field)), field
    assert (direct.seal, direct.first, direct.numel) == (via_gaps.seal, via_gaps.first, via_gaps.numel)
    dst, undo = old.copy(), UndoLog()
    apply_segment(seg, dst, dtype, undo, "t", prepared=direct)
    assert np.array_equal(dst, new)
    undo.rollback()
    assert np.array_equal(dst, old)


@pytest.mark.parametrize(("edit", "match"), [
    (lambda s: dataclasses.replace(s, pos_bytes=s.pos_bytes[: s.pos_bytes.size // 2]),
     "corrupt segment: a context-coded stream"),
    (lambda s: dataclasses.replace(s, val_bytes=s.val_bytes[:-3]),
     "corrupt segment: a context-coded stream"),
    (lambda s: dataclasses.replace(s, count=s.count + 1), "corrupt segment: a context-coded stream"),
    (lambda s: dataclasses.replace(s, count=10**9), "1000000000 changes in a range of 20000"),
])
def test_hostile_context_coded_streams_are_refused_while_staging(edit, match: str) -> None:  # type: ignore[no-untyped-def]
    dtype = dtype_named("BF16")
    old, new = _float_pair("BF16", 20_000, 0.03, "add", seed=5)
    seg = encode_segment(old, new, dtype, tensor=0, start=0, policy=EncodePolicy())
    assert seg is not None and seg.positions == Positions.ANS
    _refused_while_staging(edit(seg), old, dtype, match)


def test_dense_segments_are_not_prepared() -> None:
    dtype = dtype_named("BF16")
    old, new = _pair("BF16", 4000, 0.3, seed=3)
    dense = encode_segment(None, new, dtype, tensor=0, start=0)
    assert dense is not None and prepare_segment(dense, old, dtype, "t") is None


@pytest.mark.parametrize("policy", [FAST, EncodePolicy(groups=False, ctx=False, mask_ops=False)])
@pytest.mark.parametrize("name", ["BF16", "F32"])
def test_bitmap_segments_are_prepared_as_the_fused_kernel_applies_them(name: str,
                                                                      policy: EncodePolicy) -> None:
    dtype = dtype_named(name)
    old, new = _pair(name, 30_000, 0.3, seed=3)
    seg = encode_segment(old, new, dtype, tensor=0, start=99, policy=policy)
    assert seg is not None and seg.positions == Positions.BITMAP
    prep = prepare_segment(seg, old, dtype, "t")
    assert prep is not None and np.array_equal(prep.pos, np.flatnonzero(old != new))
    fused, scattered = old.copy(), old.copy()
    lanes = [np.zeros(2, np.uint64) for _ in range(4)]
    apply_segment(seg, fused, dtype, UndoLog(), "t", dnew=lanes[0], dold=lanes[1])
    undo = UndoLog()
    apply_segment(seg, scattered, dtype, undo, "t", dnew=lanes[2], dold=lanes[3], prepared=prep)
    assert np.array_equal(fused, new) and np.array_equal(scattered, new)
    assert np.array_equal(lanes[0], lanes[2]) and np.array_equal(lanes[1], lanes[3])
    undo.rollback()
    assert np.array_equal(scattered, old)


def _flip_last_bit(a: np.ndarray) -> np.ndarray:
    out = a.copy()
    out[-1] ^= 0x80
    return out


@pytest.mark.parametrize(("edit", "match"), [
    (lambda s: dataclasses.replace(s, pos_bytes=s.pos_bytes[:-1]), "bitmap of"),
    (lambda s: dataclasses.replace(s, pos_bytes=_flip_last_bit(s.pos_bytes)), "padding bits"),
    (lambda s: dataclasses.replace(s, count=s.count - 1), "bitmap has"),
    (lambda s: dataclasses.replace(s, val_bytes=s.val_bytes[:-1]), "corrupt segment"),
    (lambda s: dataclasses.replace(s, val_bytes=np.concatenate([s.val_bytes, s.val_bytes[:1]])),
     "corrupt segment"),
])
def test_hostile_bitmap_segments_are_refused_while_staging(edit, match: str) -> None:  # type: ignore[no-untyped-def]
    dtype = dtype_named("BF16")
    old, new = _pair("BF16", 4003, 0.3, seed=6)  # 4003: the bitmap's last byte has padding
    seg = encode_segment(old, new, dtype, tensor=0, start=0, policy=FAST)
    assert seg is not None and seg.positions == Positions.BITMAP
    _refused_while_staging(edit(seg), old, dtype, match)


def test_receiver_stages_prepared_words_and_refuses_weights_changed_meanwhile() -> None:
    g = torch.Generator().manual_seed(0)
    s0 = {"a": torch.randn(300, 64, generator=g).to(torch.bfloat16),
          "b": torch.randn(4096, generator=g)}
    s1 = {k: v.clone() for k, v in s0.items()}
    for v in s1.values():
        flat = v.view(-1)
        flat[::37] = flat[::37] * 1.01 + 1e-3
    store = MemoryStore()
    pub = Publisher(store)
    pub.publish(s0)
    pub.publish(s1)
    target = StateDictTarget({k: v.clone() for k, v in s0.items()})
    rx = Receiver(store, target)
    rx.sync(0)
    staged = rx.stage(1)
    first = staged._steps[0].chunks
    assert any(c.prepared and any(p is not None for p in c.prepared) for c in first)
    target.state["a"].view(torch.int16).view(-1)[37] ^= 1  # behind the receiver's back
    with pytest.raises(BaseMismatch, match="no longer holds the word it held when the version was staged"):
        rx.apply(staged)
    assert rx.version == 0
    target.state["a"].view(torch.int16).view(-1)[37] ^= 1  # put back: the bits are v0's again
    assert all(torch.equal(target.state[k].view(torch.int16 if k == "a" else torch.int32),
                           s0[k].view(torch.int16 if k == "a" else torch.int32)) for k in s0)
    rx.apply(rx.stage(1))
    assert rx.version == 1
    assert all(torch.equal(target.state[k].view(torch.int16 if k == "a" else torch.int32),
                           s1[k].view(torch.int16 if k == "a" else torch.int32)) for k in s1)


def test_receiver_prepares_context_coded_chunks_without_recoding_them() -> None:
    """A compact-coded version stages as prepared words straight from the ans streams (the
    staged frame keeps its ans segments: nothing re-coded as gaps) and applies bit-exactly."""
    old, new = _float_pair("BF16", 200_000, 0.03, "add", seed=9)
    s0 = {"w": torch.from_numpy(old.view(np.int16)).view(torch.bfloat16).reshape(400, 500)}
    s1 = {"w": torch.from_numpy(new.view(np.int16)).view(torch.bfloat16).reshape(400, 500)}
    store = MemoryStore()
    pub = Publisher(store, policy=EncodePolicy())
    pub.publish(s0)
    pub.publish(s1)
    target = StateDictTarget({"w": s0["w"].clone()})
    rx = Receiver(store, target)
    rx.sync(0)
    staged = rx.stage(1)
    segs = [(seg, prep) for c in staged._steps[0].chunks
            for seg, prep in zip(c.frame.segments, c.prepared or [None] * len(c.frame.segments),
                                 strict=True)]
    assert segs and all(seg.positions == Positions.ANS and prep is not None for seg, prep in segs)
    rx.apply(staged)
    assert rx.version == 1
    assert np.array_equal(target.state["w"].view(torch.int16).numpy().ravel(), new.view(np.int16))


@pytest.mark.parametrize("count", [0, 1, 17, 4095, 4096, 9000])  # both sides of _SEALED_SCATTER
@pytest.mark.parametrize("stale_at", [None, 0, "last"])
def test_short_and_long_segments_scatter_and_seal_alike(count: int, stale_at: object) -> None:
    """A short segment is scattered and sealed in one kernel (`scatter_sealed`), a long one by
    the scatter and a vectorized seal: the same words, the same count done, the same seal, and
    a word changed since staging stops both at it."""
    from weighthub.codec.prepared import scatter_prepared, scatter_sealed, seal_of

    rng = np.random.default_rng(count)
    n = 3 * count + 10
    base = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    pos = np.sort(rng.choice(n, count, replace=False)).astype(np.int64)
    old = base[pos].copy()
    new = (old ^ rng.integers(1, 1 << 16, count, dtype=np.uint16)).astype(np.uint16)
    stop = {None: count, 0: 0, "last": max(count - 1, 0)}[stale_at]  # type: ignore[index]
    if stale_at is not None and count:
        base[pos[stop]] ^= 1  # changed behind the receiver's back
    a, b = base.copy(), base.copy()
    done_a, seal_a = scatter_sealed(a, pos, old, new, 777)
    done_b = scatter_prepared(b, pos, old, new)
    assert done_a == done_b == (stop if count else 0)
    assert np.array_equal(a.view(np.int16), b.view(np.int16))
    assert int(seal_a) == int(seal_of(pos[:done_a], new[:done_a], 777))
