"""The delta encoder: changed elements of a range, and the smallest coding of them (spec §2).

`encode_segment` picks the smallest op/position/value combination per segment by an order-0
entropy estimate of each candidate stream (a close proxy for zstd-1, at a fraction of the cost
of compressing every candidate). Arrays reach the kernels in one form (`tensors.readonly` for
what they only read), so each kernel compiles once per word width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..digest import digest_sub
from ..digest.linear import digest_affine, digest_change
from ..errors import UsageError
from ..tensors import DType, readonly
from . import kernels as K
from .coding import CONTEXT_CODERS, CONTEXT_CODINGS, EncodePolicy, Op, Positions, Values
from .ctx import ctx_streams_ranked, group_ranks
from .scan import Changes, ranked_scan_applies, scan_range, scan_ranked
from .segment import Segment

DEFAULT_POLICY = EncodePolicy()

# Expected dense+zstd-1 size relative to raw for float weights (measured 0.78 for bf16).
_DENSE_RATIO = 0.8
# Group probe: this many windows of this many elements, on segments at least 4x their total.
_PROBE_WINDOWS = 8
_PROBE_WINDOW = 1 << 18


# Group context of changes: (lo, hi, pos) → (keys uint64, ranks int64) of the changed positions
# `pos` (relative to lo, increasing) within elements [lo, hi) of the range's old words. Where
# the old words live decides who computes it: the host kernels here, or a device
# (codec/device.py) that sends only these compact arrays; the coders then see the same input.
RankFn = Callable[[int, int, np.ndarray], "tuple[np.ndarray, np.ndarray]"]


def host_ranks(old: np.ndarray, dtype: DType) -> RankFn:
    """The RankFn of old words held on the host."""
    return lambda lo, hi, pos: group_ranks(old[lo:hi], pos, dtype)


def _known_ranks(old: np.ndarray, dtype: DType, ch: Changes, keys: np.ndarray,
                 ranks: np.ndarray) -> RankFn:
    """host_ranks, answering for the whole range's changes `ch` with the ranks the scan gave."""
    def ranked(lo: int, hi: int, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if lo == 0 and hi == old.shape[0] and pos is ch.pos:
            return keys, ranks
        return group_ranks(old[lo:hi], pos, dtype)
    return ranked


@dataclass(frozen=True, slots=True)
class RangeChanges:
    """What the coders need of one range, from a scan on the host or on a device.

    changes: every changed element (None: nearly all changed, the scan gave up).
    ranks: the group context of the old words (see RankFn).
    dense: the range's new words on the host (called only when a dense segment is written).
    """

    numel: int
    changes: Changes | None
    ranks: RankFn
    dense: Callable[[], np.ndarray]


def _entropy_bytes(stream: np.ndarray) -> float:
    """Order-0 entropy of a byte stream, in bytes: what zstd-1's Huffman stage approaches."""
    return float(K.stream_estimate(readonly(stream)))


def width_masks(dtype: DType) -> tuple[np.uint64, int]:
    """(2^B − 1, B − 1) for the dtype's width of B bits: the kernels' value mask and sign bit."""
    return _WIDTH_MASKS[dtype.width]  # once per segment: a table, not a numpy scalar made each time


_WIDTH_MASKS = {w: (np.uint64((1 << 8 * w) - 1), 8 * w - 1) for w in (1, 2, 4, 8)}


def _varint_bound(count: int) -> int:
    return count * 10 + 16


def _encode_vals(ch: Changes, codec: Values, dtype: DType) -> np.ndarray:
    if codec == Values.RAW:  # the new words themselves, little-endian
        return np.ascontiguousarray(ch.new, ch.new.dtype.newbyteorder("<")).view(np.uint8)
    mask, sign_shift = width_masks(dtype)
    out = np.empty(_varint_bound(ch.pos.size), np.uint8)
    used = K.encode_values(readonly(ch.old), readonly(ch.new), ch.pos.size, int(codec), mask,
                           sign_shift, out)
    return out[:used]


def encode_gaps(pos: np.ndarray) -> np.ndarray:
    """The `gaps` position stream (spec §2) of strictly increasing int64 positions."""
    out = np.empty(_varint_bound(pos.size), np.uint8)
    return out[: K.encode_gaps(readonly(pos.astype(np.int64, copy=False)), pos.size, out)]


def _encode_groups(old: np.ndarray, pos: np.ndarray, dtype: DType) -> np.ndarray:
    """The `groups` position stream of changed positions `pos` of the range `old`."""
    return _encode_ranked_groups(*group_ranks(old, pos, dtype), dtype)


def _encode_ranked_groups(keys: np.ndarray, ranks: np.ndarray, dtype: DType) -> np.ndarray:
    size = dtype.exponent_mask + 1
    out = np.empty(_varint_bound(keys.size + 2 * size), np.uint8)
    return out[: K.encode_group_stream(keys, ranks, keys.size, size, out)]


def _groups_promising(ranks: RankFn, n: int, pos: np.ndarray, dtype: DType) -> bool:
    """Do groups beat gaps on a few evenly spaced windows? (Cheap stand-in for the full pass.)

    Each window is coded as a segment of its own; the per-window group tables count against
    groups, so a marginal gain is not worth the full pass anyway.
    """
    est_groups = est_gaps = 0.0
    for w in range(_PROBE_WINDOWS):
        lo = (n - _PROBE_WINDOW) * w // (_PROBE_WINDOWS - 1)
        hi = lo + _PROBE_WINDOW
        a, b = np.searchsorted(pos, [lo, hi])
        sub = pos[a:b] - lo
        est_gaps += _entropy_bytes(encode_gaps(sub))
        est_groups += _entropy_bytes(_encode_ranked_groups(*ranks(lo, hi, sub), dtype))
    return est_groups < est_gaps


def _choose_values(ch: Changes, dtype: DType, policy: EncodePolicy
                   ) -> tuple[float, Op, Values, np.ndarray]:
    """The smallest allowed value coding by order-0 entropy, estimated on a strided sample,
    and its stream."""
    est, op, codec = _pick_values(ch, dtype, policy)
    return est, op, codec, _encode_vals(ch, codec, dtype)


def _pick_values(ch: Changes, dtype: DType, policy: EncodePolicy) -> tuple[float, Op, Values]:
    """The smallest allowed value coding by order-0 entropy, estimated on a strided sample."""
    count = ch.pos.size
    stride = max(1, count // policy.value_sample) if policy.value_sample > 0 else 1
    mask, sign_shift = width_masks(dtype)
    scale = count / len(range(0, count, stride))
    add, xor, raw = K.value_estimates(readonly(ch.old), readonly(ch.new), count, stride, mask,
                                      sign_shift, scale)
    candidates = [(raw, Op.OVERWRITE, Values.RAW)]
    if policy.mask_ops:
        candidates = [(add, Op.ADD, Values.ZIGZAG), (xor, Op.XOR, Values.VARINT), *candidates]
    return min(candidates, key=lambda c: c[0])


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
    return encode_range(_host_scan(old, new, dtype, policy), dtype, tensor=tensor, start=start,
                        policy=policy)


def _host_range(old: np.ndarray, new: np.ndarray, dtype: DType, ch: Changes | None
                ) -> RangeChanges:
    return RangeChanges(new.size, ch, host_ranks(old, dtype), lambda: new)


def _host_scan(old: np.ndarray, new: np.ndarray, dtype: DType, policy: EncodePolicy
               ) -> RangeChanges:
    """The range's changes, with their ranks from the same pass over the words where they
    will be context-coded (scan.scan_ranked: 0.63-0.72x the time of the scan and the ranks
    apart, on MiniLM's tensors at 0.3-3% changed)."""
    n = new.size
    if not (codes_in_context(policy, dtype, n) and ranked_scan_applies(n, dtype)):
        return _host_range(old, new, dtype, scan_range(old, new, _scan_limit(n)))
    found = scan_ranked(old, new, dtype, _scan_limit(n))
    if found is None:
        return _host_range(old, new, dtype, None)
    ch, keys, ranks = found
    return RangeChanges(n, ch, _known_ranks(old, dtype, ch, keys, ranks), lambda: new)


def codes_in_context(policy: EncodePolicy, dtype: DType, n: int) -> bool:
    """Does encode_range try a context coding for a range of n elements of `dtype`?"""
    return (policy.ctx and policy.groups and policy.mask_ops and dtype.is_float
            and (n > SMALL_RANGE or not policy.shared_tables))  # small ones share tables


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
    rc = _host_scan(old, new, dtype, policy)
    ch = rc.changes
    if ch is None:
        change = digest_sub(digest_affine(new, start, (1,), threads=1),
                            digest_affine(old, start, (1,), threads=1))
    else:
        change = digest_change(ch.pos, ch.old, ch.new, first=start)
    return encode_range(rc, dtype, tensor=tensor, start=start, policy=policy), change


def _scan_limit(n: int) -> int:
    # Even at 50% changed a bitmap + small differences is far below dense (~0.2 vs 0.78 of the
    # bf16 bytes, measured at lr 1e-4), so only give up on the delta when nearly every word
    # changed; the limit also bounds the scan's buffers (12 bytes per changed element). Small
    # ranges (step counters, scalars, short biases) are always scanned: their buffers are tiny,
    # and the size comparison in _encode still picks dense when that is smaller, but a counter
    # that changes every step no longer forces a dense segment, which would make the whole delta
    # impossible to undo on a rollback (catalog.invertible).
    return n if n <= SMALL_RANGE else n - n // 16


SMALL_RANGE = 4096  # elements: always scanned; coded by what they write (encode_range)
# Bytes a sparse xor/add segment may cost beyond dense and still be chosen: it keeps the delta
# invertible (a rollback undoes it instead of fetching a full version); only ties on tiny
# ranges are decided by it.
_INVERTIBLE_SLACK = 4


def encode_range(rc: RangeChanges, dtype: DType, *, tensor: int, start: int,
                 policy: EncodePolicy = DEFAULT_POLICY) -> Segment | None:
    """The smallest coding of one range's changes (see encode_segment), from a scan's result.

    The same function whether the scan ran on the host or on a device: the choice and the bytes
    depend only on the changes and their group context, so both backends write identical frames.
    """
    n, ch = rc.numel, rc.changes
    if ch is None:  # nearly everything changed
        return _dense_segment(tensor, start, rc.dense())
    pos = ch.pos
    if pos.size == 0:
        return None
    dense_est = n * dtype.width * (_DENSE_RATIO if dtype.is_float else 1.0)
    val_est, op, val_codec = _pick_values(ch, dtype, policy)
    ctx = None
    if codes_in_context(policy, dtype, n):
        ctx = _ctx_segment(rc, dtype, tensor, start, op, policy)
        if ctx is not None and pos.size >= _CTX_SURE:
            # on this many changes the context coder's adaptive models have learnt what order-0
            # coders cannot (measured on every real and synthetic trajectory of the bench), so
            # the other candidates are not built: only dense could still win
            ctx_bytes = ctx.pos_bytes.size + ctx.val_bytes.size
            return ctx if ctx_bytes < dense_est + _INVERTIBLE_SLACK \
                else _dense_segment(tensor, start, rc.dense())

    # positions: gaps always; groups for floats with enough changes; bitmap when dense-ish
    candidates = _position_candidates(pos, n)
    if (ctx is None and policy.groups and dtype.is_float and pos.size >= policy.min_group_count
            and (not policy.group_probe or n < 4 * _PROBE_WINDOWS * _PROBE_WINDOW
                 or _groups_promising(rc.ranks, n, pos, dtype))):
        grouped = _encode_ranked_groups(*rc.ranks(0, n, pos), dtype)
        # after gaps, before a bitmap: `min` keeps the first of equal estimates, as it always did
        candidates.insert(1, (_entropy_bytes(grouped), Positions.GROUPS, grouped))
    pos_est, pos_codec, pos_bytes = min(candidates, key=lambda c: c[0])

    val_bytes = _encode_vals(ch, val_codec, dtype)
    if n <= SMALL_RANGE:
        # a small range's streams are too short for zstd to shrink (the estimates' fixed 16-byte
        # table cost would make dense win for a lone changed counter): compare what is written
        sparse_bytes, dense_bytes = float(pos_bytes.size + val_bytes.size), float(n * dtype.width)
    else:
        sparse_bytes, dense_bytes = pos_est + val_est, dense_est
    if ctx is not None and ctx.pos_bytes.size + ctx.val_bytes.size < min(sparse_bytes, dense_bytes):
        return ctx
    if sparse_bytes >= dense_bytes + _INVERTIBLE_SLACK:
        return _dense_segment(tensor, start, rc.dense())
    return Segment(tensor, start, start + n, op, pos_codec, val_codec, int(pos.size),
                   pos_bytes, val_bytes)


# Changes above which a ctx segment is taken without building the order-0 candidates.
_CTX_SURE = 4096


def _ctx_segment(rc: RangeChanges, dtype: DType, tensor: int, start: int, op: Op,
                 policy: EncodePolicy) -> Segment | None:
    """The context-coded segment (the policy's coder) of these changes with the op the value
    estimate chose, or None where that is overwrite (values that xor/add do not code smaller:
    context codings code only those two) or the changes span more exponent groups than the
    coding models."""
    ch = rc.changes
    if op == Op.OVERWRITE or ch is None:
        return None
    coding = CONTEXT_CODERS[policy.coder]
    streams = ctx_streams_ranked(*rc.ranks(0, rc.numel, ch.pos), ch.old, ch.new, dtype, op,
                                 coding)
    if streams is None:
        return None
    pos_bytes, val_bytes = streams
    return Segment(tensor, start, start + rc.numel, op, coding, CONTEXT_CODINGS[coding],
                   int(ch.pos.size), pos_bytes, val_bytes)


def _position_candidates(pos: np.ndarray, n: int) -> list[tuple[float, Positions, np.ndarray]]:
    """(estimated bytes, coding, stream) of the codings that need no base bits: gaps always, a
    bitmap where more than one element in 16 changed."""
    gaps = encode_gaps(pos)
    candidates = [(_entropy_bytes(gaps), Positions.GAPS, gaps)]
    if pos.size * 16 > n:
        bitmap = np.zeros((n + 7) // 8, np.uint8)
        K.positions_bitmap(readonly(pos), bitmap)
        candidates.append((_entropy_bytes(bitmap), Positions.BITMAP, bitmap))
    return candidates


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
        UsageError: no changes, or positions/words of different lengths, or outside the range.
    """
    n = stop - start
    if pos.size == 0 or not pos.shape == old.shape == new.shape or pos.ndim != 1:
        raise UsageError(f"encode_changes: {pos.size} positions, {old.shape} old, {new.shape} new")
    if int(pos[0]) < 0 or int(pos[-1]) >= n:
        raise UsageError(f"encode_changes: positions outside [0, {n})")
    pos = pos.astype(np.int64, copy=False)
    pos_est, pos_codec, pos_bytes = min(_position_candidates(pos, n), key=lambda c: c[0])
    val_est, op, val_codec, val_bytes = _choose_values(Changes(pos, old, new), dtype, policy)
    if pos_est + val_est >= dense_numel * dtype.width * (_DENSE_RATIO if dtype.is_float else 1.0):
        return None
    return Segment(tensor, start, stop, op, pos_codec, val_codec, int(pos.size), pos_bytes,
                   val_bytes)


