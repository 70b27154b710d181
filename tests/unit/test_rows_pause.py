"""The pause's bulk scatter (codec.prepared_many.apply_prepared_rows): a chunk's small segments
staged in bulk are written in one call, with apply_prepared's checks (the held word, the seal)
and one undo entry that restores exactly, and a receiver using it ends bit-exact or rolls back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import weighthub.receive.apply as apply_mod
from weighthub.codec import Segment, UndoLog, encode_segment
from weighthub.codec.coding import ENCODE_PROFILES
from weighthub.codec.prepared import PreparedSegment, apply_prepared
from weighthub.codec.prepared_many import (
    PreparedGroup,
    apply_prepared_rows,
    gap_coded,
    prepare_gap_segments,
    row_changes,
)
from weighthub.digest import lanes_digest
from weighthub.errors import ApplyError, BaseMismatch, IntegrityError
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import MemoryStore
from weighthub.targets import StateDictTarget
from weighthub.tensors import DTYPES, DType, bits

FAST = ENCODE_PROFILES["fast"]


def _staged(dtype: DType, seed: int, n: int = 40) -> tuple[list[Segment], list[np.ndarray],
                                                             list[PreparedSegment]]:
    """n gap-coded segments of random small ranges, their held words and their bulk staging."""
    rng = np.random.default_rng(seed)
    u = dtype.uint
    top = np.iinfo(u).max
    segs, bases = [], []
    while len(segs) < n:
        size = int(rng.integers(1, 4000))
        old = rng.integers(0, top, size, dtype=u, endpoint=True)
        new = old.copy()
        hit = rng.random(size) < rng.choice([0.01, 0.05, 0.3])
        new[hit] += u(1) if len(segs) % 2 else rng.integers(0, top, int(hit.sum()), dtype=u,
                                                            endpoint=True)
        seg = encode_segment(old, new, dtype, tensor=len(segs), start=int(rng.integers(0, 99)),
                             policy=FAST)
        if seg is not None and gap_coded(seg):
            segs.append(seg)
            bases.append(old)
    preps = prepare_gap_segments(segs, bases, dtype, "chunk x")
    assert all(isinstance(p, PreparedSegment) for p in preps)
    return segs, bases, preps  # type: ignore[return-value]


def _rows(preps: list[PreparedSegment], dsts: list[np.ndarray]) -> tuple[PreparedGroup,
                                                                          np.ndarray, np.ndarray]:
    group = preps[0].group
    assert group is not None and all(p.group is group for p in preps)
    return (group, np.array([p.row for p in preps], np.int64),
            np.array([d.ctypes.data for d in dsts], np.int64))


@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
def test_rows_write_what_segment_by_segment_writes_and_undo_restores(dtype: DType) -> None:
    _segs, bases, preps = _staged(dtype, 7 + DTYPES.index(dtype))
    pick = [*range(0, len(preps), 2), 1]  # a subset, not in row order
    bulk = [bases[i].copy() for i in pick]
    one = [bases[i].copy() for i in pick]
    group, rows, dsts = _rows([preps[i] for i in pick], bulk)
    undo = UndoLog()
    apply_prepared_rows(group, rows, dsts, bulk, undo, "chunk x")
    for i, dst in zip(pick, one, strict=True):
        apply_prepared(preps[i], dst, UndoLog(), "chunk x")
    assert all(np.array_equal(a, b) for a, b in zip(bulk, one, strict=True))
    assert any(not np.array_equal(a, bases[i]) for a, i in zip(bulk, pick, strict=True))
    assert row_changes(group, rows) == [
        lanes_digest(preps[i].new_lanes - preps[i].old_lanes) for i in pick]
    assert undo.nbytes == sum(preps[i].pos.nbytes + preps[i].old.nbytes for i in pick)
    undo.rollback()
    assert all(np.array_equal(a, bases[i]) for a, i in zip(bulk, pick, strict=True))


def test_a_word_changed_since_staging_stops_the_rows_and_undo_restores_them() -> None:
    bf16 = DTYPES[0]
    _segs, bases, preps = _staged(bf16, 3)
    dsts = [b.copy() for b in bases]
    victim = 17
    p = preps[victim]
    at = int(p.pos[p.pos.size // 2])
    dsts[victim][at] ^= 1  # behind the receiver's back
    before = [d.copy() for d in dsts]
    group, rows, addresses = _rows(preps, dsts)
    undo = UndoLog()
    with pytest.raises(BaseMismatch, match=f"element {at} of the segment at element {p.first} "
                                           "no longer holds the word"):
        apply_prepared_rows(group, rows, addresses, dsts, undo, "chunk x")
    assert not np.array_equal(dsts[0], before[0])  # the rows before it were written
    assert np.array_equal(dsts[victim + 1], before[victim + 1])  # none after it
    undo.rollback()
    undo.rollback()  # idempotent: the log is spent
    assert all(np.array_equal(a, b) for a, b in zip(dsts, before, strict=True))


def test_staged_words_changed_in_memory_fail_the_seal_and_roll_back() -> None:
    bf16 = DTYPES[0]
    _segs, bases, preps = _staged(bf16, 4)
    dsts = [b.copy() for b in bases]
    group, rows, addresses = _rows(preps, dsts)
    group.new[group.offsets[5]] ^= 1  # a staged word flipped between staging and the pause
    undo = UndoLog()
    with pytest.raises(IntegrityError, match=f"at element {preps[5].first} are not the ones staged"):
        apply_prepared_rows(group, rows, addresses, dsts, undo, "chunk x")
    undo.rollback()
    assert all(np.array_equal(a, b) for a, b in zip(dsts, bases, strict=True))


def _many_small(tensors: int = 96) -> tuple[MemoryStore, list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    s0 = {f"e{i}": torch.randn(700, generator=g).to(torch.bfloat16) for i in range(tensors)}
    s1 = {n: t.clone() for n, t in s0.items()}
    for t in s1.values():
        t.view(torch.int16)[::29] += 1
    store = MemoryStore()
    pub = Publisher(store, policy=FAST)
    pub.publish(s0)
    pub.publish(s1)
    return store, [s0, s1]


def _same(state: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(np.array_equal(bits(state[n]), bits(t)) for n, t in want.items())


@pytest.mark.parametrize("verify", ["incremental", "full"])
def test_a_receiver_scatters_many_small_segments_at_once(monkeypatch: pytest.MonkeyPatch,
                                                         verify: str) -> None:
    store, states = _many_small()
    target = StateDictTarget({n: t.clone() for n, t in states[0].items()})
    rx = Receiver(store, target, verify=verify)  # type: ignore[arg-type]
    rx.sync(0)
    calls = {"rows": 0, "segments": 0}
    real_rows, real_segment = apply_mod.apply_prepared_rows, apply_mod.apply_segment

    def rows(group, at, *a, **k):  # type: ignore[no-untyped-def]
        calls["rows"] += at.size
        return real_rows(group, at, *a, **k)

    def segment(*a, **k):  # type: ignore[no-untyped-def]
        calls["segments"] += 1
        return real_segment(*a, **k)

    monkeypatch.setattr(apply_mod, "apply_prepared_rows", rows)
    monkeypatch.setattr(apply_mod, "apply_segment", segment)
    assert rx.apply(rx.stage(1)).version == 1
    assert calls == {"rows": len(states[0]), "segments": 0}
    assert _same(target.state, states[1])


def test_a_receiver_refuses_weights_changed_behind_its_back_in_a_scattered_chunk() -> None:
    store, states = _many_small()
    target = StateDictTarget({n: t.clone() for n, t in states[0].items()})
    rx = Receiver(store, target)
    rx.sync(0)
    staged = rx.stage(1)
    target.state["e50"].view(torch.int16)[29] ^= 1
    with pytest.raises(BaseMismatch, match="no longer holds the word it held"):
        rx.apply(staged)
    assert rx.version == 0
    target.state["e50"].view(torch.int16)[29] ^= 1
    assert _same(target.state, states[0])  # every row written before it was restored
    rx.apply(rx.stage(1))
    assert _same(target.state, states[1])


def test_a_failure_after_the_scatter_rolls_the_rows_back(monkeypatch: pytest.MonkeyPatch) -> None:
    store, states = _many_small()
    target = StateDictTarget({n: t.clone() for n, t in states[0].items()})
    rx = Receiver(store, target)
    rx.sync(0)
    real = apply_mod.apply_prepared_rows

    def written_then_lost(*a, **k):  # type: ignore[no-untyped-def]
        real(*a, **k)
        raise RuntimeError("device lost")

    monkeypatch.setattr(apply_mod, "apply_prepared_rows", written_then_lost)
    with pytest.raises(ApplyError, match="rolled back"):
        rx.sync(1)
    assert rx.version == 0 and _same(target.state, states[0])
    monkeypatch.setattr(apply_mod, "apply_prepared_rows", real)
    rx.sync(1)
    assert _same(target.state, states[1])


def _count_plans(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the pause's own row plans and the rows it scatters."""
    calls = {"plans": 0, "rows": 0}
    real_plan, real_rows = apply_mod.plan_rows, apply_mod.apply_prepared_rows

    def plan(*a, **k):  # type: ignore[no-untyped-def]
        calls["plans"] += 1
        return real_plan(*a, **k)

    def rows(group, at, *a, **k):  # type: ignore[no-untyped-def]
        calls["rows"] += at.size
        return real_rows(group, at, *a, **k)

    monkeypatch.setattr(apply_mod, "plan_rows", plan)
    monkeypatch.setattr(apply_mod, "apply_prepared_rows", rows)
    return calls


def test_the_pause_scatters_the_rows_that_staging_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    store, states = _many_small()
    target = StateDictTarget({n: t.clone() for n, t in states[0].items()})
    rx = Receiver(store, target)
    rx.sync(0)
    staged = rx.stage(1)
    calls = _count_plans(monkeypatch)
    assert rx.apply(staged).version == 1
    assert calls == {"plans": 0, "rows": len(states[0])}  # no choosing in the pause
    assert _same(target.state, states[1])


def test_a_pause_into_other_arrays_than_staging_read_chooses_its_rows_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store, states = _many_small()
    target = StateDictTarget({n: t.clone() for n, t in states[0].items()})
    rx = Receiver(store, target)
    rx.sync(0)
    staged = rx.stage(1)
    for n, t in list(target.state.items()):  # the same bits in new storage: staged addresses stale
        target.state[n] = t.clone()
    calls = _count_plans(monkeypatch)
    assert rx.apply(staged).version == 1
    assert calls["plans"] >= 1 and calls["rows"] == len(states[0])
    assert _same(target.state, states[1])


def test_rows_of_a_tied_tensor_are_applied_once_through_its_first_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store, states = MemoryStore(), []
    g = torch.Generator().manual_seed(2)
    s0 = {f"e{i}": torch.randn(700, generator=g).to(torch.bfloat16) for i in range(64)}
    s0["tied"] = s0["e0"].clone()
    s1 = {n: t.clone() for n, t in s0.items()}
    for t in s1.values():
        t.view(torch.int16)[::29] += 1
    pub = Publisher(store, policy=FAST)
    for s in (s0, s1):
        pub.publish(s)
        states.append(s)
    held = {n: t.clone() for n, t in s0.items() if n != "tied"}
    held["tied"] = held["e0"]  # one tensor under two names: +1 applied twice would show
    target = StateDictTarget(held)
    rx = Receiver(store, target)
    rx.sync(0)
    staged = rx.stage(1)
    calls = _count_plans(monkeypatch)
    assert rx.apply(staged).version == 1
    assert calls["plans"] >= 1  # the staged plan had "tied" as its own row
    assert calls["rows"] == len(s0) - 1
    assert target.state["tied"] is target.state["e0"] and _same(target.state, states[1])
