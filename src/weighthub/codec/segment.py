"""Segments: one op over one flat element range of one tensor, and how they are chosen.

A segment is what a chunk frame carries per tensor range:
  op         xor | add | overwrite | dense
  positions  how the changed positions are coded: all (dense), gaps, groups, bitmap
  values     how the values are coded: raw words, varint (XOR), zigzag varint (difference)
plus the two byte streams. `encode_segment` picks the smallest combination per segment by an
order-0 entropy estimate of each candidate stream (a close proxy for zstd-1, at a fraction of
the cost of compressing every candidate). `apply_segment` applies in place and records an
undo log so a transaction can roll back exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import FormatError
from ..tensors import (
    DType,
    digest_affine,
    digest_change,
    digest_sub,
)
from . import kernels as K
from .coding import EncodePolicy, Op, Positions, Values, invertible


@dataclass(frozen=True, slots=True)
class Segment:
    """One op over elements [start, stop) of tensor `tensor` (index in the manifest's table)."""

    tensor: int
    start: int
    stop: int
    op: Op
    positions: Positions
    values: Values
    count: int  # number of elements the op touches
    pos_bytes: np.ndarray  # uint8
    val_bytes: np.ndarray  # uint8

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def invertible(self) -> bool:
        """Can `apply_segment(..., inverse=True)` undo this segment (see `invertible`)?"""
        return invertible(self.op, self.positions)


DEFAULT_POLICY = EncodePolicy()

# Expected dense+zstd-1 size relative to raw for float weights (measured 0.78 for bf16).
_DENSE_RATIO = 0.8
# Group probe: this many windows of this many elements, on segments at least 4x their total.
_PROBE_WINDOWS = 8
_PROBE_WINDOW = 1 << 18


@dataclass(frozen=True, slots=True)
class _Changes:
    """Changed positions of a range with their old and new words, in increasing position order."""

    pos: np.ndarray  # int64
    old: np.ndarray  # dtype of the bit arrays
    new: np.ndarray


def _scan(old: np.ndarray, new: np.ndarray, limit: int) -> _Changes | None:
    """Every changed element of two equal-length bit arrays, or None if more than `limit`."""
    if old.shape != new.shape or old.dtype != new.dtype or old.ndim != 1:
        raise ValueError(f"changed_positions: {old.dtype}{old.shape} vs {new.dtype}{new.shape}")
    n = old.shape[0]
    width = old.itemsize
    lanes = 8 // width
    if (old.ctypes.data - new.ctypes.data) % 8 or old.ctypes.data % width:
        # no common word alignment (rare: slices of differently placed buffers); a copy of
        # both is cheaper than an element-wise scan
        old, new = old.copy(), new.copy()
    head = min(n, (-old.ctypes.data % 8) // width)  # elements before the first word boundary
    words = (n - head) // lanes
    stop = head + words * lanes
    slack = K.SCAN_CHUNK * lanes + lanes
    cap = n // 32 + slack  # ~3% changed fits without growing
    pos, ov, nv = np.empty(cap, np.int64), np.empty(cap, old.dtype), np.empty(cap, old.dtype)
    k = K.scan_tail(old, new, 0, head, pos, ov, nv, 0)
    a64, b64 = old[head:stop].view(np.uint64), new[head:stop].view(np.uint64)
    wbuf = np.empty(K.SCAN_CHUNK, np.int64)
    w = 0
    while True:
        k, w = K.scan_changes(a64, b64, lanes, 8 * width, head, w, wbuf, pos, ov, nv, k)
        if k > limit:
            return None
        if w == words and pos.size - k >= n - stop:
            break
        grown = 2 * pos.size + slack  # out of room for another chunk or the tail: double
        pos, ov, nv = (np.concatenate([x[:k], np.empty(grown - k, x.dtype)]) for x in (pos, ov, nv))
    k = K.scan_tail(old, new, stop, n, pos, ov, nv, k)
    if k > limit:
        return None
    return _Changes(pos[:k], ov[:k], nv[:k])


def changed_positions(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Sorted int64 positions where two equal-length bit arrays differ."""
    changes = _scan(old, new, old.shape[0])
    assert changes is not None
    return changes.pos


def _entropy_of_hist(hist: np.ndarray, scale: float = 1.0) -> float:
    """Order-0 entropy in bytes of a stream with this byte histogram, `scale` times as long."""
    total = int(hist.sum())
    if total == 0:
        return 0.0
    p = hist[hist > 0] / total
    return float(-(p * np.log2(p)).sum() * total * scale / 8) + 16


def _entropy_bytes(stream: np.ndarray) -> float:
    """Order-0 entropy of a byte stream, in bytes: what zstd-1's Huffman stage approaches."""
    hist = np.zeros(256, np.int64)
    K.byte_histogram(stream, hist)
    return _entropy_of_hist(hist)


def _width_masks(dtype: DType) -> tuple[np.uint64, int]:
    bits_ = 8 * dtype.width
    mask = np.uint64((1 << bits_) - 1) if bits_ < 64 else np.uint64(0xFFFFFFFFFFFFFFFF)
    return mask, bits_ - 1


def _varint_bound(count: int) -> int:
    return count * 10 + 16


def _encode_vals(ch: _Changes, codec: Values, dtype: DType) -> np.ndarray:
    if codec == Values.RAW:  # the new words themselves, little-endian
        return np.ascontiguousarray(ch.new, ch.new.dtype.newbyteorder("<")).view(np.uint8)
    mask, sign_shift = _width_masks(dtype)
    out = np.empty(_varint_bound(ch.pos.size), np.uint8)
    used = K.encode_values(ch.old, ch.new, ch.pos.size, int(codec), mask, sign_shift, out)
    return out[:used]


def _encode_gaps(pos: np.ndarray) -> np.ndarray:
    out = np.empty(_varint_bound(pos.size), np.uint8)
    return out[: K.encode_gaps(pos, pos.size, out)]


def _encode_groups(old: np.ndarray, pos: np.ndarray, dtype: DType) -> np.ndarray:
    keys = np.empty(pos.size, np.uint64)
    ranks = np.empty(pos.size, np.int64)
    done = K.group_ranks(old, pos, pos.size, dtype.exponent_shift, np.uint64(dtype.exponent_mask),
                         keys, ranks)
    if done != pos.size:
        raise ValueError("grouped positions: positions not increasing or out of range")
    size = dtype.exponent_mask + 1
    out = np.empty(_varint_bound(pos.size + 2 * size), np.uint8)
    return out[: K.encode_group_stream(keys, ranks, pos.size, size, out)]


def _groups_promising(old: np.ndarray, pos: np.ndarray, dtype: DType) -> bool:
    """Do groups beat gaps on a few evenly spaced windows? (Cheap stand-in for the full pass.)

    Each window is coded as a segment of its own; the per-window group tables count against
    groups, so a marginal gain is not worth the full pass anyway.
    """
    n = old.shape[0]
    est_groups = est_gaps = 0.0
    for w in range(_PROBE_WINDOWS):
        lo = (n - _PROBE_WINDOW) * w // (_PROBE_WINDOWS - 1)
        hi = lo + _PROBE_WINDOW
        a, b = np.searchsorted(pos, [lo, hi])
        sub = pos[a:b] - lo
        est_gaps += _entropy_bytes(_encode_gaps(sub))
        est_groups += _entropy_bytes(_encode_groups(old[lo:hi], sub, dtype))
    return est_groups < est_gaps


def _choose_values(ch: _Changes, dtype: DType, policy: EncodePolicy
                   ) -> tuple[float, Op, Values, np.ndarray]:
    """The smallest allowed value coding by order-0 entropy, estimated on a strided sample."""
    count = ch.pos.size
    stride = max(1, count // policy.value_sample) if policy.value_sample > 0 else 1
    mask, sign_shift = _width_masks(dtype)
    hists = np.zeros((3, 256), np.int64)
    K.value_histograms(ch.old, ch.new, count, stride, mask, sign_shift,
                       hists[0], hists[1], hists[2])
    scale = count / len(range(0, count, stride))
    candidates = [(_entropy_of_hist(hists[2], scale), Op.OVERWRITE, Values.RAW)]
    if policy.mask_ops:
        candidates = [(_entropy_of_hist(hists[0], scale), Op.ADD, Values.ZIGZAG),
                      (_entropy_of_hist(hists[1], scale), Op.XOR, Values.VARINT), *candidates]
    est, op, codec = min(candidates, key=lambda c: c[0])
    return est, op, codec, _encode_vals(ch, codec, dtype)


def _dense_segment(tensor: int, start: int, new: np.ndarray) -> Segment:
    raw = new.view(np.uint8)
    return Segment(tensor, start, start + new.size, Op.DENSE, Positions.ALL, Values.RAW,
                   new.size, np.empty(0, np.uint8), raw)


def encode_segment(old: np.ndarray | None, new: np.ndarray, dtype: DType, *, tensor: int,
                   start: int, policy: EncodePolicy = DEFAULT_POLICY) -> Segment | None:
    """Encode new (vs old) for elements [start, start+len(new)) of a tensor.

    Returns None when nothing changed, a dense segment when there is no base or the delta
    would not be smaller, else the smallest of the allowed op/position/value codings.
    """
    if old is None:
        return _dense_segment(tensor, start, new)
    return _encode(old, new, dtype, tensor, start, policy, _scan(old, new, _scan_limit(new.size)))


def encode_segment_tracked(old: np.ndarray | None, new: np.ndarray, dtype: DType, *, tensor: int,
                           start: int, policy: EncodePolicy = DEFAULT_POLICY
                           ) -> tuple[Segment | None, bytes]:
    """encode_segment, plus how the segment changes its tensor's digest (spec §4).

    The change is Σ mix(i, new) − mix(i, old) over the changed elements, taken from the scan's
    compacted changes, so it costs O(changed) whatever op is chosen; with no base it is the
    digest of the new range (a full version starts from nothing). Only when nearly every word
    changed (the scan gives up) is it the difference of the two ranges' digests.
    """
    if old is None:
        return _dense_segment(tensor, start, new), digest_affine(new, start, (1,), threads=1)
    ch = _scan(old, new, _scan_limit(new.size))
    if ch is None:
        change = digest_sub(digest_affine(new, start, (1,), threads=1),
                            digest_affine(old, start, (1,), threads=1))
    else:
        change = digest_change(ch.pos, ch.old, ch.new, first=start)
    return _encode(old, new, dtype, tensor, start, policy, ch), change


def _scan_limit(n: int) -> int:
    # Even at 50% changed a bitmap + small differences is far below dense (~0.2 vs 0.78 of the
    # bf16 bytes, measured at lr 1e-4), so only give up on the delta when nearly every word
    # changed; the limit also bounds the scan's buffers (12 bytes per changed element). Small
    # ranges (step counters, scalars, short biases) are always scanned: their buffers are tiny,
    # and the size comparison in _encode still picks dense when that is smaller, but a counter
    # that changes every step no longer forces a dense segment, which would make the whole delta
    # impossible to undo on a rollback (catalog.invertible).
    return n if n <= _ALWAYS_SCAN else n - n // 16


_ALWAYS_SCAN = 4096  # elements
# Bytes a sparse xor/add segment may cost beyond dense and still be chosen: it keeps the delta
# invertible (a rollback undoes it instead of fetching a full version); only ties on tiny
# ranges are decided by it.
_INVERTIBLE_SLACK = 4


def _encode(old: np.ndarray, new: np.ndarray, dtype: DType, tensor: int, start: int,
            policy: EncodePolicy, ch: _Changes | None) -> Segment | None:
    n = new.size
    if ch is None:  # nearly everything changed
        return _dense_segment(tensor, start, new)
    pos = ch.pos
    if pos.size == 0:
        return None
    dense_est = n * dtype.width * (_DENSE_RATIO if dtype.is_float else 1.0)

    # positions: gaps always; groups for floats with enough changes; bitmap when dense-ish
    candidates: list[tuple[float, Positions, np.ndarray]] = []
    gaps = _encode_gaps(pos)
    candidates.append((_entropy_bytes(gaps), Positions.GAPS, gaps))
    if (policy.groups and dtype.is_float and pos.size >= policy.min_group_count
            and (not policy.group_probe or n < 4 * _PROBE_WINDOWS * _PROBE_WINDOW
                 or _groups_promising(old, pos, dtype))):
        grouped = _encode_groups(old, pos, dtype)
        candidates.append((_entropy_bytes(grouped), Positions.GROUPS, grouped))
    if pos.size * 16 > n:
        bitmask = np.zeros(n, np.bool_)
        bitmask[pos] = True
        bitmap = np.packbits(bitmask, bitorder="little")
        candidates.append((_entropy_bytes(bitmap), Positions.BITMAP, bitmap))
    pos_est, pos_codec, pos_bytes = min(candidates, key=lambda c: c[0])

    val_est, op, val_codec, val_bytes = _choose_values(ch, dtype, policy)
    if n <= _ALWAYS_SCAN:
        # a small range's streams are too short for zstd to shrink (the estimates' fixed 16-byte
        # table cost would make dense win for a lone changed counter): compare what is written
        sparse_bytes, dense_bytes = float(pos_bytes.size + val_bytes.size), float(n * dtype.width)
    else:
        sparse_bytes, dense_bytes = pos_est + val_est, dense_est
    if sparse_bytes >= dense_bytes + _INVERTIBLE_SLACK:
        return _dense_segment(tensor, start, new)
    return Segment(tensor, start, start + n, op, pos_codec, val_codec, int(pos.size),
                   pos_bytes, val_bytes)


def encode_changes(pos: np.ndarray, old: np.ndarray, new: np.ndarray, dtype: DType, *,
                   tensor: int, start: int, stop: int, dense_numel: int,
                   policy: EncodePolicy = DEFAULT_POLICY) -> Segment | None:
    """A sparse segment over [start, stop) from changes already found, or None if dense wins.

    For changes that are not one contiguous range of a tensor, e.g. a trainer rank's column
    shard: `pos` (int64, strictly increasing, relative to `start`, < stop − start) are the
    changed elements, `old`/`new` their words. Positions are coded as gaps or a bitmap, never
    exponent-grouped (grouping ranks every element of [start, stop), which the caller may not
    hold); values as encode_segment chooses them (xor/add/overwrite by size, under `policy`).

    Args:
        dense_numel: elements a dense copy of the changes' region would carry; None is returned
            when the segment would not be smaller than that (the caller writes them densely).

    Raises:
        ValueError: no changes, or positions/words of different lengths, or outside the range.
    """
    n = stop - start
    if pos.size == 0 or not pos.shape == old.shape == new.shape or pos.ndim != 1:
        raise ValueError(f"encode_changes: {pos.size} positions, {old.shape} old, {new.shape} new")
    if int(pos[0]) < 0 or int(pos[-1]) >= n:
        raise ValueError(f"encode_changes: positions outside [0, {n})")
    pos = pos.astype(np.int64, copy=False)
    candidates: list[tuple[float, Positions, np.ndarray]] = []
    gaps = _encode_gaps(pos)
    candidates.append((_entropy_bytes(gaps), Positions.GAPS, gaps))
    if pos.size * 16 > n:
        bitmask = np.zeros(n, np.bool_)
        bitmask[pos] = True
        bitmap = np.packbits(bitmask, bitorder="little")
        candidates.append((_entropy_bytes(bitmap), Positions.BITMAP, bitmap))
    pos_est, pos_codec, pos_bytes = min(candidates, key=lambda c: c[0])
    val_est, op, val_codec, val_bytes = _choose_values(_Changes(pos, old, new), dtype, policy)
    if pos_est + val_est >= dense_numel * dtype.width * (_DENSE_RATIO if dtype.is_float else 1.0):
        return None
    return Segment(tensor, start, stop, op, pos_codec, val_codec, int(pos.size), pos_bytes,
                   val_bytes)


@dataclass(slots=True)
class UndoEntry:
    """What one apply changed in `dst`: the first `done` (position, old word) pairs, or a copy."""

    dst: np.ndarray
    positions: np.ndarray | None  # None: `old` is a copy of the whole of dst
    old: np.ndarray
    done: int


@dataclass(slots=True)
class UndoLog:
    """Old words of everything a transaction changed, to restore them exactly (idempotent).

    fresh: the destination holds nothing worth restoring (a target being materialized, which
    is discarded on failure), so dense segments skip the copy of the old bits.
    """

    entries: list[UndoEntry] = field(default_factory=list)
    fresh: bool = False

    def rollback(self) -> None:
        for e in reversed(self.entries):
            if e.positions is None:
                np.copyto(e.dst, e.old)
            else:
                K.restore(e.dst, e.positions, e.old, e.done)
        self.entries.clear()

    @property
    def nbytes(self) -> int:
        return sum(e.old.nbytes + (0 if e.positions is None else e.positions.nbytes)
                   for e in self.entries)


_STATUS = {
    K.STREAM_OVERRUN: "a stream ends before all its entries",
    K.POSITION_OUT_OF_RANGE: "a position is out of range or not increasing",
    K.TRAILING_BYTES: "a stream has bytes left after its last entry",
    K.BAD_VARINT: "a varint is longer than 10 bytes",
}


def check_status(status: int, where: str) -> None:
    """Raise FormatError naming `where` for a kernel's negative status."""
    if status < 0:
        raise FormatError(f"{where}: corrupt segment: {_STATUS.get(status, status)}")


def _group_table(seg: Segment, dtype: DType, where: str) -> tuple[np.ndarray, np.ndarray, int]:
    """The group table of a GROUPS position stream: (keys, counts, offset of the rank gaps)."""
    buf = seg.pos_bytes
    head: list[int] = []
    i = 0
    # group table: varint ngroups, then (key, count) pairs; parsed in Python, it is tiny
    def read() -> int:
        nonlocal i
        v, shift = 0, 0
        while True:
            if i >= buf.size or shift > 63:
                raise FormatError(f"{where}: corrupt group table")
            c = int(buf[i])
            i += 1
            v |= (c & 0x7F) << shift
            if c < 0x80:
                return v
            shift += 7
    ngroups = read()
    if ngroups > dtype.exponent_mask + 1:
        raise FormatError(f"{where}: {ngroups} position groups, at most {dtype.exponent_mask + 1}")
    for _ in range(2 * ngroups):
        head.append(read())
    keys = np.asarray(head[0::2], np.int64)
    counts = np.asarray(head[1::2], np.int64)
    if (keys > dtype.exponent_mask).any() or np.unique(keys).size != keys.size:
        raise FormatError(f"{where}: group keys out of range or repeated")
    if int(counts.sum()) != seg.count:
        raise FormatError(f"{where}: group counts sum to {int(counts.sum())}, header says {seg.count}")
    return keys, counts, i


def regap_segment(seg: Segment, base: np.ndarray, dtype: DType, where: str) -> Segment:
    """The same segment with exponent-grouped positions re-coded as plain gaps.

    Grouped positions are smaller on the wire but decode at ~1 GB/s because every element's
    old exponent must be read; plain gaps apply at several GB/s. A receiver calls this while
    staging, with `base` = the bits it holds now (read only), so the pause runs the fast kernel.
    The result applies only to exactly those base bits (a different base fails its digests).
    """
    if seg.positions != Positions.GROUPS:
        return seg
    if base.size != seg.numel or base.dtype != dtype.uint:
        raise ValueError(f"{where}: base {base.dtype}[{base.size}] for {seg.numel} elements")
    if not 0 <= seg.count <= seg.numel:
        raise FormatError(f"{where}: {seg.count} changes in a range of {seg.numel} elements")
    keys, counts, offset = _group_table(seg, dtype, where)
    pos = np.empty(seg.count, np.int64)
    status = K.decode_group_positions(base, dtype.exponent_shift, np.uint64(dtype.exponent_mask),
                                      keys, counts, seg.pos_bytes[offset:], seg.count, pos)
    check_status(status, where)
    return replace(seg, positions=Positions.GAPS, pos_bytes=_encode_gaps(pos))


def apply_segment(seg: Segment, dst: np.ndarray, dtype: DType, undo: UndoLog,
                  where: str, *, dnew: np.ndarray | None = None,
                  dold: np.ndarray | None = None, inverse: bool = False) -> UndoEntry | None:
    """Apply a segment in place to dst (the bits of exactly [seg.start, seg.stop)).

    Every element changed is recorded in `undo` before a FormatError (corrupt streams) is
    raised, so the caller's rollback restores dst exactly. Returns the entry recorded (None for
    a dense segment into a fresh destination, which records nothing).

    dnew / dold (uint64[2] or None): on success, the digest lanes (format/spec.md §4) of the
    words written / the words they replaced are added to them, computed in the same pass
    (kernels.py: the words are not read back).

    inverse: undo the segment instead: dst holds the words it produced and gets back the words
    it was encoded against (xor: the same XOR; add: the difference subtracted). Raises
    FormatError for a segment that is not `invertible`, before touching dst.
    """
    if dst.size != seg.numel or dst.dtype != dtype.uint:
        raise ValueError(f"{where}: destination {dst.dtype}[{dst.size}] for {seg.numel} elements")
    op = int(seg.op)
    if inverse:
        if not seg.invertible:
            raise FormatError(f"{where}: a {seg.op.name.lower()}/{seg.positions.name.lower()} "
                              "segment cannot be applied inversely (only xor/add with gaps or "
                              "bitmap positions can)")
        op = K.OP_SUB if seg.op == Op.ADD else op
    if seg.op == Op.DENSE:
        if seg.val_bytes.size != seg.numel * dtype.width:
            raise FormatError(f"{where}: dense segment has {seg.val_bytes.size} bytes, "
                              f"expected {seg.numel * dtype.width}")
        if dnew is None and dold is None:
            entry = None if undo.fresh else UndoEntry(dst, None, dst.copy(), 0)
            if entry is not None:
                undo.entries.append(entry)
            np.copyto(dst, seg.val_bytes.view(dtype.uint))
            return entry
        entry = None if undo.fresh else UndoEntry(dst, None, np.empty_like(dst), 0)
        if entry is not None:
            undo.entries.append(entry)
        K.copy_words(dst, seg.val_bytes.view(dtype.uint), None if entry is None else entry.old,
                     seg.start, dnew, dold)
        return entry
    if not 0 <= seg.count <= seg.numel:
        raise FormatError(f"{where}: {seg.count} changes in a range of {seg.numel} elements")
    mask, _ = _width_masks(dtype)
    undo_pos = np.empty(seg.count, np.int64)
    undo_val = np.empty(seg.count, dtype.uint)
    if seg.positions == Positions.GAPS:
        status, done = K.apply_gap_stream(dst, seg.pos_bytes, op, int(seg.values),
                                          seg.val_bytes, seg.count, mask, undo_pos, undo_val,
                                          seg.start, dnew, dold)
    elif seg.positions == Positions.GROUPS:
        keys, counts, offset = _group_table(seg, dtype, where)
        status, done = K.apply_group_stream(
            dst, dtype.exponent_shift, np.uint64(dtype.exponent_mask), keys, counts,
            seg.pos_bytes[offset:], op, int(seg.values), seg.val_bytes, seg.count, mask,
            undo_pos, undo_val, seg.start, dnew, dold)
    else:
        if seg.positions == Positions.BITMAP:
            if seg.pos_bytes.size != math.ceil(seg.numel / 8):
                raise FormatError(f"{where}: bitmap of {seg.pos_bytes.size} bytes for "
                                  f"{seg.numel} elements")
            bitmask = np.unpackbits(seg.pos_bytes, count=seg.numel, bitorder="little")
            pos = np.flatnonzero(bitmask).astype(np.int64)
            if pos.size != seg.count:
                raise FormatError(f"{where}: bitmap has {pos.size} positions, header says "
                                  f"{seg.count}")
        else:
            raise FormatError(f"{where}: positions {seg.positions.name} with op {seg.op.name}")
        status, done = K.apply_positions(dst, pos, op, int(seg.values), seg.val_bytes,
                                         seg.count, mask, undo_pos, undo_val, seg.start, dnew,
                                         dold)
    entry = UndoEntry(dst, undo_pos, undo_val, done)
    undo.entries.append(entry)
    check_status(status, where)
    return entry
