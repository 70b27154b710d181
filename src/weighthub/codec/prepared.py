"""Prepared segments: a delta's words computed while staging, so the pause is a checked scatter.

The first delta of a receiver's route applies to the bits the target holds now, and they do not
change before the pause (the receiver's lock, and `held` checked under it). So while staging
every sparse segment (context-coded ones placed straight from their coder, `ctx.decode_changes`;
grouped ones re-coded to gaps first, `regap_segment`; gap and bitmap positions as they are) is
decoded against those bits: its positions, the words there now, the words it writes, both
halves of the digest change Σ mix(new) − Σ mix(old) (spec §4), and a seal of the words it
writes (`seal_of`). The pause then only writes the new words (`apply_prepared`):
- each word it overwrites must be the one staged (any difference means the target was changed
  outside the receiver: BaseMismatch, rolled back like any failed apply);
- the words it wrote must be the ones staged: after the scatter the staged words are sealed
  again and must give the staged seal (IntegrityError, rolled back). So verification still
  covers what was written: the staged digest change proves the staged words are the
  version's, the seal that the pause wrote those (a staged array changed in memory since
  staging, by a bug or a bit flip, is caught).
The undo log is the staged positions and old words themselves: the pause allocates nothing per
word.

The sums run in their own passes over the contiguous staged arrays, which LLVM vectorizes
(AVX-512 here): all four digest lanes and the seal ~0.4 ns a word, the seal alone ~0.2. Folded
inside the gather or the scatter loop, which cannot be vectorized, they cost ~8 ns a word; but a
segment of under `SEALED_SCATTER` words is scattered and sealed in one loop, as one kernel call
(each call costs ~1.5 µs: a model of thousands of small tensors paid it twice a tensor).
Measured on SmolLM2-135M at 2.2% of bf16 words changed (3.5M), side by side: the scatter alone
~5 ns a word (memory), with its seal pass the same; the pause of that step with 2 threads
17–18 ms where the scatter folding mix(new) as it wrote took 26–29 ms (and the fused decode +
apply kernel ~30 ns a word); its staging on one thread 49–59 ms against 77–86 ms. The price is
host memory from staging until the apply: 12 bytes per changed bf16 word (int64 position, old
and new word; 8 more per word of a segment while it is being decoded), where the undo log of the
fused kernel takes 10 in the pause.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..digest.mix import fold
from ..errors import BaseMismatch, FormatError, IntegrityError, UsageError
from ..kernel_cache import njit
from ..tensors import DType, readonly
from .coding import CONTEXT_CODINGS, Op, Positions
from .ctx import decode_changes
from .encode import width_masks
from .kernels import _combine, decode_gap_stream, decode_value_stream, prefetch
from .segment import Segment, UndoEntry, UndoLog, bitmap_positions, check_sparse, check_status

if TYPE_CHECKING:
    from .prepared_many import PreparedGroup


@dataclass(frozen=True, slots=True)
class PreparedSegment:
    """A sparse segment decoded against the held words of its range (see module doc)."""

    pos: np.ndarray  # int64, strictly increasing, in [0, numel)
    old: np.ndarray  # the held words there (the dtype's uint)
    new: np.ndarray  # the words the segment writes there
    old_lanes: np.ndarray  # uint64[2]: Σ mix(first + p, old word), the digest's old half
    new_lanes: np.ndarray  # uint64[2]: Σ mix(first + p, new word), its new half
    seal: int  # `seal_of(pos, new, first)` when staged: what the pause must find it wrote
    first: int  # the canonical index of the range's element 0 (the segment's start)
    numel: int
    # staged in bulk (`prepared_many`): the chunk's arrays these are row `row` of, which the
    # pause may scatter together with the chunk's other small segments in one call
    group: PreparedGroup | None = None
    row: int = -1


def prepare_segment(seg: Segment, base: np.ndarray, dtype: DType,
                    where: str) -> PreparedSegment | None:
    """`seg` decoded against `base` (the held words of exactly its range, read only); None for
    what is not prepared (dense segments, whose words are the frame's; grouped positions, which
    staging re-codes as gaps first).

    Raises:
        UsageError: `base` is not the segment's range in the dtype's words.
        FormatError: as the apply kernels would in the pause; a count the gap stream cannot
            hold is refused before anything is allocated.
    """
    if seg.op == Op.DENSE or seg.positions == Positions.GROUPS:
        return None
    check_sparse(seg, dtype, base, where)
    mask, _ = width_masks(dtype)
    # the values as coded (z): transient, off the pause
    if seg.positions in CONTEXT_CODINGS:  # placed straight from the coder, no gap re-coding
        pos, z, old = decode_changes(seg, base, dtype, where)  # the old words read while placing
        new = np.empty(seg.count, dtype.uint)
        combine_held(old, z, int(seg.op), mask, new)
        return _sealed(seg, pos, old, new)
    if seg.positions == Positions.BITMAP:
        pos = bitmap_positions(seg, where)  # its size and popcount checked: ≤ numel
        z = np.empty(seg.count, np.uint64)
        check_status(decode_value_stream(int(seg.values), readonly(seg.val_bytes), seg.count,
                                         dtype.width, z), where)
    else:
        check_gap_count(seg, where)
        pos = np.empty(seg.count, np.int64)
        z = np.empty(seg.count, np.uint64)
        old = np.empty(seg.count, dtype.uint)
        new = np.empty(seg.count, dtype.uint)
        lanes = np.zeros(4, np.uint64)
        status, sealed = prepare_gap_segment(
            readonly(seg.pos_bytes), int(seg.values), readonly(seg.val_bytes), seg.count,
            seg.numel, dtype.width, readonly(base), int(seg.op), mask, seg.start, pos, z, old,
            new, lanes)
        check_status(status, where)
        return PreparedSegment(pos, old, new, lanes[:2], lanes[2:], int(sealed), seg.start,
                               seg.numel)
    old = np.empty(seg.count, dtype.uint)
    new = np.empty(seg.count, dtype.uint)
    combine_prepared(readonly(base), pos, z, int(seg.op), mask, old, new)
    return _sealed(seg, pos, old, new)


def _sealed(seg: Segment, pos: np.ndarray, old: np.ndarray, new: np.ndarray) -> PreparedSegment:
    """The prepared segment of these words, with its digest halves and seal."""
    lanes = np.zeros(4, np.uint64)
    sealed = staged_sums(pos, old, new, seg.start, lanes)
    return PreparedSegment(pos, old, new, lanes[:2], lanes[2:], int(sealed), seg.start, seg.numel)


def check_gap_count(seg: Segment, where: str) -> None:
    """Refuse a count the gap stream cannot hold (every gap takes at least one byte) before
    anything is allocated for it."""
    if seg.count > seg.pos_bytes.size:
        raise FormatError(f"{where}: {seg.count} changes in a {seg.pos_bytes.size}-byte gap "
                          "stream")


def apply_prepared(prep: PreparedSegment, dst: np.ndarray, undo: UndoLog,
                   where: str) -> UndoEntry:
    """Write `prep`'s new words into `dst` (the segment's range), recording them in `undo`;
    the undo entry. The digest lanes of what it wrote are `prep.new_lanes` (the seal proves it).

    Raises:
        UsageError: `dst` is not a range of the prepared size and word type.
        BaseMismatch: a word of `dst` is not the one staged (the target changed since
            staging); the words written before it are in `undo`, for the caller's rollback.
        IntegrityError: the words written are not the ones staged (their seal differs: the
            staged arrays changed since staging); every word written is in `undo`.
    """
    if dst.size != prep.numel or dst.dtype != prep.old.dtype:
        raise UsageError(f"{where}: destination {dst.dtype}[{dst.size}] for a segment prepared "
                         f"as {prep.old.dtype}[{prep.numel}]")
    if prep.pos.size < SEALED_SCATTER:  # one kernel call: its dispatch outweighs the words
        done, seal = scatter_sealed(dst, prep.pos, prep.old, prep.new, prep.first)
    else:
        done, seal = scatter_prepared(dst, prep.pos, prep.old, prep.new), None
    entry = UndoEntry(dst, prep.pos, prep.old, done)
    undo.entries.append(entry)
    if done != prep.pos.size:
        raise BaseMismatch(f"{where}: element {int(prep.pos[done])} of the segment no longer "
                           "holds the word it held when the version was staged: the target was "
                           "changed outside this receiver; nothing kept, stage it again")
    # after the scatter: the staged words it read must still be those sealed while staging
    if seal is None:
        seal = seal_of(prep.pos, prep.new, prep.first)
    if int(seal) != prep.seal:
        raise IntegrityError(f"{where}: the words the apply wrote are not the ones staged (their "
                             "seal differs: the staged arrays changed in memory since staging); "
                             "rolled back, stage it again")
    return entry


_SEAL_K = np.uint64(0x9E3779B97F4A7C15)
# below this many words a segment is scattered and sealed in one kernel call (`scatter_sealed`)
SEALED_SCATTER = 4096
# The pause's scatter and staging's gather ask the cache for the word of the change this many
# changes ahead. Their positions rise but skip lines and cross pages, where the hardware's
# stream prefetchers stop following. On 135M bf16 words (a SmolLM2-sized tensor) with the
# cache flushed before each run, Intel Xeon (AVX-512), best of 5, against no prefetch: the
# scatter 0.79x its time at 2.4% changed (21.6 -> 17.0 ms), 0.80x at 1%, 0.76x at 0.3%, 0.85x
# at 10%, the same at 30%; the gather 0.83x at 2.4%, 0.90x at 1%. 64, 96 and 128 ahead read
# the same within 5% from 0.05% to 5% changed; 128 gained 8% more at 10%.
AHEAD = 96


@njit(cache=True, nogil=True, boundscheck=False)
def prepare_gap_segment(pos_bytes, codec, vals, count, numel, width, base, op, mask, first,
                        pos, z, old, new, lanes):
    """A gap-coded segment's staging in one kernel call: `decode_gap_stream`, then
    `combine_prepared` and `staged_sums` (each its own loop, as before: only the calls are
    fused; a model of thousands of small tensors paid ~1.5 µs a call, three a tensor).
    (status, seal): a negative status is the decode's refusal, and nothing else was done."""
    status = decode_gap_stream(pos_bytes, codec, vals, count, numel, width, pos, z)
    if status < 0:
        return status, np.uint64(0)
    combine_prepared(base, pos, z, op, mask, old, new)
    return status, staged_sums(pos, old, new, first, lanes)


@njit(cache=True, nogil=True, boundscheck=False)
def combine_prepared(base, pos, z, op, mask, out_old, out_new):
    """out_old/out_new = the words of `base` at `pos` (decoded and checked: in range,
    increasing) and what `op` makes of them with the decoded values `z`. Asks the cache for
    the word AHEAD changes on (see there)."""
    last = pos.shape[0] - 1
    for t in range(pos.shape[0]):
        prefetch(base, pos[min(t + AHEAD, last)])
        o = base[pos[t]]
        out_old[t] = o
        out_new[t] = _combine(np.uint64(o), z[t], op, mask)


@njit(cache=True, nogil=True, boundscheck=False)
def combine_held(old, z, op, mask, out_new):
    """out_new = what `op` makes of the held words `old` with the decoded values `z` (a pass
    over contiguous arrays: the words were gathered by the placement)."""
    for t in range(old.shape[0]):
        out_new[t] = _combine(np.uint64(old[t]), z[t], op, mask)


@njit(cache=True, nogil=True, boundscheck=False)
def staged_sums(pos, old, new, first, lanes):
    """Adds Σ mix(first + p, old word) to lanes[0:2] and Σ mix(first + p, new word) to
    lanes[2:4]; returns the seal of the new words (`seal_of`). One pass over contiguous
    arrays, which LLVM vectorizes (~0.4 ns a word, where folding inside the gather or the
    scatter loop costs ~8)."""
    f1 = np.uint64(first) + np.uint64(1)
    o0 = o1 = n0 = n1 = s = np.uint64(0)
    for t in range(pos.shape[0]):
        i1 = f1 + np.uint64(pos[t])
        w = np.uint64(new[t])
        o0, o1 = fold(o0, o1, i1, np.uint64(old[t]))
        n0, n1 = fold(n0, n1, i1, w)
        s += (i1 * _SEAL_K) ^ w
    lanes[0] += o0
    lanes[1] += o1
    lanes[2] += n0
    lanes[3] += n1
    return s


@njit(cache=True, nogil=True, boundscheck=False)
def seal_of(pos, new, first):
    """Σ ((first + p + 1) · K) ^ word over the pairs: one multiply a word, so any one changed
    word or position changes the sum (K is odd: i · K is a bijection); vectorized, ~0.2 ns."""
    f1 = np.uint64(first) + np.uint64(1)
    s = np.uint64(0)
    for t in range(pos.shape[0]):
        s += ((f1 + np.uint64(pos[t])) * _SEAL_K) ^ np.uint64(new[t])
    return s


@njit(cache=True, nogil=True, boundscheck=False)
def scatter_sealed(dst, pos, old, new, first):
    """`scatter_prepared` and `seal_of` the words written, in one loop: for a short segment,
    whose two kernel calls cost more than its words (a large one seals in a vectorized pass)."""
    f1 = np.uint64(first) + np.uint64(1)
    s = np.uint64(0)
    for t in range(pos.shape[0]):
        p = pos[t]
        if dst[p] != old[t]:
            return t, s
        w = new[t]
        dst[p] = w
        s += ((f1 + np.uint64(p)) * _SEAL_K) ^ np.uint64(w)
    return pos.shape[0], s


@njit(cache=True, nogil=True, boundscheck=False)
def scatter_prepared(dst, pos, old, new):
    """dst[pos[t]] = new[t] in order while dst[pos[t]] == old[t]; how many were written.
    Asks the cache for the word AHEAD changes on (see there)."""
    last = pos.shape[0] - 1
    for t in range(pos.shape[0]):
        prefetch(dst, pos[min(t + AHEAD, last)])
        p = pos[t]
        if dst[p] != old[t]:
            return t
        dst[p] = new[t]
    return pos.shape[0]
