"""ShardedPublisher: trainer ranks publish their own shards; one manifest commits the version.

No rank gathers a tensor. Each diffs its own shards against its own baseline, maps the changes to
canonical coordinates through the shard's affine box (weighthub.layout), writes its own chunks
and computes its shards' contributions to the linear per-tensor digests. Every publish runs the
same collective steps on every rank of the group, so a failure anywhere is seen everywhere:

    1. agree    all_gather: tensor table, shard boxes, baseline (version, root), asked version.
                Every rank checks the same gathered facts (same model, boxes tile every tensor,
                one base, one version); any error → every rank raises, nothing is written.
    2. stream   each rank encodes and puts its chunks and sums its digest contributions
                (`publish.stream`). A tensor every rank holds contiguously (dim-0 shards) is
                covered by flat ranges; one some rank holds strided (Shard(dim > 0)) by boxes,
                one sparse segment per box piece over canonical positions (spec §3).
    3. commit   all_gather: chunk refs, change counts, digests, or the rank's error. The
                committer adds the digests up, puts the manifest create-only (the commit) and
                broadcasts the outcome. A rank that failed or died → nothing is committed.
    4. advance  every rank copies its new shard bits into its baseline, only after a commit.
    5. extras   anchors (`anchor_every`) and skip deltas (`skip_every`): optional routes to the
                committed version, written the same way; a failure there is logged, not raised.
                Then the committer applies retention (`retain`).

The single-process `Publisher` is this pipeline on a group of one (`SoloGroup`): its collectives
return at once, a plain tensor is the whole tensor, and a restarted one adopts the store's head.
Every collective wait is bounded by the process group's timeout (`init_process_group(timeout=)`);
a peer that dies makes the others' collective fail (PeerUnavailable), never hang past it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from .. import catalog
from ..codec import EncodePolicy
from ..errors import ObjectExists, PeerUnavailable, WeighthubError
from ..format import Manifest
from ..layout import ShardBox
from ..nogc import collections_deferred
from ..store import Store
from . import commit as commits
from .agree import Plan, Proposal, agree
from .baseline import Baseline, adopt, advanced
from .group import Failure, Group, SoloGroup, TorchGroup, raise_failures
from .options import (
    DELTA_SPAN_BYTES,
    FULL_SPAN_BYTES,
    PublishOptions,
    check_committer,
    delta_span,
)
from .result import PublishResult
from .shards import KeptShards, Shard, resolve
from .stream import Stream, Written, write_chunks

log = logging.getLogger(__name__)


class ShardedPublisher:
    """Publishes the shards this rank holds; all ranks of `group` together commit each version.

    Construct one on every rank of the group and call `publish` on every rank for every step.

    Args:
        store: where versions go (every rank must reach the same store).
        group: the torch.distributed process group of the trainer ranks (default: the world).
        committer: the group rank that writes manifests (and applies retention).
        anchor_every, skip_every, retain, policy, workers, delta_span_bytes, full_span_bytes,
            backend, host_baseline, delta_chunk_bytes: see `PublishOptions`.

    Raises:
        UsageError: torch.distributed is not initialized, a committer outside the group, or an
            option `PublishOptions` refuses.
    """

    def __init__(self, store: Any, *, group: Any = None, committer: int = 0,
                 anchor_every: int = 16, skip_every: int = 0, retain: int = 0,
                 policy: EncodePolicy | None = None, workers: int = 2,
                 delta_span_bytes: int = DELTA_SPAN_BYTES,
                 full_span_bytes: int = FULL_SPAN_BYTES, backend: str = "auto",
                 host_baseline: bool = False,
                 delta_chunk_bytes: int | None = None) -> None:
        options = PublishOptions(anchor_every, skip_every, retain, policy or EncodePolicy(),
                                 workers, delta_span_bytes, full_span_bytes, backend,
                                 host_baseline, delta_chunk_bytes)
        self._setup(store, TorchGroup(group), committer, options)
        self.group = group

    @classmethod
    def on_group(cls, store: Store, group: Group, *, committer: int = 0,
                 options: PublishOptions | None = None) -> ShardedPublisher:
        """A publisher whose ranks meet through any `publish.group.Group` (ranks that are
        threads, actors, ...); the constructor is the torch.distributed case.

        Raises:
            UsageError: a committer outside the group.
        """
        pub = cls.__new__(cls)
        pub._setup(store, group, committer, options or PublishOptions())
        return pub

    def _setup(self, store: Store, group: Group, committer: int, options: PublishOptions) -> None:
        check_committer(committer, group.world)
        self.store = store
        self.options = options
        self.committer = committer
        self.rank, self.world = group.rank, group.world
        self.id = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._group = group
        self._solo = isinstance(group, SoloGroup)
        self._baseline: Baseline | None = None
        self._skip_base: Baseline | None = None
        self._adopted = not self._solo  # a group starts afresh; a single process adopts the head
        self._tiled: dict[str, list[ShardBox]] | None = None  # the layout already checked
        self._kept: KeptShards = {}  # what resolve found last time
        self._payload_ratio = 0.0  # payload per dense byte of this rank's last delta (spans)
        self._lock = threading.Lock()

    # the options, read through (`policy` may be swapped between publishes)
    anchor_every = property(lambda self: self.options.anchor_every)
    skip_every = property(lambda self: self.options.skip_every)
    retain = property(lambda self: self.options.retain)
    workers = property(lambda self: self.options.workers)
    delta_span_bytes = property(lambda self: self.options.delta_span_bytes)
    full_span_bytes = property(lambda self: self.options.full_span_bytes)

    @property
    def policy(self) -> EncodePolicy:
        return self.options.policy

    @policy.setter
    def policy(self, policy: EncodePolicy) -> None:
        self.options = replace(self.options, policy=policy)  # checked again

    @property
    def version(self) -> int | None:
        """The last version this rank's baseline holds (committed by the group)."""
        self._adopt()
        return self._baseline.version if self._baseline else None

    def publish(self, state: Mapping[str, torch.Tensor], *,
                shard_map: Mapping[str, ShardBox] | None = None,
                version: int | None = None, donate: bool = False) -> PublishResult:
        """Commit the group's state as the next version. Call on every rank of the group.

        Args:
            state: canonical name → this rank's tensor: a DTensor (its box comes from its
                placements) or a plain local shard whose box `shard_map` gives.
            shard_map: boxes of plain local tensors (trainers that do not use DTensor).
            version: the version number to commit (default: the next one); all ranks must agree.
            donate: keep `state`'s tensors as the baseline the next delta is taken against,
                instead of a copy (no second copy of the model, none made after the commit).
                Do not modify them afterwards: make the next state as new tensors, as a cast
                of master weights does. A modification is not published silently: the next
                delta is taken against the modified words, so every receiver's digest check
                refuses it (rolled back) until the publisher is made anew.

        The first publish of a group is a full version (numbered after the store's latest);
        later ones are deltas against the last version the group committed. A single-process
        `Publisher` first adopts the store's latest version, so it goes on with a delta.

        Raises:
            PlacementError: shard boxes that do not tile a tensor (gap or overlap), or a tensor
                of a placement weighthub cannot map.
            BaseMismatch / VersionError: ranks disagree on their baseline or on the version.
            ModelMismatch: ranks (or successive publishes) disagree on names, dtypes, shapes.
            PeerUnavailable: another rank failed or died; nothing was committed.
            ObjectExists: another publisher committed that version first.
        """
        with self._lock, collections_deferred():  # no collection walks the trainer's heap
            return self._publish(state, shard_map, version, donate)

    def _publish(self, state: Mapping[str, torch.Tensor],
                 shard_map: Mapping[str, ShardBox] | None, asked: int | None,
                 donate: bool) -> PublishResult:
        t0 = time.perf_counter()
        plan, shards = self._agree(state, shard_map, asked)
        dense = 0 if plan.base is None else _dense_bytes(shards)
        written, keys = self._stream(plan, shards,
                                     None if plan.base is None else self._baseline, dense=dense)
        if dense:
            self._payload_ratio = sum(r.size for r in written[self.rank].refs) / dense
        manifest = commits.assemble(plan, written, plan.base, self._tag(plan))
        self._commit(plan, manifest, keys)
        seconds = time.perf_counter() - t0
        mine = {n: s.new for n, s in shards.items() if s.published}
        self._baseline = advanced(self._baseline, plan.version, manifest.root, plan.specs, mine,
                                  written[self.rank].digests, on_host=self.options.host_baseline,
                                  donated=donate)
        self._write_extras(plan, manifest, shards)
        if self.options.is_skip_point(plan.version):
            self._skip_base = advanced(self._skip_base, plan.version, manifest.root, plan.specs,
                                       mine, written[self.rank].digests,
                                       on_host=self.options.host_baseline, donated=donate)
        if self.rank == self.committer:
            commits.collect_garbage(self.store, plan.version, self.options.retain)
        own = written[self.rank]
        return PublishResult(plan.version, manifest.base, manifest.dense_bytes,
                             manifest.payload_bytes, manifest.changed,
                             sum(s.numel for s in plan.specs), seconds, len(manifest.chunks),
                             own.stream_seconds, own.encode_seconds, own.upload_seconds,
                             own.encode_cpu_seconds, manifest.root)

    def _adopt(self) -> None:
        """A single process adopts the store's latest version as its baseline (once)."""
        if not self._adopted:
            self._baseline = adopt(self.store)
            self._adopted = True  # after it worked: a failed adoption is tried again

    def _tag(self, plan: Plan) -> str:
        """The manifest's publisher field (a group adds its publish's token)."""
        return self.id if self._solo else f"{self.id}/{plan.token}"

    # -- 1. agree ------------------------------------------------------------------------------
    def _agree(self, state: Mapping[str, torch.Tensor], shard_map: Mapping[str, ShardBox] | None,
               asked: int | None) -> tuple[Plan, dict[str, Shard]]:
        shards: dict[str, Shard] = {}
        table: list[tuple[str, str, tuple[int, ...]]] = []
        own: WeighthubError | None = None
        latest, token = None, ""
        try:  # a local failure is reported in the first collective, so every rank raises
            self._adopt()
            shards, table = resolve(state, shard_map, whole=self._solo,
                                    backend=self.options.backend, kept=self._kept)
            if self.rank == self.committer:
                token = uuid.uuid4().hex[:12]
                if self._baseline is None:  # the first version is numbered after the store's
                    latest = catalog.latest_version(self.store)
        except WeighthubError as exc:
            own = exc
        base = None if self._baseline is None else self._baseline.ref
        proposal = Proposal(self.rank, None if own is None else Failure.of(self.rank, own), table,
                            {n: s.box for n, s in shards.items()}, base, asked, latest, token)
        plan, self._tiled = agree(self._group, proposal, committer=self.committer, own=own,
                                  specs_before=None if self._baseline is None else self._baseline.specs,
                                  tiled=self._tiled)
        index = {s.name: i for i, s in enumerate(plan.specs)}
        for name, shard in shards.items():
            shard.index = index[name]
        return plan, shards

    # -- 2. stream -----------------------------------------------------------------------------
    def _stream(self, plan: Plan, shards: dict[str, Shard], base: Baseline | None, *,
                track: bool = True, dense: int = 0) -> tuple[list[Written], list[str]]:
        """Encode and put this rank's chunks of one representation (a delta from `base`, or
        full); gather what every rank wrote. On any failure this rank deletes its own chunks
        (a dead rank's stay: garbage, never part of a version) and every rank raises.
        `dense`: the bytes of this rank's words, where the caller has them (a delta's span)."""
        rep = catalog.rep_name(None if base is None else base.version)
        stream = Stream(self.store, f"{catalog.version_dir(plan.version)}/{rep}-{plan.token}",
                        "" if self._solo else f"r{self.rank:05d}-", self.options.policy,
                        self.options.workers,
                        self.options.full_span_bytes if base is None else
                        delta_span(self.options, dense or _dense_bytes(shards),
                                   self._payload_ratio),
                        plan.boxed, track)
        mine = Written(self.rank)
        keys: list[str] = []
        own: Exception | None = None
        try:
            write_chunks(stream, shards, base, mine, keys)
        except Exception as exc:  # every rank must still reach the gather below, then raise
            own, mine = exc, Written(self.rank, Failure.of(self.rank, exc))
        try:
            written: list[Written] = self._group.all_gather(mine, f"writing version {plan.version}")
            raise_failures([w.failure for w in written], self.rank, own)
        except BaseException:
            commits.delete_keys(self.store, keys)
            raise
        return written, keys

    # -- 3. commit -----------------------------------------------------------------------------
    def _commit(self, plan: Plan, manifest: Manifest, keys: list[str]) -> None:
        lost_race = ("retry to publish on top of theirs" if self._solo else
                     "publish again: the group starts afresh with a full version")
        try:
            commits.commit(self.store, self._group, self.committer, manifest, token=plan.token,
                           lost_race=lost_race)
        except ObjectExists:
            commits.delete_keys(self.store, keys)
            self._baseline = None  # the store moved on: our base is no longer its head
            self._adopted = not self._solo  # a single process adopts the new head next time
            raise
        except WeighthubError as exc:
            if not isinstance(exc, PeerUnavailable):  # outcome known: not committed
                commits.delete_keys(self.store, keys)
            raise

    # -- 5. extras -----------------------------------------------------------------------------
    def _write_extras(self, plan: Plan, committed: Manifest, shards: dict[str, Shard]) -> None:
        """Anchors and skip deltas: optional routes to the committed version."""
        bases: list[Baseline | None] = []
        if self.options.is_anchor(plan.version) and plan.base is not None:
            bases.append(None)
        skip = self._skip_base
        if (self.options.is_skip_point(plan.version) and skip is not None
                and skip.version == plan.version - self.options.skip_every
                and skip.version != plan.version - 1):
            bases.append(skip)
        for base in bases:
            what = catalog.rep_name(None if base is None else base.version)
            try:
                written, _keys = self._stream(plan, shards, base, track=False)
            except WeighthubError as exc:  # every rank saw this failure
                log.warning("version %d: could not write the %s representation: %s",
                            plan.version, what, exc)
                continue
            if self.rank != self.committer:
                continue
            m = commits.assemble(plan, written, None if base is None else base.ref,
                                 self._tag(plan), known=committed)
            try:
                commits.put_extra(self.store, m)
            except WeighthubError as exc:  # its chunks go with the version's retention
                log.warning("version %d: could not write the %s representation: %s",
                            plan.version, what, exc)


def _dense_bytes(shards: dict[str, Shard]) -> int:
    """Bytes of the words this rank publishes (~0.06 µs a tensor: `new` holds exactly the
    box's words, and its byte count is an attribute, not a product of the box's shape)."""
    return sum(s.new.nbytes for s in shards.values() if s.box.primary)
