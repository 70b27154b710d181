"""Publisher: diff a new state against the committed baseline and commit it as a version.

Chunks are encoded on a small thread pool (the codec kernels and zstd release the GIL) and
each is written to the store as soon as it is ready, with at most `2 × workers` chunks in
memory. The manifest goes last, create-only: that is the commit. The baseline advances only
after the commit succeeds, so a failed publish leaves no version and the next publish diffs
against the last committed state.

Tensor digests are linear (format/spec.md §4): the publisher keeps its baseline's digests and
adds the change of every element the encoder found changed, so a delta costs O(changed) in
digests too; only a full version (or an anchor with no known digests) digests every range.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from . import catalog
from .chunking import Range, tile
from .codec import EncodePolicy, Segment, encode_segment, encode_segment_tracked
from .codec.coding import ENCODE_PROFILES as ENCODE_PROFILES  # re-exported: its home until now
from .errors import ObjectExists, UsageError, WeighthubError
from .format import ChunkRef, Manifest, TensorEntry, chunk_checksum, encode_chunk, encode_manifest
from .format.manifest import KIND, MANIFEST_FORMAT
from .store import Store
from .tensors import (
    ZERO_DIGEST,
    TensorSpec,
    bits,
    check_same_model,
    digest_add,
    root_digest,
    specs_of,
)

log = logging.getLogger(__name__)

DELTA_SPAN_BYTES = 32 << 20  # dense bytes per delta chunk (≈0.1-1 MiB on the wire at RL rates)
FULL_SPAN_BYTES = 16 << 20  # dense bytes per full chunk (≈12 MiB on the wire)


@dataclass(frozen=True, slots=True)
class PublishResult:
    """What one publish did and where its time went (the primary representation only).

    seconds: wall time of `publish` up to and including the commit.
    stream_seconds: wall time of the chunk phase, from the first chunk submitted to the last
        one stored.
    encode_seconds: busy time of change detection, encoding, compression and digest updates,
        summed over the encoder threads.
    upload_seconds: busy time of the chunk writes to the store, summed over the threads.
    overlap: (encode_seconds + upload_seconds) / stream_seconds: how many stages were busy at
        once on average. 1.0 is a serial pipeline; it approaches `workers` when every thread
        was always busy, each thread encoding one chunk while another's upload runs. Uploads
        hidden behind encoding show as overlap above 1.
    """

    version: int
    base: int | None
    dense_bytes: int
    payload_bytes: int
    changed: int
    numel: int
    seconds: float
    chunks: int
    stream_seconds: float = 0.0
    encode_seconds: float = 0.0
    upload_seconds: float = 0.0

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.numel if self.numel else 0.0

    @property
    def overlap(self) -> float:
        busy = self.encode_seconds + self.upload_seconds
        return busy / self.stream_seconds if self.stream_seconds > 0 else 0.0


@dataclass(slots=True)
class _Baseline:
    version: int
    root: str
    specs: list[TensorSpec]
    bits: dict[str, np.ndarray]  # private copies of the committed canonical bits
    digests: dict[str, bytes]  # their tensor digests (the manifest's), updated incrementally


@dataclass(slots=True)
class _Timing:
    """Busy seconds summed over threads (added to under a lock) and the phase's wall time."""

    encode: float = 0.0
    upload: float = 0.0
    wall: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, encode: float, upload: float) -> None:
        with self.lock:
            self.encode += encode
            self.upload += upload


@dataclass(frozen=True, slots=True)
class _Encoded:
    """One chunk, stored: its manifest entry, its segments and each range's digest change."""

    ref: ChunkRef
    segments: list[Segment]
    changes: list[tuple[int, bytes]]  # (tensor index, digest change); empty for known digests


def model_id(specs: list[TensorSpec]) -> str:
    """Identity of a model's tensor table (names, dtypes, shapes)."""
    h = xxhash.xxh3_128()
    for s in specs:
        h.update(f"{s.name}\0{s.dtype.name}\0{list(s.shape)}\n".encode())
    return h.hexdigest()


class Publisher:
    """Publishes successive states of one model to a store.

    Args:
        store: where versions go.
        anchor_every: also write a full representation every K versions, so newcomers need not
            replay the whole chain (0: only the first version is full).
        skip_every: also write a skip delta (v-K → v) every K versions, for receivers that fall
            behind (0: off). Keeps one more baseline copy in memory.
        retain: keep this many newest versions (older ones are deleted after each commit, but
            never the newest anchor); 0 keeps everything.
        policy: which ops and codings the encoder may choose.
        workers: encoder threads.
    """

    def __init__(self, store: Store, *, anchor_every: int = 16, skip_every: int = 0,
                 retain: int = 0, policy: EncodePolicy | None = None, workers: int = 2,
                 delta_span_bytes: int = DELTA_SPAN_BYTES,
                 full_span_bytes: int = FULL_SPAN_BYTES) -> None:
        if anchor_every < 0 or skip_every < 0 or retain < 0 or workers < 1:
            raise UsageError("anchor_every, skip_every and retain must be >= 0, workers >= 1")
        if retain and anchor_every and retain < anchor_every:
            raise UsageError(f"retain={retain} is shorter than anchor_every={anchor_every}: "
                             "receivers could be left with no path; raise retain")
        self.store = store
        self.anchor_every = anchor_every
        self.skip_every = skip_every
        self.retain = retain
        self.policy = policy or EncodePolicy()
        self.workers = workers
        self.delta_span_bytes = delta_span_bytes
        self.full_span_bytes = full_span_bytes
        self.id = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._baseline: _Baseline | None = None
        self._skip_base: _Baseline | None = None
        self._loaded = False
        self._lock = threading.Lock()

    @property
    def version(self) -> int | None:
        """The last committed version this publisher's baseline holds."""
        self._load_baseline()
        return self._baseline.version if self._baseline else None

    def _load_baseline(self) -> None:
        """Adopt the store's latest version as the baseline (a publisher restarting)."""
        if self._loaded:
            return
        self._loaded = True
        latest = catalog.latest_version(self.store)
        if latest is None:
            return
        from .receive import Receiver
        from .targets import StateDictTarget

        target = StateDictTarget({})
        Receiver(self.store, target).sync(latest)
        m = catalog.primary_manifest(self.store, latest)
        self._baseline = _Baseline(latest, m.root, m.specs(),
                                   {n: bits(t) for n, t in target.state.items()},
                                   {e.name: bytes.fromhex(e.digest) for e in m.tensors})

    def publish(self, state: Mapping[str, torch.Tensor]) -> PublishResult:
        """Commit `state` as the next version (full if the store is empty, else a delta).

        Raises ModelMismatch if names/dtypes/shapes differ from the store's model,
        ObjectExists if another publisher committed that version first (reload and retry).
        """
        with self._lock:
            return self._publish(state)

    def _publish(self, state: Mapping[str, torch.Tensor]) -> PublishResult:
        t0 = time.perf_counter()
        self._load_baseline()
        specs = specs_of(state)
        new_bits = {s.name: bits(_cpu(state[s.name])) for s in specs}
        base = self._baseline
        if base is not None:
            check_same_model(base.specs, specs, "the published state")
        version = 0 if base is None else base.version + 1

        manifest, digests, timing = self._write_rep(version, base, specs, new_bits)
        try:
            self.store.put(catalog.rep_key(version, manifest.base, primary=True),
                           encode_manifest(manifest), create_only=True)
        except ObjectExists:
            self._loaded = False  # the store moved on: adopt its state on the next publish
            self._baseline = None
            raise ObjectExists(f"version {version} was committed by another publisher in "
                               f"{self.store.url}; this publish was discarded (retry to publish "
                               "on top of theirs)") from None
        seconds = time.perf_counter() - t0

        root = manifest.root
        self._advance(version, root, specs, new_bits, digests)
        self._write_extra(version, specs, new_bits, digests, root)
        collect_garbage(self.store, version, self.retain)
        numel = sum(s.numel for s in specs)
        return PublishResult(version, manifest.base, manifest.dense_bytes, manifest.payload_bytes,
                             manifest.changed, numel, seconds, len(manifest.chunks),
                             timing.wall, timing.encode, timing.upload)

    def _write_rep(self, version: int, base: _Baseline | None, specs: list[TensorSpec],
                   new_bits: dict[str, np.ndarray],
                   known: tuple[dict[str, bytes], str] | None = None
                   ) -> tuple[Manifest, dict[str, bytes], _Timing]:
        """Encode and store every chunk of one representation; return its manifest (unwritten).

        The version's digests and root are `known` (an extra representation of a committed
        version), or built while encoding: the base's digests plus each segment's change
        (from nothing for a full representation).
        """
        span = self.full_span_bytes if base is None else self.delta_span_bytes
        plan = tile(specs, span)
        token = uuid.uuid4().hex[:12]
        base_version = None if base is None else base.version
        prefix = f"{catalog.version_dir(version)}/{catalog.rep_name(base_version)}-{token}"
        changed = [0] * len(specs)
        ops: list[set[str]] = [set() for _ in specs]
        digests = dict(known[0]) if known is not None else (
            {s.name: ZERO_DIGEST for s in specs} if base is None else dict(base.digests))
        timing = _Timing()

        def encode(i: int, ranges: list[Range]) -> _Encoded:
            t0 = time.perf_counter()
            segments: list[Segment] = []
            changes: list[tuple[int, bytes]] = []
            for ti, start, stop in ranges:
                spec = specs[ti]
                new = new_bits[spec.name][start:stop]
                old = base.bits[spec.name][start:stop] if base is not None else None
                if known is None:
                    seg, change = encode_segment_tracked(old, new, spec.dtype, tensor=ti,
                                                         start=start, policy=self.policy)
                    changes.append((ti, change))
                else:
                    seg = encode_segment(old, new, spec.dtype, tensor=ti, start=start,
                                         policy=self.policy)
                if seg is not None:
                    segments.append(seg)
            frame = encode_chunk(segments)
            key = f"{prefix}/c{i:06d}.whc"
            t1 = time.perf_counter()
            self.store.put(key, frame)  # streamed out while later chunks are still encoding
            t2 = time.perf_counter()
            timing.add(t1 - t0, t2 - t1)
            ref = ChunkRef(key, len(frame), chunk_checksum(frame), list(ranges))
            return _Encoded(ref, segments, changes)

        refs: list[ChunkRef] = []
        pending: deque[Future[_Encoded]] = deque()
        t_start = time.perf_counter()
        with ThreadPoolExecutor(self.workers) as pool:
            try:
                for i, ranges in enumerate(plan):
                    pending.append(pool.submit(encode, i, ranges))
                    while len(pending) >= 2 * self.workers:
                        refs.append(self._collect(pending.popleft(), changed, ops, digests, specs))
                while pending:
                    refs.append(self._collect(pending.popleft(), changed, ops, digests, specs))
            except BaseException:
                for f in pending:
                    f.cancel()
                raise
        timing.wall = time.perf_counter() - t_start
        root = known[1] if known is not None else root_digest(
            (s, digests[s.name]) for s in specs).hex()
        tensors = [
            TensorEntry(s.name, s.dtype.name, list(s.shape), digests[s.name].hex(),
                        changed[i], sorted(ops[i]))
            for i, s in enumerate(specs)
        ]
        manifest = Manifest(
            format=MANIFEST_FORMAT, kind=KIND, model=model_id(specs), version=version,
            base=None if base is None else base.version,
            base_root=None if base is None else base.root, root=root, tensors=tensors,
            chunks=refs, dense_bytes=sum(s.nbytes for s in specs),
            payload_bytes=sum(r.size for r in refs), changed=sum(changed),
            publisher=self.id, created=time.time(),
        )
        return manifest, digests, timing

    @staticmethod
    def _collect(fut: Future[_Encoded], changed: list[int], ops: list[set[str]],
                 digests: dict[str, bytes], specs: list[TensorSpec]) -> ChunkRef:
        done = fut.result()
        for seg in done.segments:
            changed[seg.tensor] += seg.count
            ops[seg.tensor].add(f"{seg.op.name}/{seg.positions.name}/{seg.values.name}".lower())
        for ti, change in done.changes:
            name = specs[ti].name
            digests[name] = digest_add(digests[name], change)
        return done.ref

    def _advance(self, version: int, root: str, specs: list[TensorSpec],
                 new_bits: dict[str, np.ndarray], digests: dict[str, bytes]) -> None:
        # One streaming copy of every tensor, on purpose: measured on 2 cores for 520 MiB at
        # 1.3-5% changed, np.copyto takes ~60 ms; scattering only the changed words (from the
        # scan's compacted changes, numpy or a numba kernel) takes 45-105 ms and 2 threads of
        # copyto 80-110 ms (at these rates a third to two thirds of all cache lines hold a
        # change, so a scatter touches most of memory anyway, without streaming), and applying
        # the encoded segments 80-400 ms (grouped positions rescan every element). The commit
        # is already visible, so receivers do not wait for this.
        if self._baseline is None:
            self._baseline = _Baseline(version, root, specs,
                                       {n: b.copy() for n, b in new_bits.items()}, dict(digests))
        else:
            for n, b in new_bits.items():
                np.copyto(self._baseline.bits[n], b)
            self._baseline.version, self._baseline.root = version, root
            self._baseline.digests = dict(digests)

    def _write_extra(self, version: int, specs: list[TensorSpec],
                     new_bits: dict[str, np.ndarray], digests: dict[str, bytes], root: str) -> None:
        """Anchors and skip deltas: optional routes, written after the commit."""
        extra: list[_Baseline | None] = []
        if version > 0 and self.anchor_every and version % self.anchor_every == 0:
            extra.append(None)
        skip = self._skip_base
        if (self.skip_every and version % self.skip_every == 0 and skip is not None
                and skip.version == version - self.skip_every and skip.version != version - 1):
            extra.append(skip)
        for base in extra:
            try:
                m, _, _ = self._write_rep(version, base, specs, new_bits, (digests, root))
                self.store.put(catalog.rep_key(version, m.base, primary=False),
                               encode_manifest(m), create_only=True)
            except WeighthubError as exc:
                # an optional route: the version is committed either way, receivers plan around it
                log.warning("version %d: could not write the %s representation: %s", version,
                            catalog.rep_name(None if base is None else base.version), exc)
        if self.skip_every and version % self.skip_every == 0:
            if skip is None:
                self._skip_base = _Baseline(version, root, specs,
                                            {n: b.copy() for n, b in new_bits.items()},
                                            dict(digests))
            else:
                for n, b in new_bits.items():
                    np.copyto(skip.bits[n], b)
                skip.version, skip.root, skip.digests = version, root, dict(digests)


def collect_garbage(store: Store, version: int, retain: int) -> None:
    """Delete versions older than the `retain` newest (0: keep all), keeping the newest anchor.

    Called by a publisher after it committed `version` (both Publisher and ShardedPublisher).
    """
    if not retain:
        return
    versions = catalog.list_versions(store)
    keep_from = version - retain + 1
    # a newcomer starts from the newest anchor and chains forward: keep it and what follows
    anchors = [v for v in versions if any(
        r.base is None for r in catalog.representations(store, v))]
    floor = min(keep_from, anchors[-1]) if anchors else keep_from
    for v in versions:
        if v < floor:
            _delete_prefix(store, catalog.version_dir(v))


def _delete_prefix(store: Store, prefix: str) -> None:
    # the manifest first: once it is gone the version no longer exists, whatever is left
    names = store.children(prefix)
    if catalog.PRIMARY in names:
        store.delete(f"{prefix}/{catalog.PRIMARY}")
    for name in names:
        key = f"{prefix}/{name}"
        sub = store.children(key)
        if sub:
            _delete_prefix(store, key)
        elif name != catalog.PRIMARY:
            store.delete(key)


def _cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous()
