"""Applying segments in place, forwards or inversely, with an exact undo log (spec §2).

Every stream is validated by the kernels as they apply it (bounds, varints, counts); the
coding itself (`coding.check_coding`) and the group table are checked here first. Arrays reach
the kernels in one form (read-only streams, always-present digest sums), so each kernel
compiles once per word width.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np

from ..errors import FormatError, UsageError
from ..tensors import DType, readonly
from . import kernels as K
from .coding import CONTEXT_CODINGS, Op, Positions, check_coding
from .ctx import decode_ctx
from .encode import encode_gaps, width_masks
from .place import ctx_place
from .prepared import PreparedSegment, apply_prepared
from .segment import Segment, UndoEntry, UndoLog, bitmap_positions, check_sparse, check_status

_NO_SUM = np.zeros(0, np.uint64)  # a digest sum not wanted (the kernels test its length)


def _read_varint(buf: np.ndarray, i: int, where: str) -> tuple[int, int]:
    """(value, next index) of the varint at i: at most 10 bytes and below 2^64 (spec §2)."""
    v, shift = 0, 0
    while True:
        if i >= buf.size:
            raise FormatError(f"{where}: corrupt group table: it ends inside a varint")
        c = int(buf[i])
        i += 1
        v |= (c & 0x7F) << shift
        if c < 0x80:
            if v >> 64:  # the 10th byte carries bit 63 only
                raise FormatError(f"{where}: corrupt group table: a varint over 2^64-1")
            return v, i
        shift += 7
        if shift > 63:
            raise FormatError(f"{where}: corrupt group table: a varint longer than 10 bytes")


def group_table(seg: Segment, dtype: DType, where: str) -> tuple[np.ndarray, np.ndarray, int]:
    """The group table of a GROUPS position stream: (keys, counts, offset of the rank gaps).

    Parsed in Python (it is tiny): varint ngroups, then (key, count) pairs, keys strictly
    increasing and each count ≥ 1, as writers emit them (spec §2).
    """
    buf = seg.pos_bytes
    ngroups, i = _read_varint(buf, 0, where)
    if ngroups > dtype.exponent_mask + 1:
        raise FormatError(f"{where}: {ngroups} position groups, at most {dtype.exponent_mask + 1}")
    head = []
    for _ in range(2 * ngroups):
        v, i = _read_varint(buf, i, where)
        head.append(v)
    # checked as Python ints, before they become int64 arrays (a 2^64-1 would not fit)
    keys, counts = head[0::2], head[1::2]
    if any(k > dtype.exponent_mask for k in keys) or any(a >= b for a, b in itertools.pairwise(keys)):
        raise FormatError(f"{where}: group keys out of range, repeated or not increasing")
    if any(c < 1 for c in counts):
        raise FormatError(f"{where}: a position group with no changes")
    if sum(counts) != seg.count:
        raise FormatError(f"{where}: group counts sum to {sum(counts)}, header says {seg.count}")
    return np.asarray(keys, np.int64), np.asarray(counts, np.int64), i


def regap_segment(seg: Segment, base: np.ndarray, dtype: DType, where: str) -> Segment:
    """The same segment with exponent-grouped or context-coded positions re-coded as plain gaps
    (and context-coded values as varints or zigzag varints).

    Grouped and context-coded positions are smaller on the wire but decode slowly (every
    element's old exponent is read, and ctx/ans run their entropy decoder), while plain gaps
    apply at several GB/s.
    A receiver calls this while staging, with `base` = the bits it holds now (read only), so
    the pause runs the fast kernel. The result applies only to exactly those base bits (a
    different base fails its digests).

    Raises:
        UsageError: `base` is not the segment's range in the dtype's words.
        FormatError: a coding the format forbids, or a corrupt group table or stream.
    """
    if seg.positions in CONTEXT_CODINGS:
        check_sparse(seg, dtype, base, where)
        return decode_ctx(seg, base, dtype, where)
    if seg.positions != Positions.GROUPS:
        return seg
    check_sparse(seg, dtype, base, where)
    keys, counts, offset = group_table(seg, dtype, where)
    count = seg.count
    if count > seg.pos_bytes.size - offset:  # a varint (≥ 1 byte) per change
        raise FormatError(f"{where}: {count} grouped positions in {seg.pos_bytes.size - offset} "
                          "bytes of rank gaps")
    ranks = np.empty(count, np.int64)
    check_status(K.decode_group_ranks(counts, readonly(seg.pos_bytes[offset:]), count, seg.numel,
                                      ranks), where)  # as a device receiver decodes them
    # placed as the context codings' ranks are (place.ctx_place, 64 words at a time): the
    # whole re-coding took 0.45-0.59x the time of the word-by-word pass before it, on MiniLM
    # steps at lr 1e-6 and 3e-6 (0.7-4.8% changed). The values and old words placed go unused
    starts = np.zeros(keys.size + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    pos = np.empty(count, np.int64)
    check_status(ctx_place(readonly(base), dtype.exponent_shift, np.uint64(dtype.exponent_mask),
                           keys, starts, keys.size, ranks, np.zeros(count, np.uint64), pos,
                           np.empty(count, np.uint64), np.empty(count, base.dtype)), where)
    return replace(seg, positions=Positions.GAPS, pos_bytes=encode_gaps(pos))


def _sum(out: np.ndarray | None) -> np.ndarray:
    return _NO_SUM if out is None else out


def apply_segment(seg: Segment, dst: np.ndarray, dtype: DType, undo: UndoLog,
                  where: str, *, dnew: np.ndarray | None = None,
                  dold: np.ndarray | None = None, inverse: bool = False,
                  prepared: PreparedSegment | None = None) -> UndoEntry | None:
    """Apply a segment in place to dst (the bits of exactly [seg.start, seg.stop)).

    Every element changed is recorded in `undo` before a FormatError (corrupt streams) is
    raised, so the caller's rollback restores dst exactly. Returns the entry recorded (None for
    a dense segment into a fresh destination, which records nothing).

    dnew / dold (uint64[2] or None): on success, the digest lanes (format/spec.md §4) of the
    words written / the words they replaced are added to them, computed in the same pass
    (kernels.py: the words are not read back).

    inverse: undo the segment instead: dst holds the words it produced and gets back the words
    it was encoded against (xor: the same XOR; add: the difference subtracted).

    prepared: the segment decoded while staging against the words dst holds
    (`codec.prepared`): only its words are written, each checked against the staged old one
    (BaseMismatch, after recording what was written, if dst changed since), and all of them
    against the staged seal (IntegrityError); the digest lanes are the staged ones.

    Raises:
        UsageError: dst is not the segment's range in the dtype's words.
        FormatError: a coding the format forbids (`coding.check_coding`), a segment that is
            not `invertible` with inverse=True (both before touching dst), or corrupt streams.
    """
    if prepared is not None and not inverse:  # its coding was checked while staging it
        entry = apply_prepared(prepared, dst, undo, where)  # checks dst against it
        for out, lanes in ((dnew, prepared.new_lanes), (dold, prepared.old_lanes)):
            if out is not None:
                out += lanes  # uint64: wraps, as the kernels' sums do
        return entry
    if dst.size != seg.numel or dst.dtype != dtype.uint:
        raise UsageError(f"{where}: destination {dst.dtype}[{dst.size}] for {seg.numel} "
                         f"{dtype.name} elements")
    check_coding(seg.op, seg.positions, seg.values, where, is_float=dtype.is_float)
    op = int(seg.op)
    if inverse:
        if not seg.invertible:
            raise FormatError(f"{where}: a {seg.op.name.lower()}/{seg.positions.name.lower()} "
                              "segment cannot be applied inversely (only xor/add with gaps or "
                              "bitmap positions can)")
        op = K.OP_SUB if seg.op == Op.ADD else op
    if seg.op == Op.DENSE:
        return _apply_dense(seg, dst, dtype, undo, where, dnew, dold)
    check_sparse(seg, dtype, dst, where)
    if seg.positions in CONTEXT_CODINGS:  # decoded against dst's words before any is changed
        seg = decode_ctx(seg, dst, dtype, where)
    mask, _ = width_masks(dtype)
    undo_pos = np.empty(seg.count, np.int64)
    undo_val = np.empty(seg.count, dtype.uint)
    vals = readonly(seg.val_bytes)
    if seg.positions == Positions.GAPS:
        status, done = K.apply_gap_stream(dst, readonly(seg.pos_bytes), op, int(seg.values),
                                          vals, seg.count, mask, undo_pos, undo_val, seg.start,
                                          _sum(dnew), _sum(dold))
    elif seg.positions == Positions.GROUPS:
        keys, counts, offset = group_table(seg, dtype, where)
        status, done = K.apply_group_stream(
            dst, dtype.exponent_shift, np.uint64(dtype.exponent_mask), keys, counts,
            readonly(seg.pos_bytes[offset:]), op, int(seg.values), vals, seg.count, mask,
            undo_pos, undo_val, seg.start, _sum(dnew), _sum(dold))
    else:  # BITMAP (check_coding refused ALL)
        pos = bitmap_positions(seg, where)
        status, done = K.apply_positions(dst, readonly(pos), op, int(seg.values), vals,
                                         seg.count, mask, undo_pos, undo_val, seg.start,
                                         _sum(dnew), _sum(dold))
    entry = UndoEntry(dst, undo_pos, undo_val, int(done))
    undo.entries.append(entry)
    check_status(status, where)
    return entry


def _apply_dense(seg: Segment, dst: np.ndarray, dtype: DType, undo: UndoLog, where: str,
                 dnew: np.ndarray | None, dold: np.ndarray | None) -> UndoEntry | None:
    if seg.count != seg.numel or seg.pos_bytes.size:
        raise FormatError(f"{where}: a dense segment of {seg.numel} elements with count "
                          f"{seg.count} and {seg.pos_bytes.size} position bytes (must be "
                          f"{seg.numel} and 0)")
    if seg.val_bytes.size != seg.numel * dtype.width:
        raise FormatError(f"{where}: dense segment has {seg.val_bytes.size} bytes, "
                          f"expected {seg.numel * dtype.width}")
    src = seg.val_bytes.view(dtype.uint)
    if dnew is None and dold is None:
        entry = None if undo.fresh else UndoEntry(dst, None, dst.copy(), 0)
        if entry is not None:
            undo.entries.append(entry)
        np.copyto(dst, src)
        return entry
    entry = None if undo.fresh else UndoEntry(dst, None, np.empty_like(dst), 0)
    if entry is not None:
        undo.entries.append(entry)
    K.copy_words(dst, readonly(src), np.empty(0, dtype.uint) if entry is None else entry.old,
                 seg.start, _sum(dnew), _sum(dold))
    return entry
