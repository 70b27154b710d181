"""Receiver: bring a target to a version, all or nothing.

    plan     cheapest route of representations from what the target holds (catalog.plan)
    stage    fetch every chunk of the route in parallel, check size and xxh3-128 against the
             manifest, parse and validate the frames: nothing is touched yet
    apply    in place, recording the old words of everything changed (UndoLog)
    verify   digests of every touched tensor against the target version's manifest
    commit   the target records the new version; or, on any failure anywhere in apply/verify,
             roll back exactly to the previous committed version and raise
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import xxhash

from . import catalog
from .codec import Op, Positions, Segment, UndoLog, apply_segment, regap_segment
from .errors import (
    ApplyError,
    BaseMismatch,
    ChecksumError,
    FormatError,
    IntegrityError,
    ObjectNotFound,
    WeighthubError,
)
from .format import ChunkFrame, ChunkRef, Manifest, decode_chunk
from .store import Store
from .targets.base import Held, Target, unique_views
from .tensors import TensorSpec, check_same_model, digest_bits, root_digest


@dataclass(frozen=True, slots=True)
class SyncResult:
    version: int
    from_version: int | None
    route: tuple[str, ...]  # manifest keys applied, in order
    bytes_fetched: int
    stage_seconds: float
    apply_seconds: float  # the pause: apply + verify + commit
    seconds: float


@dataclass(slots=True)
class _Staged:
    manifest: Manifest
    frames: list[ChunkFrame]


class Receiver:
    """Keeps one target in sync with the versions in a store.

    Args:
        store: where versions are read from.
        target: where the weights live (state dict, module, safetensors file/dir).
        verify_base: digest the target before applying and refuse if its bits are not the
            version it claims to hold (catches edits behind weighthub's back; costs one pass).
        workers: parallel chunk fetches.
        apply_workers: threads applying chunks during the pause (one per core is right).
    """

    def __init__(self, store: Store, target: Target, *, verify_base: bool = False,
                 workers: int = 4, apply_workers: int = 2) -> None:
        self.store = store
        self.target = target
        self.verify_base = verify_base
        self.workers = workers
        self.apply_workers = apply_workers
        self.lock = threading.Lock()  # held while the target's bits are changing
        self._sync_lock = threading.Lock()  # one sync at a time: staging reads the held bits

    @property
    def version(self) -> int | None:
        held = self.target.held()
        return held.version if held else None

    def sync(self, version: int | None = None) -> SyncResult:
        """Bring the target to `version` (default: the latest committed). See module doc."""
        with self._sync_lock:
            return self._sync(version)

    def _sync(self, version: int | None) -> SyncResult:
        t0 = time.perf_counter()
        if version is None:
            version = catalog.latest_version(self.store)
            if version is None:
                raise ObjectNotFound(f"store {self.store.url} holds no committed version yet")
        held = self.target.held()
        if held is not None and held.version == version:
            return SyncResult(version, version, (), 0, 0.0, 0.0, time.perf_counter() - t0)
        route = catalog.plan(self.store, held.version if held else None, version)
        staged, fetched = self._stage(route, held)
        t1 = time.perf_counter()
        with self.lock:
            self._apply(held, staged)
        t2 = time.perf_counter()
        return SyncResult(version, held.version if held else None, tuple(r.key for r in route),
                          fetched, t1 - t0, t2 - t1, t2 - t0)

    # -- stage ----------------------------------------------------------------------------------
    def _stage(self, route: list[catalog.Rep], held: Held | None) -> tuple[list[_Staged], int]:
        manifests = [catalog.read_manifest(self.store, r.key) for r in route]
        jobs = [(mi, ci) for mi, m in enumerate(manifests) for ci in range(len(m.chunks))]
        # The first delta of the route applies to the bits held now: decode its exponent-grouped
        # positions against them already (slow scan, off the pause). Later deltas in a chain
        # depend on bits that do not exist yet; they decode during apply.
        first = manifests[0]
        base_bits = self.target.peek() if held is not None and first.base_root == held.root else {}
        first_specs = first.specs()

        def fetch(job: tuple[int, int]) -> ChunkFrame:
            m = manifests[job[0]]
            ref = m.chunks[job[1]]
            where = f"chunk {self.store.url}/{ref.key}"
            blob = self.store.get(ref.key)
            if len(blob) != ref.size:
                raise ChecksumError(f"{where}: {len(blob)} bytes, manifest says {ref.size}")
            digest = xxhash.xxh3_128_hexdigest(blob)
            if digest != ref.checksum:
                raise ChecksumError(f"{where}: stored xxh3={ref.checksum[:12]}… computed "
                                    f"{digest[:12]}…: the chunk is corrupt")
            frame = decode_chunk(blob, where=where)
            _check_segments(frame, ref.covers, m, where)
            if job[0] == 0 and base_bits:
                frame = ChunkFrame(tuple(self._regap(seg, first_specs, base_bits, where)
                                         for seg in frame.segments))
            return frame

        try:
            with ThreadPoolExecutor(self.workers) as pool:
                frames = list(pool.map(fetch, jobs))
        except ObjectNotFound as exc:
            raise ObjectNotFound(f"{exc}: the version's chunks are missing (deleted by retention "
                                 "or never written); retry to re-plan") from exc
        staged = []
        it = iter(frames)
        for m in manifests:
            staged.append(_Staged(m, [next(it) for _ in m.chunks]))
        return staged, sum(r.payload_bytes for r in route)

    @staticmethod
    def _regap(seg: Segment, specs: list[TensorSpec], base_bits: dict[str, np.ndarray],
               where: str) -> Segment:
        spec = specs[seg.tensor]
        base = base_bits.get(spec.name)
        if seg.positions != Positions.GROUPS or base is None or base.dtype != spec.dtype.uint \
                or base.size != spec.numel:
            return seg  # nothing to do, or a mismatch the apply step reports properly
        return regap_segment(seg, base[seg.start: seg.stop], spec.dtype, where)

    # -- apply ----------------------------------------------------------------------------------
    def _apply(self, held: Held | None, staged: list[_Staged]) -> None:
        final = staged[-1].manifest
        specs = final.specs()
        current = self.target.specs()
        if current is not None:
            check_same_model(specs, current, "the target")
        # a target holding nothing is materialized afresh and discarded on failure: no undo copy
        undo = UndoLog(fresh=current is None)
        try:
            views = self.target.open(specs)
            if held is not None and self.verify_base:
                self._verify_root(views, specs, held.root)
            touched: set[int] = set()
            state_root = held.root if held else None
            for st in staged:
                m = st.manifest
                if m.base is not None and m.base_root != state_root:
                    raise BaseMismatch(f"delta {m.version} has base {m.base} "
                                       f"({(m.base_root or '')[:12]}…) but the target holds "
                                       f"{(state_root or 'nothing')[:12]}…; refusing to apply")
                self._apply_manifest(m, st.frames, views, undo, touched)
                state_root = m.root
            self._verify_touched(views, final, touched)
            self.target.commit(Held(self.store.url, final.model, final.version, final.root))
        except BaseException as exc:
            undo.rollback()
            self.target.abort()
            if isinstance(exc, WeighthubError):
                raise
            if isinstance(exc, Exception):
                raise ApplyError(f"applying version {final.version} failed ({type(exc).__name__}: "
                                 f"{exc}); the target was rolled back to its previous version") from exc
            raise

    def _apply_manifest(self, m: Manifest, frames: list[ChunkFrame], views: dict[str, np.ndarray],
                        undo: UndoLog, touched: set[int]) -> None:
        specs = m.specs()
        alias = unique_views({s.name: views[s.name] for s in specs})
        touched.update(i for i, s in enumerate(specs) if alias[s.name] != s.name)  # verify aliases

        def apply_chunk(frame: ChunkFrame, ref: ChunkRef) -> None:
            for seg in frame.segments:
                spec = specs[seg.tensor]
                if alias[spec.name] != spec.name:
                    continue  # tied to an earlier name: its bits change through that one
                dst = views[spec.name][seg.start: seg.stop]
                apply_segment(seg, dst, spec.dtype, undo, f"{self.store.url}/{ref.key}")
                touched.add(seg.tensor)
            if m.base is None:
                touched.update(ti for ti, _s, _e in ref.covers)

        # Chunks cover disjoint ranges, so they apply in parallel (the kernels release the GIL);
        # every job finishes before an error propagates, so rollback never races an apply.
        with ThreadPoolExecutor(self.apply_workers) as pool:
            jobs = [pool.submit(apply_chunk, f, r) for f, r in zip(frames, m.chunks, strict=True)]
            wait(jobs)
        for job in jobs:
            job.result()

    def _verify_touched(self, views: dict[str, np.ndarray], m: Manifest,
                        touched: set[int]) -> None:
        """Digests of every tensor the route changed must equal the manifest's.

        Untouched tensors still hold bits that were verified when their version committed.
        """
        entries = [m.tensors[i] for i in sorted(touched)]
        digests = _digests(views, [e.name for e in entries])
        bad = [e.name for e in entries if digests[e.name] != e.digest]
        if bad:
            raise IntegrityError(f"after applying version {m.version}, {len(bad)} tensor(s) differ "
                                 f"from the manifest's digests: {bad[:5]}; rolled back")

    def _verify_root(self, views: dict[str, np.ndarray], specs: list[TensorSpec],
                     root: str) -> None:
        digests = _digests(views, [s.name for s in specs])
        got = root_digest((s, bytes.fromhex(digests[s.name])) for s in specs).hex()
        if got != root:
            raise BaseMismatch(f"the target's bits (root {got[:12]}…) are not the version it "
                               f"claims to hold (root {root[:12]}…): it was modified outside "
                               "weighthub; pull it afresh into an empty path")


def _digests(views: dict[str, np.ndarray], names: list[str]) -> dict[str, str]:
    with ThreadPoolExecutor(2) as pool:  # xxhash releases the GIL on large buffers
        return dict(zip(names, pool.map(lambda n: digest_bits(views[n]).hex(), names),
                        strict=True))


def _check_segments(frame: ChunkFrame, covers: list[tuple[int, int, int]], m: Manifest,
                    where: str) -> None:
    """Every segment must lie inside the chunk's declared coverage (no writes elsewhere)."""
    for i, seg in enumerate(frame.segments):
        if not any(seg.tensor == ti and start <= seg.start and seg.stop <= stop
                   for ti, start, stop in covers):
            raise FormatError(f"{where}: segment {i} writes tensor {seg.tensor} "
                              f"[{seg.start}, {seg.stop}) outside the chunk's coverage")
        if m.base is None and seg.op != Op.DENSE:
            raise FormatError(f"{where}: a full representation may only hold dense segments")
    if m.base is None:
        total = sum(seg.numel for seg in frame.segments)
        need = sum(stop - start for _t, start, stop in covers)
        if total != need:
            raise FormatError(f"{where}: full chunk carries {total} of {need} covered elements")

