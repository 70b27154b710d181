"""Coder throughput on one thread, side by side on the same buffers (issue #16 item 4).

For one delta (old → new over many tensors, one segment per tensor), in one run, round-robin
over `reps` repeats so that every figure sees the same machine noise:

    xor             np.bitwise_xor(old, new, out=preallocated): the ceiling of any encoder
    scan            codec.changed_positions: change detection alone
    encode_compact  the delta coded with the `compact` profile (context coding on: ans) as the
                    publisher codes it: the tensors of at most SMALL_RANGE elements in one
                    codec.small.encode_small call per dtype (with their digest changes), the
                    others one encode_segment each
    encode_fast     the same with the `fast` profile (plain gaps, no ctx, no groups)
    ctx_encode      the context coder alone (`compact`'s: ans): codec.ctx.ctx_streams on the
                    scan's compacted changes
    ctx_decode      codec.ctx.decode_changes: the context-coded streams decoded and placed
                    against the base words (positions and values as coded), the decode proper
    ctx_stage       codec.prepared.prepare_segment of the compact segment: all that a receiver
                    runs for it while staging (the decode, the held and new words, the digest
                    halves and the seal), so the pause only scatters
    range_encode, range_decode
                    ctx_encode and ctx_decode for the range coder (`ctx`, coder="range"), side
                    by side
    pause_staged    the pause of the compact segment as a receiver runs it: the scatter of the
                    words its staging prepared (codec.prepared), or for what staging does not
                    prepare (dense segments) the apply kernel folding the digest change
    pause_fast      the same for the delta coded `fast`

Units. xor, scan, encode and pause: GB/s of state (old tensor bytes, 1e9 per second), and
encode/scan as a ratio to the XOR pass. ctx_encode, ctx_decode, ctx_stage: MB/s of *compact stream*,
defined as 4 bytes of position + W bytes of value per changed element (W = the dtype's width:
6 bytes for bf16), i.e. the size of an int32-index + raw-word listing of the same changes, so
the figure does not depend on how well the coder compresses; and ns per changed word. They
cover the tensors whose compact segment is ctx-coded (the others have no ctx stream).

Every figure is the best of `reps` passes (a pause: of PAUSE_PASSES runs in each), with the
median and worst kept as the spread.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from ..codec import Positions, Segment, UndoLog, Values, apply_segment, changed_positions, encode_segment
from ..codec.apply import regap_segment
from ..codec.coding import CONTEXT_CODINGS, ENCODE_PROFILES, EncodePolicy
from ..codec.ctx import ctx_streams, decode_changes
from ..codec.prepared import PreparedSegment, prepare_segment
from ..codec.small import SmallRange, bulk_ready, codes_in_bulk, encode_small
from ..tensors import DType
from .throughput import Pair

POSITION_BYTES = 4  # the compact stream's bytes per changed element, besides the value word
STATE_FIGURES = ("xor", "scan", "encode_compact", "encode_fast", "pause_staged", "pause_fast")
CTX_FIGURES = ("ctx_encode", "ctx_decode", "ctx_stage", "range_encode", "range_decode")
PAUSE_PASSES = 8  # timed runs of each pause per pass (each short; see _measure)


@dataclass(slots=True)
class _Prepared:
    """One tensor's buffers and the segments the timed passes reuse (built once, untimed)."""

    pair: Pair
    pos: np.ndarray
    oldv: np.ndarray
    newv: np.ndarray
    compact: Segment | None
    staged: Segment | None
    fast: Segment | None
    ranged: Segment | None  # the compact segment's changes, range-coded (if context-coded)
    # what a receiver's staging prepares for its pause (None: applied by the kernels there)
    staged_words: PreparedSegment | None
    fast_words: PreparedSegment | None


def compact_stream_bytes(changed: int, width: int) -> int:
    """Bytes of the compact stream of `changed` elements of `width` bytes (see module doc)."""
    return changed * (POSITION_BYTES + width)


def _spread(amount: float, seconds: list[float], unit: float) -> dict[str, float]:
    rates = sorted(amount / s / unit for s in seconds if s > 0) or [0.0]
    return {"best": rates[-1], "median": statistics.median(rates), "worst": rates[0]}


def _prepare(pairs: Sequence[Pair], compact: EncodePolicy, fast: EncodePolicy) -> list[_Prepared]:
    out = []
    for i, p in enumerate(pairs):
        pos = changed_positions(p.old, p.new)
        c = encode_segment(p.old, p.new, p.dtype, tensor=i, start=0, policy=compact)
        f = encode_segment(p.old, p.new, p.dtype, tensor=i, start=0, policy=fast)
        staged = None if c is None else regap_segment(c, p.old, p.dtype, f"bench tensor {i}")
        ranged = None
        if c is not None and c.positions in CONTEXT_CODINGS:
            streams = ctx_streams(p.old, pos, p.old[pos], p.new[pos], p.dtype, c.op, Positions.CTX)
            ranged = None if streams is None else replace(c, positions=Positions.CTX,
                                                          values=Values.CTX, pos_bytes=streams[0],
                                                          val_bytes=streams[1])
        words = [None if seg is None else prepare_segment(seg, p.old, p.dtype, f"bench tensor {i}")
                 for seg in (staged, f)]
        out.append(_Prepared(p, pos, p.old[pos], p.new[pos], c, staged, f, ranged, *words))
    return out


def measure(pairs: Sequence[Pair], *, reps: int = 3,
            compact: EncodePolicy = ENCODE_PROFILES["compact"],
            fast: EncodePolicy = ENCODE_PROFILES["fast"]) -> dict[str, Any]:
    """Single-thread coder throughput of one delta (see the module docstring for the figures).

    Args:
        pairs: the tensors of one step (old and new bits).
        reps: passes per figure; the best is reported with the spread.
        compact, fast: the two encode policies compared.
    Returns:
        {"state_bytes", "changed", "gbps": {figure: spread}, "ratio_to_xor": {figure: best ÷ xor
        best}, "ctx": {"changed", "segments", "compact_stream_bytes", "wire_bytes", "mbps":
        {figure: spread}, "ns_per_word": {figure: best}}, "pause_ratio": staged ÷ fast best}.
    Raises:
        RuntimeError: a pause or a ctx decode did not reproduce the delta bit-exactly.
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(pairs, reps, compact, fast)
    finally:
        torch.set_num_threads(prev_threads)


def _measure(pairs: Sequence[Pair], reps: int, compact: EncodePolicy,
             fast: EncodePolicy) -> dict[str, Any]:
    prep = _prepare(pairs, compact, fast)  # also the warm-up of scan and both encoders
    n = len(prep)
    scratch = [np.empty_like(p.new) for p in pairs]
    ctx_idx = [i for i, t in enumerate(prep) if t.compact is not None
               and t.compact.positions in CONTEXT_CODINGS and t.ranged is not None]
    decoded: list[tuple[np.ndarray, ...] | None] = [None] * n
    range_decoded: list[tuple[np.ndarray, ...] | None] = [None] * n
    staged: list[PreparedSegment | None] = [None] * n

    def reset() -> None:
        for dst, p in zip(scratch, pairs, strict=True):
            np.copyto(dst, p.old)

    def pause(which: str) -> Callable[[int], object]:
        def work(i: int) -> None:  # as a receiver's pause runs it, verifying incrementally
            seg, words = getattr(prep[i], which), getattr(prep[i], f"{which}_words")
            if seg is not None:
                folds = (None, None) if words is not None else (np.zeros(2, np.uint64),
                                                                  np.zeros(2, np.uint64))
                apply_segment(seg, scratch[i], pairs[i].dtype, UndoLog(), f"bench tensor {i}",
                              dnew=folds[0], dold=folds[1], prepared=words)
        return work

    def encoder(attr: str) -> Callable[[int], object]:  # the context coder alone
        def work(i: int) -> None:
            t, seg = prep[i], getattr(prep[i], attr)
            assert seg is not None  # ctx_idx holds only context-coded tensors
            ctx_streams(t.pair.old, t.pos, t.oldv, t.newv, t.pair.dtype, seg.op, seg.positions)
        return work

    def decoder(attr: str, into: list[tuple[np.ndarray, ...] | None]) -> Callable[[int], object]:
        def work(i: int) -> None:
            seg = getattr(prep[i], attr)
            assert seg is not None
            into[i] = decode_changes(seg, pairs[i].old, pairs[i].dtype, f"bench tensor {i}")
        return work

    def stager(i: int) -> None:
        seg = prep[i].compact
        assert seg is not None
        staged[i] = prepare_segment(seg, pairs[i].old, pairs[i].dtype, f"bench tensor {i}")

    every = range(n)
    figures: dict[str, tuple[Callable[[int], object], Sequence[int], bool]] = {
        "xor": (lambda i: np.bitwise_xor(pairs[i].old, pairs[i].new, out=scratch[i]), every, False),
        "scan": (lambda i: changed_positions(pairs[i].old, pairs[i].new), every, False),
        "encode_compact": (_as_published(pairs, compact), every, False),
        "encode_fast": (_as_published(pairs, fast), every, False),
        "ctx_encode": (encoder("compact"), ctx_idx, False),
        "ctx_decode": (decoder("compact", decoded), ctx_idx, False),
        "ctx_stage": (stager, ctx_idx, False),
        "range_encode": (encoder("ranged"), ctx_idx, False),
        "range_decode": (decoder("ranged", range_decoded), ctx_idx, False),
        "pause_staged": (pause("staged"), every, True),
        "pause_fast": (pause("fast"), every, True),
    }
    for name, (work, idx, resets) in figures.items():  # warm-up, and the exactness checks
        if resets:
            reset()
        for i in idx:
            work(i)
        if resets:
            _check_exact(name, scratch, pairs)
    for i in ctx_idx:  # the changes the scan found, and (through the stage) their words
        t, words = prep[i], staged[i]
        for got in (decoded[i], range_decoded[i]):
            if got is None or not (np.array_equal(got[0], t.pos) and np.array_equal(got[2], t.oldv)):
                raise RuntimeError(f"decode_changes of tensor {i}: not the scan's positions and words")
        if words is None or not (np.array_equal(words.pos, t.pos) and np.array_equal(words.old, t.oldv)
                                 and np.array_equal(words.new, t.newv)):
            raise RuntimeError(f"prepare_segment of tensor {i}: not the delta's words")
    secs: dict[str, list[float]] = {name: [] for name in figures}
    for _ in range(reps):  # round-robin: every figure sees the same stretch of machine noise
        for name, (work, idx, resets) in figures.items():
            # a pause (~2 ms on MiniLM) is timed PAUSE_PASSES times per pass: best of 3 put
            # two identical scatters 0.85-0.95x apart (alternated, best of 20 each: 0.97x)
            for _ in range(PAUSE_PASSES if resets else 1):
                if resets:
                    reset()
                t0 = time.perf_counter()
                for i in idx:
                    work(i)
                secs[name].append(time.perf_counter() - t0)
    return _result(prep, ctx_idx, secs)


def _as_published(pairs: Sequence[Pair], policy: EncodePolicy) -> Callable[[int], object]:
    """The encode of tensor i as the publisher runs it (publish.stream.coded_in_bulk): a small
    tensor that encode_small takes is coded with all those of its dtype, in one call at the
    first of them; any other by encode_segment."""
    bulk: dict[DType, list[int]] = {}
    for i, p in enumerate(pairs):
        if bulk_ready(p.old, p.new) and codes_in_bulk(policy, p.dtype):
            bulk.setdefault(p.dtype, []).append(i)
    first = {ids[0]: (dtype, [SmallRange(i, 0, pairs[i].old, pairs[i].new) for i in ids])
             for dtype, ids in bulk.items()}
    in_bulk = {i for ids in bulk.values() for i in ids}

    def work(i: int) -> object:
        if i in first:
            dtype, ranges = first[i]
            return encode_small(ranges, dtype, policy)
        if i in in_bulk:
            return None
        return encode_segment(pairs[i].old, pairs[i].new, pairs[i].dtype, tensor=i, start=0,
                              policy=policy)
    return work


def _check_exact(name: str, scratch: list[np.ndarray], pairs: Sequence[Pair]) -> None:
    bad = [i for i, (dst, p) in enumerate(zip(scratch, pairs, strict=True))
           if not np.array_equal(dst, p.new)]
    if bad:
        raise RuntimeError(f"{name}: not bit-exact on {len(bad)} tensor(s), first {bad[0]}")


def _result(prep: list[_Prepared], ctx_idx: list[int], secs: dict[str, list[float]]) -> dict[str, Any]:
    state = sum(t.pair.old.nbytes for t in prep)
    changed = sum(int(t.pos.size) for t in prep)
    gbps = {name: _spread(state, secs[name], 1e9) for name in STATE_FIGURES}
    xor = gbps["xor"]["best"]
    ctx_changed = sum(int(prep[i].pos.size) for i in ctx_idx)
    stream = sum(compact_stream_bytes(int(prep[i].pos.size), prep[i].pair.dtype.width) for i in ctx_idx)
    wire = range_wire = 0
    for i in ctx_idx:
        seg, ranged = prep[i].compact, prep[i].ranged
        wire += 0 if seg is None else int(seg.pos_bytes.size + seg.val_bytes.size)
        range_wire += 0 if ranged is None else int(ranged.pos_bytes.size + ranged.val_bytes.size)
    mbps = {name: _spread(stream, secs[name], 1e6) for name in CTX_FIGURES}
    ns = {name: (min(secs[name]) * 1e9 / ctx_changed if ctx_changed else 0.0) for name in CTX_FIGURES}
    fast = gbps["pause_fast"]["best"]
    return {
        "state_bytes": state, "changed": changed,
        "change_rate": changed / sum(t.pair.old.size for t in prep) if prep else 0.0,
        "tensors": len(prep), "gbps": gbps,
        "ratio_to_xor": {name: (gbps[name]["best"] / xor if xor else 0.0)
                         for name in ("scan", "encode_compact", "encode_fast")},
        "ctx": {"changed": ctx_changed, "segments": len(ctx_idx), "compact_stream_bytes": stream,
                "wire_bytes": wire, "range_wire_bytes": range_wire, "mbps": mbps,
                "ns_per_word": ns},
        "pause_ratio": gbps["pause_staged"]["best"] / fast if fast else 0.0,
    }
