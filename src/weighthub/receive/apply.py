"""Apply a step's chunks in place, recording every old word in the undo log.

Chunks cover disjoint ranges, so they apply in parallel on `workers` threads (the kernels
release the GIL). With incremental verification each chunk's digest change is taken by the
thread that just applied it (see `apply_step`). Every job finishes before an error propagates,
so a rollback never races an apply.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch

from ..codec import UndoLog, apply_segment
from ..codec.prepared_many import apply_prepared_rows, row_changes
from ..digest import digest_sub, lanes_digest
from ..digest.words import digest_words_affine
from ..errors import PlacementError
from ..layout import ShardBox
from ..targets.base import Views, unique_views
from ..tensors import Words, words_numel
from . import device
from .inputs import Chunk, Step
from .rows import Rows, plan_rows


@dataclass(frozen=True, slots=True)
class Applied:
    """What a step changed: (tensor index, digest change) pairs, and the busy seconds of apply
    and of digest work summed over the threads (for the pause's bookkeeping)."""

    changes: list[tuple[int, bytes]]
    busy_apply: float
    busy_verify: float


def apply_step(step: Step, views: Mapping[str, Words], alias: dict[str, str], undo: UndoLog,
               touched: set[int], *, incremental: bool, where: str, workers: int) -> Applied:
    """Apply every chunk of `step` in place; returns its digest changes (incremental only).

    A full representation's change is the digest of each range written (from nothing), read
    back after the chunk. A delta's is, per segment, Σ mix(new) − mix(old) over the elements
    it rewrote, folded in by the apply kernel as it writes each word (so it counts as apply
    time): mix(new) always, mix(old) unless it was staged from the held bits before the
    pause. A prepared segment (`codec.prepared`) staged both halves; its scatter proves by a
    seal that it wrote exactly the staged words. Measured on 2 cores at 2% changed, folding
    costs ~0.2x the apply where reading the new words back after it cost ~1x, and folding the
    old half in the pause ~0.25x (staging it costs more CPU, ~1.2x, but outside the pause).
    Not re-reading memory is safe because `check_disjoint` refused targets whose views partly
    overlap. `alias`: the views'
    unique_views. `where`: prefix of chunk names in messages (the store's url).
    `touched` receives the index of every tensor the step wrote.

    A chunk's small segments that staging prepared in bulk (`codec.prepared_many`) are
    scattered in one call per chunk (`apply_prepared_rows`, its own undo entry), the others one
    by one (`apply_segment`): 8000 tensors of 4096 words paid ~5 µs of Python a segment. Which
    are rows was chosen while staging (`receive.rows`), where the views are still the ones read.

    A tensor whose view is torch words is applied on its device (`receive.device`): its
    segments were decoded while staging (`Chunk.decoded`), or are decoded here against the
    words it holds now (a later step of a chain); its digest changes come back to the host once
    per chunk.
    """
    specs = step.specs
    touched.update(i for i, s in enumerate(specs) if alias[s.name] != s.name)  # verify aliases
    full = step.full

    def apply_chunk(chunk: Chunk) -> tuple[list[tuple[int, bytes]], float, float]:
        t0 = time.thread_time()
        fold = incremental and not full
        olds = chunk.olds if chunk.olds is not None else [None] * len(chunk.frame.segments)
        decoded = chunk.decoded if chunk.decoded is not None else [None] * len(olds)
        prepared = chunk.prepared if chunk.prepared is not None else [None] * len(olds)
        changes: list[tuple[int, bytes]] = []
        on_device: list[tuple[int, torch.Tensor]] = []
        name = f"{where}/{chunk.ref.key}"
        segments = chunk.frame.segments
        # the small segments staged in bulk: their rows, as staging chose them when these are
        # still the views it read (else chosen here), scattered a group at a time
        plan = chunk.rows
        if plan is None or step.inverse or not plan.holds(views, alias):
            plan = plan_rows(segments, specs, views, None if step.inverse else chunk.prepared,
                             alias)
        for rows in plan.batches:
            changes += _scatter_rows(rows, undo, name, fold=fold)
            touched.update(rows.tensors)
        for i in plan.others:
            seg, seg_old, dseg, prep = segments[i], olds[i], decoded[i], prepared[i]
            spec = specs[seg.tensor]
            if alias[spec.name] != spec.name:
                continue  # tied to an earlier name: its bits change through that one
            view = views[spec.name]
            if isinstance(view, torch.Tensor):
                dst_t = view[seg.start: seg.stop]
                if dseg is None:
                    dseg = device.decode_segment(seg, dst_t, spec.dtype, name,
                                                 pinned=dst_t.is_cuda)
                lanes = device.apply_segment(dseg, dst_t, spec.dtype, undo, inverse=step.inverse,
                                             fold=fold, where=name)
                if lanes is not None:
                    on_device.append((seg.tensor, lanes))
                touched.add(seg.tensor)
                continue
            dst = view[seg.start: seg.stop]
            dnew = np.zeros(2, np.uint64) if fold else None
            dold = np.zeros(2, np.uint64) if fold and seg_old is None else None
            apply_segment(seg, dst, spec.dtype, undo, name,
                          dnew=dnew, dold=dold, inverse=step.inverse, prepared=prep)
            if dnew is not None:
                changes.append((seg.tensor, lanes_digest(dnew - dold) if dold is not None  # wraps
                                else digest_sub(lanes_digest(dnew), seg_old or b"")))
            touched.add(seg.tensor)
        changes += zip([ti for ti, _ in on_device],
                       device.lanes_to_digests([lanes for _, lanes in on_device]), strict=True)
        ref = chunk.ref
        if full:
            touched.update(ti for ti, _s, _e in ref.covers)
            touched.update(ti for ti, _o, _s in ref.boxes)
        t1 = time.thread_time()
        if incremental and full:
            changes = [(ti, digest_words_affine(views[specs[ti].name][a:b], a, (1,)))
                       for ti, a, b in ref.covers if alias[specs[ti].name] == specs[ti].name]
            for ti, offset, shape in ref.boxes:  # a box: its strided view, placed, no copy
                if alias[specs[ti].name] == specs[ti].name:
                    box = ShardBox(specs[ti].shape, tuple(offset), tuple(shape))
                    block = views[specs[ti].name].reshape(specs[ti].shape)[box.slices]
                    changes.append((ti, digest_words_affine(block, box.first, box.strides)))
        return changes, t1 - t0, time.thread_time() - t1

    jobs: list[Future[tuple[list[tuple[int, bytes]], float, float]]] = []
    failed = threading.Event()
    with ThreadPoolExecutor(apply_threads(step, views, workers)) as pool:
        try:
            for chunk in step.chunks:  # a stream (join) is applied as it arrives
                if failed.is_set():
                    break  # a chunk failed: stop pulling from the stream, roll back
                job = pool.submit(apply_chunk, chunk)
                job.add_done_callback(lambda j: failed.set() if j.exception() else None)
                jobs.append(job)
        finally:
            wait(jobs)
    done = [job.result() for job in jobs]
    return Applied([c for d in done for c in d[0]], sum(d[1] for d in done),
                   sum(d[2] for d in done))


def _scatter_rows(rows: Rows, undo: UndoLog, where: str, *, fold: bool
                  ) -> list[tuple[int, bytes]]:
    """Scatter a batch of staged rows in one call; their digest changes (the staged lanes)
    when the caller folds them."""
    apply_prepared_rows(rows.group, rows.rows, rows.dsts, rows.keep, undo, where)
    if not fold:
        return []
    return list(zip(rows.tensors, row_changes(rows.group, rows.rows), strict=True))


# Below this many changed words per changed tensor on average, one apply thread beats two:
# each segment costs a few kernel calls, and each call releases the GIL, which two threads
# then hand over twice a call. Pauses on this 2-core machine (fast, 2% changed, bf16 tensors
# of equal size, medians of 8 per run, two runs each way): 8000 x 4096 elements (82 changes a
# tensor) 123-131 ms on one thread vs 141-174 on two; 2000 x 16384 (328) 48-50 vs 48-59;
# 256 x 524288 (10.5k) 33-41 vs 24-32.
_THREADED_TENSOR_CHANGES = 256


def apply_threads(step: Step, views: Mapping[str, Words], workers: int) -> int:
    """How many threads apply `step`: `workers`, or one for a delta into host words whose
    tensors change too few words each for two threads to gain more than their GIL hand-overs
    cost. Full steps and targets with device words keep `workers`."""
    if workers <= 1 or step.full or step.changes_per_tensor >= _THREADED_TENSOR_CHANGES:
        return workers
    if any(isinstance(v, torch.Tensor) for v in views.values()):
        return workers
    return 1


def layout_of(views: Mapping[str, Words], names: Sequence[str]) -> dict[str, str]:
    """The `unique_views` of `names`' views, checked disjoint (`check_disjoint`). Remembered on
    views a target keeps between transactions (`targets.base.Views`), so a model of 8000
    tensors does not pay ~35 ms for it in every pause; callers only read it."""
    key = tuple(names)
    memo = views.layouts if isinstance(views, Views) else None
    alias = memo.get(key) if memo is not None else None
    if alias is None:
        alias = unique_views({n: views[n] for n in key})
        check_disjoint(views, alias)
        if memo is not None:
            memo.clear()  # one set of names per target in practice: keep only the newest
            memo[key] = alias
    return alias


def check_disjoint(views: Mapping[str, Words], alias: dict[str, str]) -> None:
    """Refuse a target whose writable views partly overlap in memory.

    Exact aliases (tied weights) are fine: unique_views applies through one name only. A partial
    overlap is not: writes through one name would change another's words behind the digests,
    which the apply kernels compute from what they write without re-reading memory, and chunks
    applying in parallel could race on the shared words. One sort of the views' byte extents;
    extents that intersect (strided views can interleave without sharing a byte) are decided by
    np.shares_memory, bounded, and a pair it cannot decide counts as overlapping. `alias`: the
    views' unique_views. ~2 µs a view (1236 views: 2.5 ms). Torch word views are contiguous
    (targets refuse others), so on one device intersecting extents share memory; each device
    is its own address space (the host's holds numpy and CPU torch views alike).
    """
    spans = sorted((*_byte_extent(views[name]), name) for name, first in alias.items()
                   if first == name and words_numel(views[name]))
    open_: list[tuple[int, str]] = []  # (end, name) of extents still reaching past the cursor
    space = None
    for where, lo, hi, name in spans:
        if where != space:
            open_, space = [], where
        open_ = [(end, other) for end, other in open_ if end > lo]
        for _end, other in open_:
            a, b = views[name], views[other]
            if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
                shared = True  # contiguous views with intersecting extents
            else:
                try:
                    shared = np.shares_memory(a, b, max_work=1 << 16)
                except np.exceptions.TooHardError:
                    shared = True
            if shared:
                raise PlacementError(f"the target's tensors {other!r} and {name!r} partly share "
                                     "memory (neither is an exact alias of the other): weighthub "
                                     "cannot update one without the other; give each tensor its "
                                     "own storage, or tie them as exact aliases")
        open_.append((hi, name))


def _byte_extent(v: Words) -> tuple[str, int, int]:
    """(address space, first, last + 1) byte addresses a view's elements occupy."""
    if isinstance(v, torch.Tensor):
        space = "cpu" if v.device.type == "cpu" else str(v.device)
        return space, v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()
    lo, hi = _host_extent(v)
    return "cpu", lo, hi


def _host_extent(v: np.ndarray) -> tuple[int, int]:
    lo = hi = v.ctypes.data
    if v.flags.c_contiguous:
        return lo, lo + v.nbytes
    for n, st in zip(v.shape, v.strides, strict=True):
        lo += min(0, (n - 1) * st)
        hi += max(0, (n - 1) * st)
    return lo, hi + v.itemsize
