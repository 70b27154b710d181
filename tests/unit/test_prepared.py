"""Prepared segments (codec.prepared): decoded against the held words while staging, scattered in
the pause. They must write exactly the fused kernel's bits, fold the same digest halves, roll
back exactly, refuse what the fused kernel refuses, and refuse a target changed since staging."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from weighthub.codec import Positions, UndoLog, apply_segment, encode_segment
from weighthub.codec.coding import EncodePolicy
from weighthub.codec.prepared import prepare_segment
from weighthub.errors import BaseMismatch, FormatError, IntegrityError
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import MemoryStore
from weighthub.targets import StateDictTarget
from weighthub.tensors import dtype_named

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
    held = old.copy()
    with pytest.raises(FormatError, match=match):
        prepare_segment(edit(seg), held, dtype, "t")
    assert np.array_equal(held, old)  # staging reads only


def test_dense_and_bitmap_segments_are_not_prepared() -> None:
    dtype = dtype_named("BF16")
    old, new = _pair("BF16", 4000, 0.3, seed=3)
    seg = encode_segment(old, new, dtype, tensor=0, start=0, policy=FAST)
    assert seg is not None and seg.positions == Positions.BITMAP
    assert prepare_segment(seg, old, dtype, "t") is None
    dense = encode_segment(None, new, dtype, tensor=0, start=0)
    assert dense is not None and prepare_segment(dense, old, dtype, "t") is None


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
