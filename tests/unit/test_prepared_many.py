"""Gap-coded segments staged in bulk (codec.prepared_many): what prepare_segment gives segment
by segment (arrays, digest lanes, seals), and its refusals, in the chunk's order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import weighthub.codec.prepared as prepared_mod
import weighthub.receive.stage as stage_mod
from weighthub.codec import Segment, encode_segment
from weighthub.codec.coding import ENCODE_PROFILES
from weighthub.codec.prepared import PreparedSegment, prepare_segment
from weighthub.codec.prepared_many import gap_coded, prepare_gap_segments
from weighthub.errors import FormatError, UsageError
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import MemoryStore
from weighthub.targets import StateDictTarget
from weighthub.tensors import DTYPES, DType, bits

FAST = ENCODE_PROFILES["fast"]


def _same(a: PreparedSegment, b: PreparedSegment) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f))
               for f in ("pos", "old", "new", "old_lanes", "new_lanes")) and (
        (a.seal, a.first, a.numel) == (b.seal, b.first, b.numel))


def _with(seg: Segment, **change) -> Segment:
    fields = {f: getattr(seg, f) for f in Segment.__dataclass_fields__}
    return Segment(**(fields | change))


def _segments(dtype: DType, seed: int) -> tuple[list[Segment], list[np.ndarray]]:
    """Gap-coded segments of random ranges (xor, add or overwrite), a few of them corrupt."""
    rng = np.random.default_rng(seed)
    u = dtype.uint
    top = np.iinfo(u).max
    segs, bases = [], []
    for t in range(60):
        n = int(rng.integers(1, 6000))
        old = rng.integers(0, top, n, dtype=u, endpoint=True)
        new = old.copy()
        hit = rng.random(n) < rng.choice([0.001, 0.02, 0.05])
        new[hit] += u(1) if t % 2 else rng.integers(0, top, int(hit.sum()), dtype=u, endpoint=True)
        seg = encode_segment(old, new, dtype, tensor=0, start=int(rng.integers(0, 999)), policy=FAST)
        if seg is None or not gap_coded(seg):
            continue
        if t % 7 == 3:  # a flipped continuation bit: a varint that overruns or a wrong count
            pb = seg.pos_bytes.copy()
            pb[pb.size // 2] ^= 0x80
            seg = _with(seg, pos_bytes=pb)
        elif t % 11 == 5:  # more changes than the gap stream can hold
            seg = _with(seg, count=seg.count + 10**6)
        elif t % 13 == 6:  # the held words of another range
            old = old[:-1]
        segs.append(seg)
        bases.append(old)
    return segs, bases


@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
def test_bulk_staging_is_the_segment_by_segment_staging(dtype: DType) -> None:
    segs, bases = _segments(dtype, hash(dtype.name) % 2**32)
    got = prepare_gap_segments(segs, bases, dtype, "chunk x")
    refused = 0
    for seg, base, prep in zip(segs, bases, got, strict=True):
        try:
            want = prepare_segment(seg, base, dtype, "chunk x")
        except (FormatError, UsageError) as exc:
            assert type(prep) is type(exc) and str(prep) == str(exc)
            refused += 1
            continue
        assert isinstance(prep, PreparedSegment) and want is not None and _same(prep, want)
    assert 0 < refused < len(segs)


def test_no_segments_and_only_refused_ones() -> None:
    bf16 = DTYPES[0]
    assert prepare_gap_segments([], [], bf16, "x") == []
    segs, bases = _segments(bf16, 1)
    bad = _with(segs[0], count=segs[0].count + 10**6)
    [out] = prepare_gap_segments([bad], [bases[0]], bf16, "chunk y")
    assert isinstance(out, FormatError) and "chunk y" in str(out)


def test_a_receiver_stages_gap_segments_in_bulk_and_ends_bit_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging a `fast` delta of many small tensors prepares no gap-coded segment one by one,
    and the pause applies what it staged bit-exactly."""
    g = torch.Generator().manual_seed(0)
    states = [{f"t{i}": torch.randn(512, generator=g).to(torch.bfloat16) for i in range(64)}]
    nxt = {n: t.clone() for n, t in states[0].items()}
    for t in nxt.values():
        t.view(torch.int16)[::37] += 1
    states.append(nxt)
    store = MemoryStore()
    pub = Publisher(store, policy=FAST)
    for s in states:
        pub.publish(s)
    target = StateDictTarget({})
    rx = Receiver(store, target)
    rx.sync(0)
    one_by_one: list[Segment] = []
    real = prepared_mod.prepare_segment

    def counted(seg, *a, **k):  # type: ignore[no-untyped-def]
        one_by_one.append(seg)
        return real(seg, *a, **k)

    monkeypatch.setattr(stage_mod, "prepare_segment", counted)
    assert rx.apply(rx.stage()).version == 1
    assert not [s for s in one_by_one if gap_coded(s)]
    assert all(np.array_equal(bits(target.state[n]), bits(t)) for n, t in states[1].items())
