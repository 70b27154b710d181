"""Receivers of chunks covered by boxes (a trainer rank's column shard, format spec §3).

Versions are written here by hand, the way two ranks holding Shard(1) column blocks of a
[12, 10] tensor write them: a full version of dense runs per box, then a delta of one sparse
segment per box over canonical positions. A receiver must end with the exact bits; a segment
that would write outside its box must be refused while staging, before anything is applied.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from weighthub import catalog
from weighthub.codec import (
    EncodePolicy,
    Op,
    Positions,
    Segment,
    UndoLog,
    Values,
    apply_segment,
    encode_segment,
)
from weighthub.codec.encode import encode_changes
from weighthub.digest import digest_bits, root_digest
from weighthub.errors import FormatError, UsageError
from weighthub.format import (
    ChunkFrame,
    ChunkRef,
    Manifest,
    TensorEntry,
    chunk_checksum,
    encode_chunk,
    encode_manifest,
)
from weighthub.format.manifest import KIND, MANIFEST_FORMAT
from weighthub.layout import ShardBox, segment_outside
from weighthub.publish import model_id
from weighthub.receive import Receiver
from weighthub.receive import apply as receive_apply
from weighthub.receive.stage import check_segments
from weighthub.store import MemoryStore
from weighthub.targets import StateDictTarget
from weighthub.tensors import DTYPE_BY_NAME, TensorSpec, bits

SHAPE = (12, 10)
BF16 = DTYPE_BY_NAME["BF16"]
SPEC = TensorSpec("w", BF16, SHAPE)
BOXES = [ShardBox(SHAPE, (0, 0), (12, 4)), ShardBox(SHAPE, (0, 4), (12, 6))]


def states() -> list[np.ndarray]:
    g = torch.Generator().manual_seed(11)
    v0 = bits(torch.randn(SHAPE, generator=g).to(torch.bfloat16)).copy()
    v1 = v0.copy()
    v1[[3, 4, 17, 25, 26, 61, 62, 99, 118]] += 1  # both boxes, ±1 ulp (bits, not floats)
    v1[45] ^= 0x8000  # a sign flip
    return [v0, v1]


def _manifest(v: int, words: np.ndarray, base: Manifest | None, chunks: list[ChunkRef]) -> Manifest:
    digest = digest_bits(words)
    return Manifest(format=MANIFEST_FORMAT, kind=KIND, model=model_id([SPEC]), version=v,
                    base=None if base is None else base.version,
                    base_root=None if base is None else base.root,
                    root=root_digest([(SPEC, digest)]).hex(),
                    tensors=[TensorEntry("w", "BF16", list(SHAPE), digest.hex())], chunks=chunks,
                    dense_bytes=SPEC.nbytes, payload_bytes=sum(c.size for c in chunks), changed=0)


def _put(store: MemoryStore, v: int, per_box: list[list[Segment]]) -> list[ChunkRef]:
    refs = []
    for box, segments in zip(BOXES, per_box, strict=True):
        frame = encode_chunk(segments)
        key = f"{catalog.version_dir(v)}/c-{uuid.uuid4().hex[:8]}.whc"
        store.put(key, frame)
        refs.append(ChunkRef(key, len(frame), chunk_checksum(frame), [],
                             [(0, list(box.offset), list(box.shape))]))
    return refs


def _dense_runs(box: ShardBox, words: np.ndarray) -> list[Segment]:
    return [encode_segment(None, words[s: s + box.run_len], BF16, tensor=0, start=s)
            for s in box.run_starts.tolist()]  # type: ignore[misc]


def _sparse(box: ShardBox, old: np.ndarray, new: np.ndarray, extra: tuple[int, ...] = ()) -> Segment:
    """One sparse segment over the box's flat span: its changes, plus a flip at `extra`."""
    start, stop = box.span
    changed = np.flatnonzero(old != new)
    pos = np.union1d(changed[box.contains(changed)], np.asarray(extra, np.int64)).astype(np.int64)
    now = new[pos].copy()
    now[np.isin(pos, extra)] ^= 1
    seg = encode_changes(pos - start, old[pos], now, BF16, tensor=0, start=start, stop=stop,
                         dense_numel=1 << 20, policy=EncodePolicy(groups=False))
    assert seg is not None
    return seg


def publish(store: MemoryStore, per_box_delta: list[Segment] | None = None) -> list[np.ndarray]:
    """v0 (full, dense runs per box) and v1 (one sparse segment per box) into `store`."""
    v0, v1 = states()
    m0 = _manifest(0, v0, None, _put(store, 0, [_dense_runs(b, v0) for b in BOXES]))
    store.put(catalog.rep_key(0, None, primary=True), encode_manifest(m0))
    delta = per_box_delta or [_sparse(b, v0, v1) for b in BOXES]
    m1 = _manifest(1, v1, m0, _put(store, 1, [[s] for s in delta]))
    store.put(catalog.rep_key(1, 0, primary=True), encode_manifest(m1))
    return [v0, v1]


def _held(target: dict[str, torch.Tensor]) -> np.ndarray:
    return bits(target["w"]).reshape(-1).copy()


def test_a_segment_must_lie_in_a_range_of_its_own_tensor() -> None:
    """Ranges are looked up by the segment's tensor (a chunk of thousands of small tensors has
    thousands of each), a tensor split by the span may have two in one chunk, and a segment
    crossing the gap between them, or past either, or of a tensor the chunk does not cover, is
    refused."""
    ref = ChunkRef("k", 1, "0" * 64, [(0, 0, 10), (1, 0, 5), (0, 20, 30)])
    delta = SimpleNamespace(base=0, tensors=[])

    def seg(ti: int, start: int, stop: int) -> Segment:
        return Segment(ti, start, stop, Op.XOR, Positions.GAPS, Values.VARINT, 1,
                       np.zeros(0, np.uint8), np.zeros(0, np.uint8))

    check_segments(ChunkFrame((seg(0, 0, 10), seg(0, 22, 30), seg(1, 1, 5))), ref, delta, "c")
    for bad in (seg(0, 5, 21), seg(0, 10, 20), seg(0, 25, 31), seg(1, 0, 6), seg(2, 0, 1)):
        with pytest.raises(FormatError, match=rf"c: segment 1 writes tensor {bad.tensor} "
                                              rf"\[{bad.start}, {bad.stop}\) outside the chunk's"):
            check_segments(ChunkFrame((seg(0, 0, 10), bad)), ref, delta, "c")


@pytest.mark.parametrize("verify", ["incremental", "full"])
def test_box_chunks_sync_to_the_exact_bits(verify: Any) -> None:
    store = MemoryStore(f"box-{verify}")
    v0, v1 = publish(store)
    m1 = catalog.primary_manifest(store, 1)
    assert [len(c.boxes) for c in m1.chunks] == [1, 1] and not any(c.covers for c in m1.chunks)
    target: dict[str, torch.Tensor] = {}
    rx = Receiver(store, StateDictTarget(target), verify=verify)
    rx.sync(0)
    assert np.array_equal(_held(target), v0)
    rx.sync(1)
    assert np.array_equal(_held(target), v1)
    fresh: dict[str, torch.Tensor] = {}
    Receiver(store, StateDictTarget(fresh), verify=verify).sync(1)  # full, then the delta
    assert np.array_equal(_held(fresh), v1)


def _refused(store: MemoryStore, v0: np.ndarray, monkeypatch: pytest.MonkeyPatch, match: str) -> None:
    target: dict[str, torch.Tensor] = {}
    rx = Receiver(store, StateDictTarget(target))
    rx.sync(0)
    applied = []
    real = receive_apply.apply_segment

    def counting(*args: Any, **kwargs: Any) -> Any:
        applied.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(receive_apply, "apply_segment", counting)
    with pytest.raises(FormatError, match=match):
        rx.sync(1)
    assert applied == []  # refused while staging: not one segment was applied
    assert rx.version == 0 and np.array_equal(_held(target), v0)


def test_a_segment_writing_into_another_rank_s_box_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    v0, v1 = states()
    # rank 0's segment also flips canonical element 14 (row 1, column 4): rank 1's
    hostile = [_sparse(BOXES[0], v0, v1, extra=(14,)), _sparse(BOXES[1], v0, v1)]
    store = MemoryStore("box-outside")
    publish(store, hostile)
    _refused(store, v0, monkeypatch, r"outside the chunk's coverage \(positions outside the box\)")


def test_a_bitmap_segment_writing_outside_its_box_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    v0, v1 = states()
    start, stop = BOXES[0].span
    pos = np.arange(start, stop, 2, dtype=np.int64)  # dense enough for a bitmap; odd rows' 4..9
    seg = encode_changes(pos - start, v0[pos], v0[pos] ^ 1, BF16, tensor=0, start=start, stop=stop,
                         dense_numel=1 << 20)
    assert seg is not None and seg.positions.name == "BITMAP"
    store = MemoryStore("box-bitmap")
    publish(store, [seg, _sparse(BOXES[1], v0, v1)])
    _refused(store, v0, monkeypatch, r"positions outside the box")


def test_grouped_positions_are_refused_in_a_box(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exponent groups rank every element of the flat span, other ranks' included: a segment
    coded that way is refused for its coding alone, whatever its stream holds."""
    v0, v1 = states()
    grouped = replace(_sparse(BOXES[0], v0, v1), positions=Positions.GROUPS)
    store = MemoryStore("box-groups")
    publish(store, [grouped, _sparse(BOXES[1], v0, v1)])
    _refused(store, v0, monkeypatch, r"groups positions \(box segments use gaps or bitmap\)")


def test_a_sparse_range_past_the_box_span_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    v0, v1 = states()
    stop = BOXES[0].span[1]
    pos = np.asarray([0, 10], np.int64)  # inside the box, but the range runs to the tensor's end
    seg = encode_changes(pos, v0[pos], v0[pos] ^ 1, BF16, tensor=0, start=0, stop=SPEC.numel,
                         dense_numel=1 << 20)
    assert seg is not None and stop < SPEC.numel
    store = MemoryStore("box-span")
    publish(store, [seg, _sparse(BOXES[1], v0, v1)])
    _refused(store, v0, monkeypatch, r"a range outside the box's flat span")


def test_a_dense_segment_across_runs_is_refused_in_a_full_version() -> None:
    v0, _v1 = states()
    store = MemoryStore("box-dense")
    across = encode_segment(None, v0[0:14], BF16, tensor=0, start=0)  # row 0 and row 1's 0..3
    assert across is not None
    rest = [s for s in _dense_runs(BOXES[0], v0) if s.start >= 20]
    m0 = _manifest(0, v0, None, _put(store, 0, [[across, *rest], _dense_runs(BOXES[1], v0)]))
    store.put(catalog.rep_key(0, None, primary=True), encode_manifest(m0))
    target: dict[str, torch.Tensor] = {}
    rx = Receiver(store, StateDictTarget(target))
    with pytest.raises(FormatError, match="a dense range not inside one run"):
        rx.sync(0)
    assert rx.version is None and "w" not in target


@pytest.mark.parametrize("dtype", ["BF16", "F32", "I8", "F8_E4M3"])
@pytest.mark.parametrize("width,density", [(29, 0.5), (11, 0.03)])  # a bitmap, gaps
def test_encode_changes_applies_to_the_exact_bits(dtype: str, width: int, density: float) -> None:
    dt = DTYPE_BY_NAME[dtype]
    rng = np.random.default_rng(7)
    box = ShardBox((40, 30), (3, 1), (30, width))
    start, stop = box.span
    old = rng.integers(0, 1 << (8 * dt.width), 40 * 30, dtype=np.uint64).astype(dt.uint)
    pos = box.canonical(np.flatnonzero(rng.random(box.numel) < density)) - start
    new_words = old[start + pos].copy()
    new_words[::3] += dt.uint(1)  # ±1 ulp-like differences, a few large ones, NaN payloads
    new_words[1::3] ^= dt.uint(1 << (8 * dt.width - 1))
    new_words[2::3] = ~new_words[2::3]
    seg = encode_changes(pos, old[start + pos], new_words, dt, tensor=0, start=start, stop=stop,
                         dense_numel=box.numel)
    assert seg is not None and seg.positions.name == ("BITMAP" if density > 0.1 else "GAPS")
    assert segment_outside(seg, box) is None
    dst = old.copy()
    apply_segment(seg, dst[start:stop], dt, UndoLog(), "t")
    want = old.copy()
    want[start + pos] = new_words
    assert np.array_equal(dst, want)


def test_encode_changes_gives_way_to_dense_and_refuses_bad_input() -> None:
    old = np.arange(100, dtype=np.uint16)
    pos = np.arange(100, dtype=np.int64)
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 1 << 16, 100, dtype=np.uint64).astype(np.uint16)
    assert encode_changes(pos, old, noise, BF16, tensor=0, start=0, stop=100, dense_numel=100) is None
    with pytest.raises(UsageError):
        encode_changes(pos[:0], old[:0], old[:0], BF16, tensor=0, start=0, stop=100, dense_numel=100)
    with pytest.raises(UsageError):
        encode_changes(pos + 1, old, old, BF16, tensor=0, start=0, stop=100, dense_numel=100)
