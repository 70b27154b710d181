"""Step 2 of a publish: the bounded encode → put stream of one representation.

A rank cuts its shards into chunks of pieces (`layout.plan_pieces`; a whole tensor is one
piece run, so a single process tiles exactly as `chunking.tile` does), encodes each chunk on
a small thread pool (the codec kernels and zstd release the GIL) and puts it to the store as
soon as it is ready, on threads of its own: an encoder never waits for the network (a put to
an S3 store on loopback takes ~15-25 ms a chunk, as long as encoding one), so later chunks
keep encoding meanwhile. At most `2 × workers` encoded chunks are in memory. Along the way it
sums its digest contributions: the baseline's plus each segment's change (from nothing for a
full representation), so a delta costs O(changed) in digests too. An extra representation of
a committed version (anchor, skip delta) knows its digests already and computes none.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TypeVar, cast

import numpy as np
import torch

from ..codec import EncodePolicy, Segment, device_encode
from ..codec.coding import coding_name
from ..codec.encode import (
    SMALL_RANGE,
    encode_changes,
    encode_segment,
    encode_segment_tracked,
)
from ..codec.scan import changed_positions
from ..codec.small import SmallRange, bulk_ready, codes_in_bulk, encode_small
from ..digest import ZERO_DIGEST, add_digests, digest_add, digest_affine, digest_change
from ..errors import UsageError
from ..format import ChunkRef, chunk_checksum, encode_chunk
from ..layout import Piece, Run, ShardBox, plan_pieces
from ..store import Store
from ..tensors import DType, Words
from .baseline import Baseline, as_device_words
from .group import Failure
from .shards import Shard

_T = TypeVar("_T")


@dataclass(slots=True)
class Written:
    """What a rank wrote of one representation (or why it could not); gathered at the commit."""

    rank: int
    failure: Failure | None = None
    refs: list[ChunkRef] = field(default_factory=list)
    changed: dict[str, int] = field(default_factory=dict)
    ops: dict[str, set[str]] = field(default_factory=dict)
    digests: dict[str, bytes] = field(default_factory=dict)  # contributions at the new version
    # this rank's timing (busy seconds summed over threads; the phase's wall time)
    encode_seconds: float = 0.0
    encode_cpu_seconds: float = 0.0  # the encoders' CPU time: below encode_seconds, preempted
    upload_seconds: float = 0.0
    stream_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Stream:
    """Where and how one rank streams one representation.

    prefix: the representation's chunk directory (`v…/full-<token>`); chunk i is
        `{prefix}/{leaf}c{i:06d}.whc`, `leaf` naming the rank in a group (`r00001-`).
    boxed: tensors covered by boxes (some rank holds them strided).
    track: sum digest contributions (False for an extra representation of a committed version).
    """

    store: Store
    prefix: str
    leaf: str
    policy: EncodePolicy
    workers: int
    span_bytes: int
    boxed: frozenset[int]
    track: bool = True


def write_chunks(stream: Stream, shards: dict[str, Shard], base: Baseline | None, out: Written,
                 keys: list[str]) -> None:
    """Encode and put this rank's chunks of one representation (a delta from `base`, or full).

    Fills `out` (refs in chunk order, change counts, ops, digest contributions, timing) and
    appends every key put to `keys` as it goes, so a caller can delete them on failure.
    """
    mine = [s for s in shards.values() if s.published]
    chunks = plan_pieces([(s.index, s.spec.dtype.width, s.box) for s in mine], stream.span_bytes,
                         boxed=stream.boxed)
    by_index = {s.index: s for s in mine}
    encoders = encoder_threads(chunks, by_index, stream.workers)
    lock = threading.Lock()

    def put(key: str, frame: bytes) -> None:
        t0 = time.perf_counter()
        stream.store.put(key, frame)
        with lock:
            out.upload_seconds += time.perf_counter() - t0

    def encode(i: int, pieces: list[Piece]
               ) -> tuple[Future[None], ChunkRef, list[Segment], list[tuple[int, bytes]]]:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        segments: list[Segment] = []
        changes: list[tuple[int, bytes]] = []
        covers: list[tuple[int, int, int]] = []
        boxes: list[tuple[int, list[int], list[int]]] = []
        policy = chunk_policy(pieces, stream.policy)
        bulk = coded_in_bulk(pieces, by_index, base, policy, stream.boxed)
        for j, piece in enumerate(pieces):
            shard = by_index[piece.tensor]
            old = None if base is None else base.bits[shard.spec.name]
            if j in bulk:
                segs, change, run = bulk[j]
                covers.append((piece.tensor, run.start, run.stop))
            elif piece.tensor in stream.boxed:
                segs, change = encode_box_piece(piece, shard, old, policy, stream.track)
                offset, shape = piece.region()
                boxes.append((piece.tensor, list(offset), list(shape)))
            else:
                segs, change = encode_piece(piece, shard, old, policy, stream.track)
                covers += piece.covers()
            segments += segs
            changes.append((piece.tensor, change))
        frame = encode_chunk(segments, version=stream.policy.frame_version)
        key = f"{stream.prefix}/{stream.leaf}c{i:06d}.whc"
        ref = ChunkRef(key, len(frame), chunk_checksum(frame), covers, boxes)
        with lock:
            keys.append(key)
            out.encode_seconds += time.perf_counter() - t0
            out.encode_cpu_seconds += time.thread_time() - cpu0
        # streamed out while this thread encodes a later chunk
        return uploads.submit(put, key, frame), ref, segments, changes

    # a delta adds the effect of its changes to the committed contributions; a full
    # representation starts from nothing and adds every run's words
    digests = {s.spec.name: ZERO_DIGEST if base is None else base.digests[s.spec.name]
               for s in mine}
    tracked: list[tuple[str, bytes]] = []  # (tensor, digest change) of every chunk
    t_start = time.perf_counter()
    # Left in reverse order: the chunks still to encode are cancelled (after a failure), then
    # the encoders finish (a running encode still submits its put), then the puts: every key
    # put is in `keys` by the time this returns or raises.
    with ThreadPoolExecutor(stream.workers, thread_name_prefix="weighthub-put") as uploads, \
            ThreadPoolExecutor(encoders) as pool, \
            contextlib.closing(bounded_map(pool, encode, list(enumerate(chunks)),
                                           2 * stream.workers)) as encoded:
        for stored, ref, segments, changes in encoded:
            stored.result()  # in order: a chunk that failed to store fails the stream here
            out.refs.append(ref)
            for seg in segments:
                name = by_index[seg.tensor].spec.name
                out.changed[name] = out.changed.get(name, 0) + seg.count
                out.ops.setdefault(name, set()).add(coding_name(seg.op, seg.positions, seg.values))
            if stream.track:
                tracked += [(by_index[ti].spec.name, change) for ti, change in changes]
    out.stream_seconds = time.perf_counter() - t_start
    if stream.track:
        add_digests(digests, tracked)
        out.digests = digests


# A chunk with at least this many pieces of at most SMALL_RANGE elements, holding most of its
# elements, codes them for one shared zstd table (EncodePolicy.shared_tables).
_SHARED_MIN_PIECES = 8


def chunk_policy(pieces: list[Piece], policy: EncodePolicy) -> EncodePolicy:
    """The policy of one chunk: with `shared_tables` where it is mostly small pieces.

    Their order-0 streams then make the frame zstd'd (format/chunk.py), one table for all,
    which context-coding each small range separately cannot beat: 14-24% more bytes than
    `fast` on models of thousands of 2-4k-element tensors at 2-5% changed. In a chunk of large
    ranges, the few small ones' streams would go raw (the frame is nearly all context-coded,
    so not zstd'd), and in a chunk of one small range they would pay a table of their own:
    there each is context-coded whenever that is smaller than what it would write. Pieces
    decide it, not bytes: every backend and every rank count alike.
    """
    if not (policy.ctx and policy.groups) or policy.shared_tables:
        return policy  # no context coding, or the caller chose
    small = total = count = 0
    for p in pieces:
        n = p.hi - p.lo
        total += n
        if n <= SMALL_RANGE:
            small, count = small + n, count + 1
    if count >= _SHARED_MIN_PIECES and 2 * small >= total:
        return replace(policy, shared_tables=True)
    return policy


def coded_in_bulk(pieces: list[Piece], shards: dict[int, Shard], base: Baseline | None,
                  policy: EncodePolicy, boxed: frozenset[int]
                  ) -> dict[int, tuple[list[Segment], bytes, Run]]:
    """The segments, digest change and run of each piece (by its index in `pieces`) that is
    one small host range of a delta coded without context: all of a dtype in one kernel call
    (codec.small), as encode_piece would code them one by one."""
    if base is None:
        return {}
    by_dtype: dict[DType, list[tuple[int, SmallRange, Run]]] = {}
    for j, piece in enumerate(pieces):
        shard = shards[piece.tensor]
        if (piece.hi - piece.lo > SMALL_RANGE or piece.tensor in boxed
                or isinstance(shard.new, torch.Tensor) or not codes_in_bulk(policy, shard.spec.dtype)):
            continue
        runs, old = piece.runs(), base.bits[shard.spec.name]
        if len(runs) != 1 or not isinstance(old, np.ndarray):
            continue
        run = runs[0]
        before, after = old[run.lo:run.hi], shard.new[run.lo:run.hi]
        if bulk_ready(before, after):
            by_dtype.setdefault(shard.spec.dtype, []).append(
                (j, SmallRange(piece.tensor, run.start, before, after), run))
    coded: dict[int, tuple[list[Segment], bytes, Run]] = {}
    for dtype, items in by_dtype.items():
        done = encode_small([r for _, r, _ in items], dtype, policy)
        for (j, _, run), (seg, change) in zip(items, done, strict=True):
            coded[j] = ([] if seg is None else [seg], change, run)
    return coded


# Below this mean piece size (elements), one encoder thread beats two. Each piece costs ~10
# kernel calls, and each call releases the GIL: with two encoder threads every release hands
# the GIL to the other and the return waits to get it back, two context switches a call. On
# this 2-core machine (fast, 2% changed, 64 MB bf16 in equal tensors, one run each way):
# 8000 x 4096 elements 0.43-0.51 s of chunk phase on one thread vs 0.63-0.79 on two; 2000 x
# 16384 0.15 vs 0.25-0.31; 512 x 131072 even (0.07-0.10 both); 256 x 262144 0.06-0.08 vs
# 0.05-0.06; 256 x 524288 (128 MB) 0.09-0.11 vs 0.06-0.09.
_THREADED_PIECE_ELEMENTS = 1 << 17


def encoder_threads(chunks: list[list[Piece]], shards: dict[int, Shard], workers: int) -> int:
    """How many threads encode: `workers`, or one for host shards whose pieces are too small
    on average for two threads to gain more than their GIL hand-overs cost. Device shards keep
    `workers` (their threads overlap transfers, not host kernels)."""
    pieces = [p for c in chunks for p in c]
    if workers <= 1 or not pieces or any(isinstance(shards[p.tensor].new, torch.Tensor)
                                         for p in pieces):
        return workers
    mean = sum(p.hi - p.lo for p in pieces) / len(pieces)
    return workers if mean >= _THREADED_PIECE_ELEMENTS else 1


def bounded_map(pool: ThreadPoolExecutor, fn: Callable[[int, list[Piece]], _T],
                items: list[tuple[int, list[Piece]]], depth: int) -> Generator[_T, None, None]:
    """pool.map, in order, with at most `depth` results in flight (each holds an encoded chunk)."""
    pending: list[Future[_T]] = []
    try:
        for i, pieces in items:
            pending.append(pool.submit(fn, i, pieces))
            while len(pending) >= depth:
                yield pending.pop(0).result()
        while pending:
            yield pending.pop(0).result()
    finally:
        for f in pending:
            f.cancel()


def encode_piece(piece: Piece, shard: Shard, old: Words | None, policy: EncodePolicy,
                 track: bool) -> tuple[list[Segment], bytes]:
    """Segments of one piece, one per canonical run that changed, and its digest change.

    Each run is contiguous in canonical order, so a run's segment (and its digest change) is
    exactly what a single process encodes for that flat range. Without a base, every run is a
    dense segment and the change is the runs' whole contribution. Torch words (a shard on a
    device) are scanned where they live (codec/device_encode.py), with the same result.
    """
    segments: list[Segment] = []
    change = ZERO_DIGEST
    new = shard.new
    for run in piece.runs():
        before = None if old is None else old[run.lo:run.hi]
        if isinstance(new, torch.Tensor):  # scanned where it lives; a host baseline uploaded
            seg, d = device_encode.encode_run(
                None if before is None else as_device_words(before, new), new[run.lo:run.hi],
                shard.spec.dtype, tensor=piece.tensor, start=run.start, policy=policy,
                track=track)
        else:
            seg, d = _host_run(None if before is None else host_only(before), new[run.lo:run.hi],
                               shard.spec.dtype, tensor=piece.tensor, start=run.start,
                               policy=policy, track=track)
        change = d if change is ZERO_DIGEST else digest_add(change, d)  # mostly one run
        if seg is not None:
            segments.append(seg)
    return segments, change


def _host_run(old: np.ndarray | None, new: np.ndarray, dtype: DType, *, tensor: int, start: int,
              policy: EncodePolicy, track: bool) -> tuple[Segment | None, bytes]:
    """One run's segment and (with `track`) digest change, scanned on the host."""
    if track:
        return encode_segment_tracked(old, new, dtype, tensor=tensor, start=start, policy=policy)
    return encode_segment(old, new, dtype, tensor=tensor, start=start, policy=policy), ZERO_DIGEST


def host_only(words: Words) -> np.ndarray:
    """Host words as they are (a device baseline under a host shard cannot happen: baselines
    are copies of the shards' own bits, or host copies)."""
    if isinstance(words, np.ndarray):
        return words
    raise UsageError("a host-scanned shard with a baseline on a device: publish with one backend")


def encode_box_piece(piece: Piece, shard: Shard, old: Words | None, policy: EncodePolicy,
                     track: bool) -> tuple[list[Segment], bytes]:
    """Segments of a piece that is a box of a strided shard, and its digest change.

    A delta is one sparse segment over the box's flat bounding range, its positions the changed
    elements' canonical ones (they skip the other ranks' elements in between), or one dense
    segment per run when that is smaller. Without a base: dense runs, and the digest of the
    box's words placed by its affine map (one pass, no copy).
    """
    box = piece.sub_box()
    new = shard.new[piece.lo:piece.hi]
    if isinstance(new, torch.Tensor):  # a device shard: scanned there, coded here
        if old is None:
            new = device_encode.host_words(new, shard.spec.dtype)
        else:
            local, was, now = device_encode.changes_of(
                as_device_words(old[piece.lo:piece.hi], new), new)
            return _box_delta(piece, box, local, was, now, shard, policy, track)
    if old is None:
        start = box.span[0]
        change = digest_affine(new.reshape(box.shape), start, box.strides, threads=1) if track \
            else ZERO_DIGEST
        return _dense_runs(piece, shard, new), change
    before = host_only(old[piece.lo:piece.hi])
    local = changed_positions(before, new)
    return _box_delta(piece, box, local, before[local], new[local], shard, policy, track)


def _box_delta(piece: Piece, box: ShardBox, local: np.ndarray, was: np.ndarray, now: np.ndarray,
               shard: Shard, policy: EncodePolicy, track: bool) -> tuple[list[Segment], bytes]:
    """The delta segments of a box piece from its changed local positions and their words."""
    if local.size == 0:
        return [], ZERO_DIGEST
    start, stop = box.span
    pos = box.canonical(local) - start  # increasing: row-major order is kept by the box map
    change = digest_change(pos, was, now, first=start) if track else ZERO_DIGEST
    seg = encode_changes(pos, was, now, shard.spec.dtype, tensor=piece.tensor, start=start,
                         stop=stop, dense_numel=box.numel, policy=policy)
    if seg is not None:
        return [seg], change
    new = shard.new[piece.lo:piece.hi]
    if isinstance(new, torch.Tensor):
        new = device_encode.host_words(new, shard.spec.dtype)
    return _dense_runs(piece, shard, new), change


def _dense_runs(piece: Piece, shard: Shard, new: np.ndarray) -> list[Segment]:
    """One dense segment per canonical run of a piece (`new`: the piece's host words)."""
    return [cast(Segment, encode_segment(None, new[r.lo - piece.lo:r.hi - piece.lo],
                                         shard.spec.dtype, tensor=piece.tensor, start=r.start))
            for r in piece.runs()]
