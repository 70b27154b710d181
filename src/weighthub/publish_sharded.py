"""ShardedPublisher: trainer ranks publish their own shards; one manifest commits the version.

No rank gathers a tensor. Each diffs its own shards against its own baseline, maps the changes to
canonical coordinates through the shard's affine box (weighthub.layout), writes its own chunks
and computes its shards' contributions to the linear per-tensor digests. Every publish runs the
same collective steps on every rank of the process group, so a failure anywhere is seen
everywhere:

    1. agree    all_gather: tensor table, shard boxes, baseline (version, root), asked version.
                Every rank checks the same gathered facts (same model, boxes tile every tensor,
                one base, one version); any error → every rank raises, nothing is written.
    2. write    each rank encodes and puts its chunks and sums its digest contributions. A
                tensor every rank holds contiguously (dim-0 shards) is covered by flat ranges;
                one some rank holds strided (Shard(dim > 0): column / row-parallel) is covered
                by boxes, one sparse segment per box piece over canonical positions (spec §3),
                so it costs what the same changes cost in one process.
    3. commit   all_gather: chunk refs, change counts, digests, or the rank's error. The
                committer adds the digests up, puts the manifest create-only (the commit) and
                broadcasts the outcome. A rank that failed or died → nothing is committed.
    4. advance  every rank copies its new shard bits into its baseline, only after a commit.

Every collective wait is bounded by the process group's timeout (`init_process_group(timeout=)`);
a peer that dies makes the others' collective fail (PeerUnavailable), never hang past it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import catalog, errors
from .codec import EncodePolicy, Segment, changed_positions, encode_segment, encode_segment_tracked
from .codec.segment import encode_changes
from .errors import (
    BaseMismatch,
    ModelMismatch,
    ObjectExists,
    PeerUnavailable,
    PlacementError,
    UsageError,
    VersionError,
    WeighthubError,
)
from .format import ChunkRef, Manifest, TensorEntry, chunk_checksum, encode_chunk, encode_manifest
from .format.manifest import KIND, MANIFEST_FORMAT
from .layout import Piece, ShardBox, check_tiling, plan_pieces
from .layout.dtensor import dtensor_box, local_tensor
from .publish import DELTA_SPAN_BYTES, FULL_SPAN_BYTES, PublishResult, collect_garbage, model_id
from .tensors import (
    ZERO_DIGEST,
    TensorSpec,
    bits,
    check_same_model,
    digest_add,
    digest_affine,
    digest_change,
    dtype_named,
    dtype_of,
    root_digest,
)

log = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass(slots=True)
class _Shard:
    """One canonical tensor as this rank holds it."""

    index: int  # position in the canonical (name-ordered) tensor table
    spec: TensorSpec  # the canonical tensor
    box: ShardBox
    new: np.ndarray  # flat local bits (a view of the local tensor when it is contiguous)


@dataclass(slots=True)
class _Baseline:
    version: int
    root: str
    specs: list[TensorSpec]
    bits: dict[str, np.ndarray]  # private copies of this rank's committed primary shards
    digests: dict[str, bytes]  # this rank's digest contributions at `version`


@dataclass(frozen=True, slots=True)
class _Failure:
    rank: int
    kind: str  # class name in weighthub.errors
    message: str


@dataclass(frozen=True, slots=True)
class _Proposal:
    """Phase 1: what a rank holds and asks for."""

    rank: int
    failure: _Failure | None
    table: list[tuple[str, str, tuple[int, ...]]]  # (name, dtype, global shape), name order
    boxes: dict[str, ShardBox]
    base: tuple[int, str] | None  # committed (version, root) of the rank's baseline
    asked: int | None
    latest: int | None = None  # committer only: the store's latest committed version
    token: str = ""  # committer only: names this publish's chunk directory and manifest


@dataclass(frozen=True, slots=True)
class _Plan:
    version: int
    base: tuple[int, str] | None
    specs: list[TensorSpec]
    token: str
    boxed: frozenset[int]  # tensors some rank holds strided: covered by boxes (spec §3)


@dataclass(slots=True)
class _Written:
    """Phase 3: what a rank wrote (or why it could not)."""

    rank: int
    failure: _Failure | None = None
    refs: list[ChunkRef] = field(default_factory=list)
    changed: dict[str, int] = field(default_factory=dict)
    ops: dict[str, set[str]] = field(default_factory=dict)
    digests: dict[str, bytes] = field(default_factory=dict)  # contributions at the new version


class ShardedPublisher:
    """Publishes the shards this rank holds; all ranks of `group` together commit each version.

    Construct one on every rank of the group and call `publish` on every rank for every step.

    Args:
        store: where versions go (every rank must reach the same store).
        group: the torch.distributed process group of the trainer ranks (default: the world).
        committer: the group rank that writes manifests.
        anchor_every: also write a full representation every K versions (0: only the first).
        retain: keep this many newest versions (0: all); the committer deletes older ones.
        policy: which ops and codings the encoder may choose.
        workers: encoder threads per rank.
    """

    def __init__(self, store: Any, *, group: dist.ProcessGroup | None = None, committer: int = 0,
                 anchor_every: int = 16, retain: int = 0, policy: EncodePolicy | None = None,
                 workers: int = 2, delta_span_bytes: int = DELTA_SPAN_BYTES,
                 full_span_bytes: int = FULL_SPAN_BYTES) -> None:
        if not dist.is_initialized():
            raise UsageError("ShardedPublisher needs torch.distributed initialized "
                             "(init_process_group) on every trainer rank")
        if anchor_every < 0 or retain < 0 or workers < 1:
            raise UsageError("anchor_every and retain must be >= 0, workers >= 1")
        if retain and anchor_every and retain < anchor_every:
            raise UsageError(f"retain={retain} is shorter than anchor_every={anchor_every}: "
                             "receivers could be left with no path; raise retain")
        self.store = store
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if not 0 <= committer < self.world:
            raise UsageError(f"committer {committer} is not a rank of the group (size {self.world})")
        self.committer = committer
        self.anchor_every = anchor_every
        self.retain = retain
        self.policy = policy or EncodePolicy()
        self.workers = workers
        self.delta_span_bytes = delta_span_bytes
        self.full_span_bytes = full_span_bytes
        self.id = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._baseline: _Baseline | None = None
        self._tiled: dict[str, list[ShardBox]] | None = None  # the layout already checked

    @property
    def version(self) -> int | None:
        """The last version this rank's baseline holds (committed by the group)."""
        return self._baseline.version if self._baseline else None

    def publish(self, state: Mapping[str, torch.Tensor], *,
                shard_map: Mapping[str, ShardBox] | None = None,
                version: int | None = None) -> PublishResult:
        """Commit the group's state as the next version. Call on every rank of the group.

        Args:
            state: canonical name → this rank's tensor: a DTensor (its box comes from its
                placements) or a plain local shard whose box `shard_map` gives.
            shard_map: boxes of plain local tensors (trainers that do not use DTensor).
            version: the version number to commit (default: the next one); all ranks must agree.

        The first publish of a group is a full version (numbered after the store's latest);
        later ones are deltas against the last version the group committed.

        Raises:
            PlacementError: shard boxes that do not tile a tensor (gap or overlap), or a tensor
                of a placement weighthub cannot map.
            BaseMismatch / VersionError: ranks disagree on their baseline or on the version.
            ModelMismatch: ranks (or successive publishes) disagree on names, dtypes, shapes.
            PeerUnavailable: another rank failed or died; nothing was committed.
            ObjectExists: another publisher committed that version first.
        """
        t0 = time.perf_counter()
        shards: dict[str, _Shard] = {}
        table: list[tuple[str, str, tuple[int, ...]]] = []
        failure: _Failure | None = None
        latest, token = None, ""
        try:  # a local failure is reported in the first collective, so every rank raises
            shards, table = self._resolve(state, shard_map)
            if self.rank == self.committer:
                latest, token = catalog.latest_version(self.store), uuid.uuid4().hex[:12]
        except WeighthubError as exc:
            failure = self._failure(exc)
        base = None if self._baseline is None else (self._baseline.version, self._baseline.root)
        plan = self._agree(_Proposal(self.rank, failure, table, {n: s.box for n, s in shards.items()},
                                     base, version, latest, token))
        index = {s.name: i for i, s in enumerate(plan.specs)}
        for name, shard in shards.items():
            shard.index = index[name]
        written, keys = self._write_rep(plan, shards, full=plan.base is None)
        manifest = self._commit(plan, written, keys)
        self._advance(plan, manifest.root, shards, written[self.rank].digests)
        seconds = time.perf_counter() - t0
        self._write_anchor(plan, manifest, shards)
        if self.rank == self.committer and self.retain:
            collect_garbage(self.store, plan.version, self.retain)
        numel = sum(s.numel for s in plan.specs)
        return PublishResult(plan.version, manifest.base, manifest.dense_bytes,
                             manifest.payload_bytes, manifest.changed, numel, seconds,
                             len(manifest.chunks))

    # -- 0. what this rank holds ---------------------------------------------------------------
    def _resolve(self, state: Mapping[str, torch.Tensor], shard_map: Mapping[str, ShardBox] | None
                 ) -> tuple[dict[str, _Shard], list[tuple[str, str, tuple[int, ...]]]]:
        shard_map = shard_map or {}
        unknown = sorted(set(shard_map) - set(state))
        if unknown:
            raise UsageError(f"shard_map names tensors not in the state: {unknown[:5]}")
        shards: dict[str, _Shard] = {}
        table = []
        for name in sorted(state):
            t = state[name]
            if isinstance(t, DTensor):
                box = dtensor_box(name, t)
            elif name in shard_map:
                box = shard_map[name]
            else:
                raise PlacementError(f"tensor {name!r} is a plain tensor with no entry in "
                                     "shard_map: pass its ShardBox (or a DTensor)")
            local = local_tensor(t).detach()
            if tuple(local.shape) != box.shape:
                raise PlacementError(f"tensor {name!r}: local shard has shape {list(local.shape)}, "
                                     f"its box says {list(box.shape)}")
            if local.device.type != "cpu":
                local = local.cpu()  # only this rank's own shard is copied
            dtype = dtype_of(local)
            spec = TensorSpec(name, dtype, box.global_shape)
            table.append((name, dtype.name, box.global_shape))
            shards[name] = _Shard(-1, spec, box, bits(local))
        return shards, table

    def _failure(self, exc: BaseException) -> _Failure:
        return _Failure(self.rank, type(exc).__name__, str(exc))

    # -- 1. agree ------------------------------------------------------------------------------
    def _agree(self, mine: _Proposal) -> _Plan:
        props: list[_Proposal] = self._all_gather(mine, "agreeing on the version")
        self._raise_failures([p.failure for p in props])
        ref = props[0]
        for p in props[1:]:
            if p.table != ref.table:
                raise ModelMismatch(f"ranks disagree on the tensor table: rank {p.rank} has "
                                    f"{_table_diff(ref.table, p.table)} (vs rank {ref.rank}); "
                                    "every rank must pass the same tensor names")
        specs = [TensorSpec(n, dtype_named(d), tuple(shape)) for n, d, shape in ref.table]
        layout = {n: [p.boxes[n] for p in props] for n, _d, _s in ref.table}
        if layout != self._tiled:
            for name, _d, shape in ref.table:
                check_tiling(name, shape, list(enumerate(layout[name])))
            self._tiled = layout
        bases = {p.base for p in props}
        if len(bases) > 1:
            held = "; ".join(f"rank {p.rank}: " + (f"v{p.base[0]} (root {p.base[1][:12]}…)"
                                                   if p.base else "nothing") for p in props)
            raise BaseMismatch(f"ranks disagree on the committed base ({held}); nothing was "
                               "written: restart every rank's ShardedPublisher together")
        asked = {p.asked for p in props}
        if len(asked) > 1:
            raise VersionError("ranks disagree on the version to publish ("
                               + "; ".join(f"rank {p.rank} asks {p.asked}" for p in props)
                               + "); nothing was written")
        base = ref.base
        if base is not None and self._baseline is not None:
            check_same_model(self._baseline.specs, specs, "the published state")
        head = props[self.committer]
        if base is not None and head.latest is not None and head.latest > base[0]:
            self._baseline = None  # every rank sees the same facts: the group starts afresh
            raise ObjectExists(f"{self.store.url} holds version {head.latest}, committed on top of "
                               f"this group's version {base[0]} by another publisher; nothing was "
                               "written: publish again (a full version)")
        floor = max(-1 if base is None else base[0], -1 if head.latest is None else head.latest)
        version = ref.asked if ref.asked is not None else floor + 1
        if version <= floor:
            raise VersionError(f"version {version} is not after the store's latest "
                               f"{head.latest} / the base {base and base[0]}; nothing was written")
        boxed = frozenset(i for i, (name, _d, _s) in enumerate(ref.table)
                          if any(b.primary and 0 < b.run_len < b.numel for b in layout[name]))
        return _Plan(version, base, specs, head.token, boxed)

    # -- 2. write ------------------------------------------------------------------------------
    def _write_rep(self, plan: _Plan, shards: dict[str, _Shard], *, full: bool
                   ) -> tuple[list[_Written], list[str]]:
        """Encode and put this rank's chunks of one representation; gather what every rank wrote.

        Returns what every rank wrote and the keys of this rank's chunks. On any failure this
        rank deletes its own chunks (a dead rank's stay: garbage, never part of a version).
        """
        mine = _Written(self.rank)
        keys: list[str] = []
        error: Exception | None = None
        try:
            self._encode_all(plan, shards, full, mine, keys)
        except Exception as exc:  # every rank must still reach the gather below, then raise
            error, mine = exc, _Written(self.rank, self._failure(exc))
        try:
            written: list[_Written] = self._all_gather(mine, f"writing version {plan.version}")
        except PeerUnavailable:
            self._delete(keys)
            raise
        failed = [w.failure for w in written if w.failure is not None]
        if failed:
            self._delete(keys)
            if error is not None:
                raise error
            self._raise_failures(failed)
        return written, keys

    def _encode_all(self, plan: _Plan, shards: dict[str, _Shard], full: bool, out: _Written,
                    keys: list[str]) -> None:
        base = None if full else self._baseline
        mine = [s for s in shards.values() if s.box.primary and s.box.numel > 0]
        span = self.full_span_bytes if full else self.delta_span_bytes
        chunks = plan_pieces([(s.index, s.spec.dtype.width, s.box) for s in mine], span,
                             boxed=plan.boxed)
        by_index = {s.index: s for s in mine}
        rep = catalog.rep_name(None if full or plan.base is None else plan.base[0])
        prefix = f"{catalog.version_dir(plan.version)}/{rep}-{plan.token}/r{self.rank:05d}"

        def encode(i: int, pieces: list[Piece]) -> tuple[ChunkRef, list[Segment], list[tuple[int, bytes]]]:
            segments: list[Segment] = []
            changes: list[tuple[int, bytes]] = []
            covers: list[tuple[int, int, int]] = []
            boxes: list[tuple[int, list[int], list[int]]] = []
            for piece in pieces:
                shard = by_index[piece.tensor]
                old = None if base is None else base.bits[shard.spec.name]
                if piece.tensor in plan.boxed:
                    segs, change = _encode_box_piece(piece, shard, old, self.policy)
                    offset, shape = piece.region()
                    boxes.append((piece.tensor, list(offset), list(shape)))
                else:
                    segs, change = _encode_piece(piece, shard, old, self.policy)
                    covers += piece.covers()
                segments += segs
                changes.append((piece.tensor, change))
            frame = encode_chunk(segments)
            key = f"{prefix}-c{i:06d}.whc"
            keys.append(key)
            self.store.put(key, frame)  # streamed out while later chunks are still encoding
            ref = ChunkRef(key, len(frame), chunk_checksum(frame), covers, boxes)
            return ref, segments, changes

        # a delta adds the effect of its changes to the committed contributions; a full
        # representation starts from nothing and adds every run's words
        digests = {s.spec.name: ZERO_DIGEST if base is None else base.digests[s.spec.name]
                   for s in mine}
        with ThreadPoolExecutor(self.workers) as pool:
            for ref, segments, changes in _bounded_map(pool, encode, list(enumerate(chunks)),
                                                       2 * self.workers):
                out.refs.append(ref)
                for seg in segments:
                    name = plan.specs[seg.tensor].name
                    out.changed[name] = out.changed.get(name, 0) + seg.count
                    out.ops.setdefault(name, set()).add(
                        f"{seg.op.name}/{seg.positions.name}/{seg.values.name}".lower())
                for ti, change in changes:
                    name = plan.specs[ti].name
                    digests[name] = digest_add(digests[name], change)
        out.digests = digests

    # -- 3. commit -----------------------------------------------------------------------------
    def _commit(self, plan: _Plan, written: list[_Written], keys: list[str]) -> Manifest:
        manifest = self._manifest(plan, written, plan.base)
        outcome = ("ok", "")
        error: Exception | None = None
        if self.rank == self.committer:
            try:
                self.store.put(catalog.rep_key(plan.version, manifest.base, primary=True),
                               encode_manifest(manifest), create_only=True)
            except ObjectExists:
                outcome = ("ObjectExists", f"version {plan.version} was committed by another "
                           f"publisher in {self.store.url}; this publish was discarded (publish "
                           "again: the group starts afresh with a full version)")
            except Exception as exc:  # every rank must still hear the outcome
                error, outcome = exc, (type(exc).__name__, f"committing version {plan.version} "
                                       f"failed on the committer: {exc}")
        box: list[Any] = [outcome]
        try:
            dist.broadcast_object_list(box, src=self.committer, group=self.group)
        except RuntimeError as exc:
            # outcome unknown: this rank's chunks stay, the committer may still be writing a
            # manifest that refers to them
            if not self._committed_by_us(plan):
                raise PeerUnavailable(f"rank {self.rank}: the group failed while committing "
                                      f"version {plan.version} ({exc}); it is not committed") from exc
            box = [("ok", "")]  # the committer wrote the manifest before it went away
        kind, message = box[0]
        if kind != "ok":
            self._delete(keys)
        if kind == "ObjectExists":
            self._baseline = None  # the store moved on: our base is no longer its head
        if error is not None:
            raise error
        if kind != "ok":
            cls = getattr(errors, kind, None)
            raise (cls if isinstance(cls, type) and issubclass(cls, WeighthubError)
                   else PeerUnavailable)(message)
        return manifest

    def _manifest(self, plan: _Plan, written: list[_Written], base: tuple[int, str] | None
                  ) -> Manifest:
        digests = {s.name: ZERO_DIGEST for s in plan.specs}
        for w in written:
            for name, d in w.digests.items():
                digests[name] = digest_add(digests[name], d)
        changed = {s.name: sum(w.changed.get(s.name, 0) for w in written) for s in plan.specs}
        root = root_digest((s, digests[s.name]) for s in plan.specs).hex()
        tensors = [TensorEntry(s.name, s.dtype.name, list(s.shape), digests[s.name].hex(),
                               changed[s.name], sorted(set().union(*(w.ops.get(s.name, set())
                                                                     for w in written))))
                   for s in plan.specs]
        refs = [r for w in written for r in w.refs]
        return Manifest(
            format=MANIFEST_FORMAT, kind=KIND, model=model_id(plan.specs), version=plan.version,
            base=None if base is None else base[0], base_root=None if base is None else base[1],
            root=root, tensors=tensors, chunks=refs,
            dense_bytes=sum(s.nbytes for s in plan.specs), payload_bytes=sum(r.size for r in refs),
            changed=sum(changed.values()), publisher=f"{self.id}/{plan.token}",
            created=time.time())

    def _committed_by_us(self, plan: _Plan) -> bool:
        """After a failed outcome broadcast: did the committer's manifest make it to the store?"""
        try:
            m = catalog.primary_manifest(self.store, plan.version)
        except WeighthubError:
            return False
        return m.publisher.endswith(f"/{plan.token}")

    # -- 4. advance ----------------------------------------------------------------------------
    def _advance(self, plan: _Plan, root: str, shards: dict[str, _Shard],
                 digests: dict[str, bytes]) -> None:
        mine = {n: s.new for n, s in shards.items() if s.box.primary and s.box.numel > 0}
        if self._baseline is None:
            self._baseline = _Baseline(plan.version, root, plan.specs,
                                       {n: b.copy() for n, b in mine.items()}, dict(digests))
            return
        for n, b in mine.items():
            np.copyto(self._baseline.bits[n], b)
        self._baseline.version, self._baseline.root = plan.version, root
        self._baseline.digests = dict(digests)

    def _write_anchor(self, plan: _Plan, committed: Manifest, shards: dict[str, _Shard]) -> None:
        """Every `anchor_every` versions, also a full representation (an optional route)."""
        if not (plan.version > 0 and self.anchor_every and plan.version % self.anchor_every == 0
                and plan.base is not None):
            return
        keys: list[str] = []
        try:
            written, keys = self._write_rep(plan, shards, full=True)
            m = self._manifest(plan, written, None)
            if m.root != committed.root:  # the same bits, so the same digests: a bug otherwise
                raise WeighthubError(f"anchor of version {plan.version} digests to {m.root[:12]}…, "
                                     f"the version is {committed.root[:12]}…")
        except WeighthubError as exc:  # every rank saw this failure
            self._delete(keys)
            log.warning("version %d: could not write the full representation: %s", plan.version, exc)
            return
        if self.rank == self.committer:
            try:
                self.store.put(catalog.rep_key(plan.version, None, primary=False),
                               encode_manifest(m), create_only=True)
            except WeighthubError as exc:  # the ranks' anchor chunks go with the version's retention
                log.warning("version %d: could not write the full representation: %s",
                            plan.version, exc)

    # -- collectives ---------------------------------------------------------------------------
    def _all_gather(self, obj: Any, doing: str) -> list[Any]:
        out: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as exc:
            raise PeerUnavailable(f"rank {self.rank}: the trainer group failed while {doing} "
                                  f"({exc}); nothing was committed, the baseline is unchanged: "
                                  "restart the group and publish again") from exc
        return out

    def _raise_failures(self, failures: Sequence[_Failure | None]) -> None:
        failed = [f for f in failures if f is not None]
        if not failed:
            return
        own = next((f for f in failed if f.rank == self.rank), None)
        f = own or failed[0]
        cls = getattr(errors, f.kind, None)
        if not (isinstance(cls, type) and issubclass(cls, WeighthubError)):
            cls = PeerUnavailable
        where = "" if own else f"rank {f.rank} failed: "
        raise cls(f"{where}{f.message}; nothing was committed")

    def _delete(self, keys: list[str]) -> None:
        for key in keys:  # best effort: chunks without a manifest are garbage, never a version
            with contextlib.suppress(WeighthubError):
                self.store.delete(key)


def _bounded_map(pool: ThreadPoolExecutor, fn: Callable[[int, list[Piece]], _T],
                 items: list[tuple[int, list[Piece]]], depth: int) -> Iterator[_T]:
    """pool.map with at most `depth` results in flight (each holds an encoded chunk)."""
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


def _encode_piece(piece: Piece, shard: _Shard, old: np.ndarray | None, policy: EncodePolicy
                  ) -> tuple[list[Segment], bytes]:
    """Segments of one piece, one per canonical run that changed, and its digest change.

    Each run is contiguous in canonical order, so a run's segment (and its digest change) is
    exactly what a single-process publisher would encode for that flat range. Without a base,
    every run is a dense segment and the change is the runs' whole contribution.
    """
    segments: list[Segment] = []
    change = ZERO_DIGEST
    for run in piece.runs():
        seg, d = encode_segment_tracked(None if old is None else old[run.lo:run.hi],
                                        shard.new[run.lo:run.hi], shard.spec.dtype,
                                        tensor=piece.tensor, start=run.start, policy=policy)
        if seg is not None:
            segments.append(seg)
        change = digest_add(change, d)
    return segments, change


def _encode_box_piece(piece: Piece, shard: _Shard, old: np.ndarray | None, policy: EncodePolicy
                      ) -> tuple[list[Segment], bytes]:
    """Segments of a piece that is a box of a strided shard, and its digest change.

    A delta is one sparse segment over the box's flat bounding range, its positions the changed
    elements' canonical ones (they skip the other ranks' elements in between), or one dense
    segment per run when that is smaller. Without a base: dense runs, and the digest of the
    box's words placed by its affine map (one pass, no copy).
    """
    box = piece.sub_box()
    new = shard.new[piece.lo:piece.hi]

    def dense() -> list[Segment]:
        return [cast(Segment, encode_segment(None, new[r.lo - piece.lo:r.hi - piece.lo],
                                             shard.spec.dtype, tensor=piece.tensor, start=r.start))
                for r in piece.runs()]

    start, stop = box.span
    if old is None:
        return dense(), digest_affine(new.reshape(box.shape), start, box.strides, threads=1)
    before = old[piece.lo:piece.hi]
    local = changed_positions(before, new)
    if local.size == 0:
        return [], ZERO_DIGEST
    pos = box.canonical(local) - start  # increasing: row-major order is kept by the box map
    was, now = before[local], new[local]
    change = digest_change(pos, was, now, first=start)
    seg = encode_changes(pos, was, now, shard.spec.dtype, tensor=piece.tensor, start=start,
                         stop=stop, dense_numel=box.numel, policy=policy)
    return ([seg] if seg is not None else dense()), change


def _table_diff(a: list[tuple[str, str, tuple[int, ...]]],
                b: list[tuple[str, str, tuple[int, ...]]]) -> str:
    da, db = {n: (d, s) for n, d, s in a}, {n: (d, s) for n, d, s in b}
    diffs = [f"{n!r} {db.get(n)} vs {da.get(n)}" for n in sorted(set(da) | set(db)) if da.get(n) != db.get(n)]
    return ", ".join(diffs[:5])
