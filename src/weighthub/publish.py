"""Publisher: diff a new state against the committed baseline and commit it as a version.

Chunks are encoded on a small thread pool (the codec kernels and zstd release the GIL) and
each is written to the store as soon as it is ready, with at most `2 × workers` chunks in
memory. The manifest goes last, create-only: that is the commit. The baseline advances only
after the commit succeeds, so a failed publish leaves no version and the next publish diffs
against the last committed state.
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
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from . import catalog
from .chunking import Range, tile
from .codec import EncodePolicy, Segment, encode_segment
from .errors import ObjectExists, UsageError, WeighthubError
from .format import ChunkRef, Manifest, TensorEntry, encode_chunk, encode_manifest
from .format.manifest import KIND, MANIFEST_FORMAT
from .store import Store
from .tensors import TensorSpec, bits, check_same_model, digest_bits, root_digest, specs_of

log = logging.getLogger(__name__)

DELTA_SPAN_BYTES = 32 << 20  # dense bytes per delta chunk (≈0.1-1 MiB on the wire at RL rates)
FULL_SPAN_BYTES = 16 << 20  # dense bytes per full chunk (≈12 MiB on the wire)


@dataclass(frozen=True, slots=True)
class PublishResult:
    version: int
    base: int | None
    dense_bytes: int
    payload_bytes: int
    changed: int
    numel: int
    seconds: float
    chunks: int

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.numel if self.numel else 0.0


@dataclass(slots=True)
class _Baseline:
    version: int
    root: str
    specs: list[TensorSpec]
    bits: dict[str, np.ndarray]  # private copies of the committed canonical bits


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
                                   {n: bits(t) for n, t in target.state.items()})

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

        digests = self._digests(specs, new_bits)
        root = root_digest((s, digests[s.name]) for s in specs).hex()
        manifest = self._write_rep(version, base, specs, new_bits, digests, root)
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

        self._advance(version, root, specs, new_bits)
        self._write_extra(version, specs, new_bits, digests, root)
        self._collect_garbage(version)
        numel = sum(s.numel for s in specs)
        return PublishResult(version, manifest.base, manifest.dense_bytes, manifest.payload_bytes,
                             manifest.changed, numel, seconds, len(manifest.chunks))

    def _digests(self, specs: list[TensorSpec], new_bits: dict[str, np.ndarray]) -> dict[str, bytes]:
        with ThreadPoolExecutor(self.workers) as pool:
            return dict(zip([s.name for s in specs],
                            pool.map(lambda s: digest_bits(new_bits[s.name]), specs), strict=True))

    def _write_rep(self, version: int, base: _Baseline | None, specs: list[TensorSpec],
                   new_bits: dict[str, np.ndarray], digests: dict[str, bytes], root: str) -> Manifest:
        """Encode and store every chunk of one representation; return its manifest (unwritten)."""
        span = self.full_span_bytes if base is None else self.delta_span_bytes
        plan = tile(specs, span)
        token = uuid.uuid4().hex[:12]
        base_version = None if base is None else base.version
        prefix = f"{catalog.version_dir(version)}/{catalog.rep_name(base_version)}-{token}"
        changed = [0] * len(specs)
        ops: list[set[str]] = [set() for _ in specs]

        def encode(i: int, ranges: list[Range]) -> tuple[ChunkRef, list[Segment]]:
            segments: list[Segment] = []
            for ti, start, stop in ranges:
                spec = specs[ti]
                new = new_bits[spec.name][start:stop]
                old = base.bits[spec.name][start:stop] if base is not None else None
                seg = encode_segment(old, new, spec.dtype, tensor=ti, start=start,
                                     policy=self.policy)
                if seg is not None:
                    segments.append(seg)
            frame = encode_chunk(segments)
            key = f"{prefix}/c{i:06d}.whc"
            self.store.put(key, frame)  # streamed out while later chunks are still encoding
            ref = ChunkRef(key, len(frame), xxhash.xxh3_128_hexdigest(frame), list(ranges))
            return ref, segments

        refs: list[ChunkRef] = []
        pending: deque[Future[tuple[ChunkRef, list[Segment]]]] = deque()
        with ThreadPoolExecutor(self.workers) as pool:
            try:
                for i, ranges in enumerate(plan):
                    pending.append(pool.submit(encode, i, ranges))
                    while len(pending) >= 2 * self.workers:
                        refs.append(self._collect(pending.popleft(), changed, ops, specs))
                while pending:
                    refs.append(self._collect(pending.popleft(), changed, ops, specs))
            except BaseException:
                for f in pending:
                    f.cancel()
                raise
        tensors = [
            TensorEntry(s.name, s.dtype.name, list(s.shape), digests[s.name].hex(),
                        changed[i], sorted(ops[i]))
            for i, s in enumerate(specs)
        ]
        return Manifest(
            format=MANIFEST_FORMAT, kind=KIND, model=model_id(specs), version=version,
            base=None if base is None else base.version,
            base_root=None if base is None else base.root, root=root, tensors=tensors,
            chunks=refs, dense_bytes=sum(s.nbytes for s in specs),
            payload_bytes=sum(r.size for r in refs), changed=sum(changed),
            publisher=self.id, created=time.time(),
        )

    @staticmethod
    def _collect(fut: Future[tuple[ChunkRef, list[Segment]]], changed: list[int], ops: list[set[str]],
                 specs: list[TensorSpec]) -> ChunkRef:
        ref, segments = fut.result()
        for seg in segments:
            changed[seg.tensor] += seg.count
            ops[seg.tensor].add(f"{seg.op.name}/{seg.positions.name}/{seg.values.name}".lower())
        return ref

    def _advance(self, version: int, root: str, specs: list[TensorSpec],
                 new_bits: dict[str, np.ndarray]) -> None:
        if self._baseline is None:
            self._baseline = _Baseline(version, root, specs, {n: b.copy() for n, b in new_bits.items()})
        else:
            for n, b in new_bits.items():
                np.copyto(self._baseline.bits[n], b)
            self._baseline.version, self._baseline.root = version, root

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
                m = self._write_rep(version, base, specs, new_bits, digests, root)
                self.store.put(catalog.rep_key(version, m.base, primary=False),
                               encode_manifest(m), create_only=True)
            except WeighthubError as exc:
                # an optional route: the version is committed either way, receivers plan around it
                log.warning("version %d: could not write the %s representation: %s", version,
                            catalog.rep_name(None if base is None else base.version), exc)
        if self.skip_every and version % self.skip_every == 0:
            if skip is None:
                self._skip_base = _Baseline(version, root, specs,
                                            {n: b.copy() for n, b in new_bits.items()})
            else:
                for n, b in new_bits.items():
                    np.copyto(skip.bits[n], b)
                skip.version, skip.root = version, root

    def _collect_garbage(self, version: int) -> None:
        """Delete versions older than the retention window, keeping the newest anchor."""
        if not self.retain:
            return
        versions = catalog.list_versions(self.store)
        keep_from = version - self.retain + 1
        # a newcomer starts from the newest anchor and chains forward: keep it and what follows
        anchors = [v for v in versions if any(
            r.base is None for r in catalog.representations(self.store, v))]
        floor = min(keep_from, anchors[-1]) if anchors else keep_from
        for v in versions:
            if v < floor:
                _delete_prefix(self.store, catalog.version_dir(v))


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
