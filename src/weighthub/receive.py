"""Receiver: bring a target to a version, all or nothing.

    plan     cheapest route of representations from what the target holds (catalog.plan)
    stage    fetch every chunk of the route in parallel, check size and SHA-256 against the
             manifest, parse and validate the frames; find the digests of the held version:
             nothing is touched yet
    apply    in place, recording the old words of everything changed (UndoLog)
    verify   digests of every touched tensor against each version the route passes through
    commit   the target records the new version; or, on any failure anywhere in apply/verify,
             roll back exactly to the previous committed version and raise

`sync` runs them all under one lock. `stage` and `apply` split them so a serving engine can fetch
and decode while it serves, and pause only for `apply`: a `Staged` version is tied to the
version the target held when it was staged, and `apply` refuses it (BaseMismatch, nothing
touched) if the target has moved since.

Apply, verify and commit are the pause. Tensor digests are linear (format/spec.md §4), so by
default verification costs O(changed): a tensor's new digest is the held version's digest plus,
for every element the apply rewrote, mix(new) − mix(old), with the old word from the undo log
and the new word read back from the target's memory. The held version's digests come from this
receiver's last commit, or the held version's manifest (bound to the held root), or, failing
both, a digest of the held bits while staging. This proves every rewritten word and trusts the
words it did not rewrite to be the held version's (as every mode trusts untouched tensors);
`verify="full"` re-digests every touched tensor instead (O(touched tensors), ~10x the time at
RL change rates), and `verify_base=True` proves the whole held version first.

Rolling back (a target at v asked for u < v) may take a backward route: deltas u+1 … v applied
inversely, newest first (catalog.plan chooses it when it is fewer bytes than an anchor). Each
inverse step is bound like a forward one, but the other way round: the target must hold the
delta's version with the delta's root, and afterwards the digests must be those of the delta's
base, as the base's own manifest records them (a delta's manifest records only its version's).
Its segments are checked to be invertible while staging, before anything is touched, and it
applies, folds digests and rolls back through the same kernels and undo log.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Literal

import numpy as np

from . import catalog
from .codec import Op, Positions, Segment, UndoLog, apply_segment, regap_segment
from .codec.digest import lanes_digest, staged_old_digest
from .errors import (
    ApplyError,
    BaseMismatch,
    FormatError,
    IntegrityError,
    ObjectNotFound,
    PlacementError,
    UsageError,
    VersionNotFound,
    WeighthubError,
)
from .format import ChunkFrame, ChunkRef, Manifest, decode_chunk
from .layout import ShardBox, segment_outside
from .sources import ChunkId, SourceList
from .store import Store
from .targets.base import Held, Target, unique_views
from .tensors import (
    ZERO_DIGEST,
    TensorSpec,
    check_same_model,
    digest_add,
    digest_affine,
    digest_bits,
    digest_sub,
    root_digest,
)


@dataclass(frozen=True, slots=True)
class SyncResult:
    """Where a sync's time went. The pause (the target's bits changing) is apply + verify + commit.

    Incremental verification takes each chunk's digest change on the thread that just applied
    it; that shared wall time is split between apply_seconds and verify_seconds in proportion to
    the threads' busy time in each.
    """

    version: int
    from_version: int | None
    # manifest keys applied, in order; a delta applied inversely (rolling back) is reported as
    # its key + catalog.INVERSE, "v…/manifest.json (inverse)"
    route: tuple[str, ...]
    bytes_fetched: int
    stage_seconds: float  # plan, fetch, checksums, decode, held digests: before the pause
    apply_seconds: float  # writing the chunks into the target (in the pause)
    verify_seconds: float  # checking digests, including verify_base's full pass (in the pause)
    pause_seconds: float  # apply + verify + commit
    seconds: float  # total

    @property
    def total(self) -> float:
        return self.seconds

    @property
    def backward(self) -> bool:
        """Did the route undo deltas (apply at least one inversely)?"""
        return _backward(self.route)


def _backward(route: tuple[str, ...]) -> bool:
    return any(step.endswith(catalog.INVERSE) for step in route)


@dataclass(slots=True)
class _Step:
    manifest: Manifest
    frames: list[ChunkFrame]
    # per chunk, per segment: Σ mix(i, held word) over what it will rewrite, computed while
    # staging (first manifest of the route only; None where not computed)
    olds: list[list[bytes | None]]
    inverse: bool  # apply `manifest` (a delta) inversely: from its version back to its base
    # the version the step arrives at, whose digests and root the result must have: `manifest`
    # itself, or for an inverse step a manifest of its base
    expect: Manifest


@dataclass(frozen=True, slots=True, eq=False)
class Staged:
    """A version fetched, checked and decoded by `Receiver.stage`; hand it to `Receiver.apply`.

    Tied to `held`, what the target held when it was staged (None: nothing), and to the store
    it was read from. Opaque beyond the fields below.
    """

    version: int
    held: Held | None
    store: str  # the url of the store it was read from
    route: tuple[str, ...]  # manifest keys to apply, in order (empty: already at `version`)
    bytes_fetched: int
    stage_seconds: float
    _steps: list[_Step]
    _held_digests: dict[str, bytes] | None
    _specs: list[TensorSpec]
    _current: list[TensorSpec] | None

    @property
    def from_version(self) -> int | None:
        return self.held.version if self.held else None

    @property
    def backward(self) -> bool:
        """Does the route undo deltas (apply at least one inversely)?"""
        return _backward(self.route)


class Receiver:
    """Keeps one target in sync with the versions in a store.

    Args:
        store: the authority: manifests, listings and (when `sources` is not given) chunks.
        target: where the weights live (state dict, module, safetensors file/dir).
        verify_base: digest the target before applying and refuse if its bits are not the
            version it claims to hold (catches edits behind weighthub's back; costs one pass).
        workers: parallel chunk fetches.
        apply_workers: threads applying chunks during the pause (one per core is right).
        verify: "incremental" (default): digests from the held version's digests plus what the
            apply changed, O(changed) in the pause; "full": re-digest every touched tensor.
        sources: where chunks come from, in order, each checked once against its manifest
            (`sources.SourceList`); default: the store alone.
    """

    def __init__(self, store: Store, target: Target, *, sources: SourceList | None = None,
                 verify_base: bool = False,
                 workers: int = 4, apply_workers: int = 2,
                 verify: Literal["incremental", "full"] = "incremental") -> None:
        if verify not in ("incremental", "full"):
            raise UsageError(f"verify={verify!r}: choose 'incremental' or 'full'")
        self.store = store
        self.sources = sources if sources is not None else SourceList.of(store)
        self.target = target
        self.verify_base = verify_base
        self.workers = workers
        self.apply_workers = apply_workers
        self.verify = verify
        self.lock = threading.Lock()  # held while the target's bits are changing
        self._sync_lock = threading.Lock()  # one sync at a time: staging reads the held bits
        self._committed: tuple[str, dict[str, bytes]] | None = None  # (root, digests) last commit

    @property
    def version(self) -> int | None:
        held = self.target.held()
        return held.version if held else None

    def sync(self, version: int | None = None) -> SyncResult:
        """Bring the target to `version` (default: the latest committed): stage, then apply,
        with no other sync in between. See module doc."""
        with self._sync_lock:
            return self._apply_staged(self._stage_version(version))

    def stage(self, version: int | None = None) -> Staged:
        """Plan, fetch, check and decode `version` (default: the latest committed) against
        what the target holds now, touching nothing: the target keeps serving meanwhile.

        Waits for a sync or apply in progress (staging reads the held bits).

        Returns:
            the staged version, for `apply`.
        Raises:
            ObjectNotFound, VersionNotFound, NoSyncPath, ChecksumError, FormatError,
            ModelMismatch, BaseMismatch: the target is left as it was.
        """
        with self._sync_lock:
            return self._stage_version(version)

    def apply(self, staged: Staged) -> SyncResult:
        """Bring the target to a staged version: apply, verify, commit (the pause); on any
        failure roll back to the version held before and raise.

        Raises:
            BaseMismatch: the target no longer holds the version `staged` was staged against
                (nothing touched: stage again). UsageError: staged from another store.
            ApplyError, IntegrityError, ...: as `sync`, rolled back.
        """
        with self._sync_lock:
            return self._apply_staged(staged)

    def _stage_version(self, version: int | None) -> Staged:
        t0 = time.perf_counter()
        if version is None:
            version = catalog.latest_version(self.store)
            if version is None:
                raise ObjectNotFound(f"store {self.store.url} holds no committed version yet")
        held = self.target.held()
        if held is not None and held.version == version:
            return Staged(version, held, self.store.url, (), 0, time.perf_counter() - t0,
                          [], None, [], None)
        route = catalog.plan(self.store, held.version if held else None, version)
        steps, fetched = self._stage(route, held)
        held_digests = self._held_digests(held, steps[0].manifest)
        specs = steps[-1].expect.specs()  # O(tensors) checks kept out of the pause
        current = self.target.specs()
        if current is not None:
            check_same_model(specs, current, "the target")
        return Staged(version, held, self.store.url, tuple(r.label for r in route), fetched,
                      time.perf_counter() - t0, steps, held_digests, specs, current)

    def _apply_staged(self, staged: Staged) -> SyncResult:
        if staged.store != self.store.url:
            raise UsageError(f"version {staged.version} was staged from {staged.store}, but this "
                             f"receiver reads {self.store.url}: apply it with the receiver that "
                             "staged it")
        held = self.target.held()
        if held != staged.held:
            raise BaseMismatch(f"version {staged.version} was staged against {_describe(staged.held)}"
                               f" but the target now holds {_describe(held)}; nothing applied: "
                               "stage it again")
        t1 = time.perf_counter()
        apply_s = verify_s = 0.0
        if staged.route:
            with self.lock:
                apply_s, verify_s = self._apply(held, staged._steps, staged._held_digests,
                                                staged._specs, staged._current)
        pause = time.perf_counter() - t1 if staged.route else 0.0
        return SyncResult(staged.version, staged.from_version, staged.route, staged.bytes_fetched,
                          staged.stage_seconds, apply_s, verify_s, pause,
                          staged.stage_seconds + pause)

    # -- stage ----------------------------------------------------------------------------------
    def _stage(self, route: list[catalog.Rep], held: Held | None) -> tuple[list[_Step], int]:
        manifests = [catalog.read_manifest(self.store, r.key) for r in route]
        expects = [self._expected(manifests, i) if r.inverse else m
                   for i, (r, m) in enumerate(zip(route, manifests, strict=True))]
        jobs = [(mi, ci) for mi, m in enumerate(manifests) for ci in range(len(m.chunks))]
        # The first delta of the route applies to the bits held now: decode its exponent-grouped
        # positions against them already (slow scan, off the pause), and sum the digest lanes of
        # the words it will replace. Later deltas in a chain depend on bits that do not exist
        # yet; they decode during apply. (An inverse step has no grouped positions: refused.)
        first = manifests[0]
        first_from = first.root if route[0].inverse else first.base_root
        base_bits = self.target.peek() if held is not None and first_from == held.root else {}
        first_specs = first.specs()

        def fetch(job: tuple[int, int]) -> tuple[ChunkFrame, list[bytes | None]]:
            m = manifests[job[0]]
            ref = m.chunks[job[1]]
            where = f"chunk {self.store.url}/{ref.key}"
            blob = self.sources.fetch(ChunkId.of(m, route[job[0]].key, job[1]))
            frame = decode_chunk(blob, where=where)
            _check_segments(frame, ref, m, where, inverse=route[job[0]].inverse)
            olds: list[bytes | None] = [None] * len(frame.segments)
            if job[0] == 0 and base_bits:
                frame = ChunkFrame(tuple(self._regap(seg, first_specs, base_bits, where)
                                         for seg in frame.segments))
                if self.verify == "incremental":
                    olds = [_old_digest(seg, first_specs, base_bits, where)
                            for seg in frame.segments]
            return frame, olds

        try:
            with ThreadPoolExecutor(self.workers) as pool:
                frames = list(pool.map(fetch, jobs))
        except ObjectNotFound as exc:
            raise ObjectNotFound(f"{exc}: the version's chunks are missing (deleted by retention "
                                 "or never written); retry to re-plan") from exc
        staged = []
        it = iter(frames)
        for r, m, expect in zip(route, manifests, expects, strict=True):
            got = [next(it) for _ in m.chunks]
            staged.append(_Step(m, [f for f, _o in got], [o for _f, o in got], r.inverse, expect))
        return staged, sum(r.payload_bytes for r in route)

    def _expected(self, manifests: list[Manifest], i: int) -> Manifest:
        """The manifest of the version inverse step i arrives at (its delta's base).

        Any representation of a version records that version's digests and root: the next
        inverse step's delta usually is one; otherwise the base's primary manifest. It must
        have the root the delta names as its base, and the same tensor table.
        """
        m = manifests[i]
        base = m.base
        if base is None:  # catalog.plan never routes so
            raise UsageError(f"{self.store.url}: a full representation of version {m.version} "
                             "cannot be applied inversely")
        found = next((o for o in manifests if o.version == base), None)
        if found is None:
            found = catalog.primary_manifest(self.store, base)
        where = f"version {base} in {self.store.url}"
        if found.root != m.base_root:
            raise BaseMismatch(f"{where} has root {found.root[:12]}…, but delta {m.version} names "
                               f"its base's root {(m.base_root or '')[:12]}…: the store's history "
                               "is inconsistent; nothing applied")
        check_same_model(m.specs(), found.specs(), where)
        return found

    @staticmethod
    def _regap(seg: Segment, specs: list[TensorSpec], base_bits: dict[str, np.ndarray],
               where: str) -> Segment:
        spec = specs[seg.tensor]
        base = base_bits.get(spec.name)
        if seg.positions != Positions.GROUPS or base is None or base.dtype != spec.dtype.uint \
                or base.size != spec.numel:
            return seg  # nothing to do, or a mismatch the apply step reports properly
        return regap_segment(seg, base[seg.start: seg.stop], spec.dtype, where)

    def _held_digests(self, held: Held | None, first: Manifest) -> dict[str, bytes] | None:
        """Tensor digests of the version the target holds, if the route's first step needs them.

        Runs before the pause. From this receiver's last commit; else the held version's
        manifest, bound to the held root; else (deleted by retention, or a target from another
        process) the digest of the held bits, read while the target still serves.
        """
        if self.verify != "incremental" or held is None or first.base is None or self.verify_base:
            return None  # not needed, or verify_base's full pass in the pause provides them
        if self._committed is not None and self._committed[0] == held.root:
            return self._committed[1]
        specs = first.specs()
        try:
            m = catalog.primary_manifest(self.store, held.version)
            if m.root == held.root:
                return {e.name: bytes.fromhex(e.digest) for e in m.tensors}
        except (ObjectNotFound, VersionNotFound, FormatError):
            pass  # deleted by retention, or unreadable: read the held bits instead
        peek = self.target.peek()
        digests = {s.name: digest_bits(peek[s.name]) for s in specs
                   if s.name in peek and peek[s.name].size == s.numel}
        if len(digests) == len(specs):
            got = root_digest((s, digests[s.name]) for s in specs).hex()
            if got != held.root:
                raise _modified_outside(got, held.root)
        return digests

    # -- apply ----------------------------------------------------------------------------------
    def _apply(self, held: Held | None, staged: list[_Step],
               held_digests: dict[str, bytes] | None, specs: list[TensorSpec],
               current: list[TensorSpec] | None) -> tuple[float, float]:
        """Apply the route, verify, commit; returns (apply seconds, verify seconds).

        specs: the final manifest's tensor table; current: the target's (checked to match
        before the pause, by _stage_version).
        """
        final = staged[-1].expect
        # a target holding nothing is materialized afresh and discarded on failure: no undo copy
        undo = UndoLog(fresh=current is None)
        apply_s = verify_s = 0.0
        try:
            views = self.target.open(specs)
            alias = unique_views({s.name: views[s.name] for s in specs})
            _check_disjoint(views, alias)
            t = time.perf_counter()
            if held is not None and self.verify_base:
                held_digests = self._verify_root(views, specs, held.root)
            verify_s += time.perf_counter() - t
            touched: set[int] = set()
            digests = dict(held_digests) if held_digests is not None else None
            state_root = held.root if held else None
            for st in staged:
                m = st.manifest
                if st.inverse and m.root != state_root:
                    raise BaseMismatch(f"delta {m.version} applied inversely needs version "
                                       f"{m.version} ({m.root[:12]}…) but the target holds "
                                       f"{(state_root or 'nothing')[:12]}…; refusing to apply")
                if not st.inverse and m.base is not None and m.base_root != state_root:
                    raise BaseMismatch(f"delta {m.version} has base {m.base} "
                                       f"({(m.base_root or '')[:12]}…) but the target holds "
                                       f"{(state_root or 'nothing')[:12]}…; refusing to apply")
                # a fresh target needs no undo copy for the full representation it starts with;
                # deltas after it record their dense writes (verification reads the old words)
                undo.fresh = current is None and m.base is None
                t = time.perf_counter()
                changes, busy_apply, busy_verify = self._apply_manifest(
                    m, st.frames, st.olds, views, alias, undo, touched, inverse=st.inverse)
                t2 = time.perf_counter()
                if self.verify == "incremental":
                    digests = self._check_manifest(views, alias, st.expect, changes, digests,
                                                   from_nothing=m.base is None)
                t3 = time.perf_counter()
                # apply and per-chunk digest work interleave on the threads: split their wall
                # time in proportion to busy time
                share = busy_verify / (busy_apply + busy_verify) if busy_verify else 0.0
                apply_s += (t2 - t) * (1 - share)
                verify_s += (t2 - t) * share + (t3 - t2)
                state_root = st.expect.root
            t = time.perf_counter()
            if self.verify == "full":
                self._verify_touched(views, final, touched)
                digests = None
            verify_s += time.perf_counter() - t
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
        self._committed = (final.root, digests) if digests is not None else None
        return apply_s, verify_s

    def _apply_manifest(self, m: Manifest, frames: list[ChunkFrame], olds: list[list[bytes | None]],
                        views: dict[str, np.ndarray], alias: dict[str, str], undo: UndoLog,
                        touched: set[int], *, inverse: bool = False
                        ) -> tuple[list[tuple[int, bytes]], float, float]:
        """Apply every chunk of `m` in place; with incremental verification, each chunk's digest
        changes are taken by the same thread. Returns (tensor index, digest change) pairs and the
        busy seconds of apply and of digests, summed over threads.

        A full representation's change is the digest of each range written (from nothing), read
        back after the chunk. A delta's is, per segment, Σ mix(new) − mix(old) over the elements
        it rewrote, folded in by the apply kernel as it writes each word (so it counts as apply
        time): mix(new) always, mix(old) unless it was staged from the held bits before the
        pause. Measured on 2 cores at 2% changed, folding costs ~0.2x the apply where reading
        the new words back after it cost ~1x, and folding the old half in the pause ~0.25x
        (staging it costs more CPU, ~1.2x, but outside the pause). Not re-reading memory is safe
        because _check_disjoint refused targets whose views partly overlap. `alias`: the
        views' unique_views. `inverse`: undo the delta `m` instead (the same folding gives the
        change from m's version to its base).
        """
        specs = m.specs()
        touched.update(i for i, s in enumerate(specs) if alias[s.name] != s.name)  # verify aliases
        incremental = self.verify == "incremental"

        def apply_chunk(frame: ChunkFrame, ref: ChunkRef, old: list[bytes | None]
                        ) -> tuple[list[tuple[int, bytes]], float, float]:
            t0 = time.thread_time()
            fold = incremental and m.base is not None
            changes: list[tuple[int, bytes]] = []
            for seg, seg_old in zip(frame.segments, old, strict=True):
                spec = specs[seg.tensor]
                if alias[spec.name] != spec.name:
                    continue  # tied to an earlier name: its bits change through that one
                dst = views[spec.name][seg.start: seg.stop]
                dnew = np.zeros(2, np.uint64) if fold else None
                dold = np.zeros(2, np.uint64) if fold and seg_old is None else None
                apply_segment(seg, dst, spec.dtype, undo, f"{self.store.url}/{ref.key}",
                              dnew=dnew, dold=dold, inverse=inverse)
                if dnew is not None:
                    before = seg_old if dold is None else lanes_digest(dold)
                    changes.append((seg.tensor, digest_sub(lanes_digest(dnew), before or b"")))
                touched.add(seg.tensor)
            if m.base is None:
                touched.update(ti for ti, _s, _e in ref.covers)
                touched.update(ti for ti, _o, _s in ref.boxes)
            t1 = time.thread_time()
            if incremental and m.base is None:
                changes = [(ti, digest_affine(views[specs[ti].name][a:b], a, (1,), threads=1))
                           for ti, a, b in ref.covers if alias[specs[ti].name] == specs[ti].name]
                for ti, offset, shape in ref.boxes:  # a box: its strided view, placed, no copy
                    if alias[specs[ti].name] == specs[ti].name:
                        box = ShardBox(specs[ti].shape, tuple(offset), tuple(shape))
                        block = views[specs[ti].name].reshape(specs[ti].shape)[box.slices]
                        changes.append((ti, digest_affine(block, box.first, box.strides,
                                                          threads=1)))
            return changes, t1 - t0, time.thread_time() - t1

        # Chunks cover disjoint ranges, so they apply in parallel (the kernels release the GIL);
        # every job finishes before an error propagates, so rollback never races an apply.
        with ThreadPoolExecutor(self.apply_workers) as pool:
            jobs = [pool.submit(apply_chunk, f, r, o)
                    for f, r, o in zip(frames, m.chunks, olds, strict=True)]
            wait(jobs)
        done = [job.result() for job in jobs]
        return ([c for d in done for c in d[0]], sum(d[1] for d in done),
                sum(d[2] for d in done))

    def _check_manifest(self, views: dict[str, np.ndarray], alias: dict[str, str], m: Manifest,
                        changes: list[tuple[int, bytes]], digests: dict[str, bytes] | None, *,
                        from_nothing: bool) -> dict[str, bytes]:
        """Digests after a step (held digests + changes), checked against m's, the manifest of
        the version the step arrived at (same tensor table as the step's).

        A full representation starts from nothing (`from_nothing`). Tensors without a held
        digest (none known) are digested in full; a tied name takes its first name's digest
        (the same words).
        """
        specs = m.specs()
        if from_nothing:
            new = {s.name: ZERO_DIGEST for s in specs}
        else:
            new = dict(digests) if digests is not None else {}
        touched = {ti for ti, _ in changes}
        missing = {ti for ti in touched if specs[ti].name not in new}
        for ti in missing:
            new[specs[ti].name] = digest_bits(views[specs[ti].name])
        for ti, change in changes:
            if ti not in missing:
                new[specs[ti].name] = digest_add(new[specs[ti].name], change)
        check = set(touched)
        for i, s in enumerate(specs):
            if alias[s.name] != s.name:  # a tied name holds the very same words as its first
                first = alias[s.name]
                new[s.name] = new[first] if first in new else digest_bits(views[first])
                check.add(i)
        bad = [specs[i].name for i in sorted(check)
               if new[specs[i].name].hex() != m.tensors[i].digest]
        if bad:
            raise IntegrityError(f"after applying version {m.version}, {len(bad)} tensor(s) differ "
                                 f"from the manifest's digests: {bad[:5]}; rolled back")
        return new

    def _verify_touched(self, views: dict[str, np.ndarray], m: Manifest,
                        touched: set[int]) -> None:
        """Digests of every tensor the route changed must equal the manifest's (full pass).

        Untouched tensors still hold bits that were verified when their version committed.
        """
        entries = [m.tensors[i] for i in sorted(touched)]
        digests = _digests(views, [e.name for e in entries])
        bad = [e.name for e in entries if digests[e.name] != e.digest]
        if bad:
            raise IntegrityError(f"after applying version {m.version}, {len(bad)} tensor(s) differ "
                                 f"from the manifest's digests: {bad[:5]}; rolled back")

    def _verify_root(self, views: dict[str, np.ndarray], specs: list[TensorSpec],
                     root: str) -> dict[str, bytes]:
        """Digest every tensor; refuse unless they make the held root. Returns the digests."""
        digests = _digests(views, [s.name for s in specs])
        got = root_digest((s, bytes.fromhex(digests[s.name])) for s in specs).hex()
        if got != root:
            raise _modified_outside(got, root)
        return {n: bytes.fromhex(d) for n, d in digests.items()}


def _modified_outside(got: str, claimed: str) -> BaseMismatch:
    return BaseMismatch(f"the target's bits (root {got[:12]}…) are not the version it claims to "
                        f"hold (root {claimed[:12]}…): it was modified outside weighthub; pull it "
                        "afresh (`weighthub pull --force`, or into an empty path)")


def _describe(held: Held | None) -> str:
    return f"version {held.version} (root {held.root[:12]}…)" if held else "nothing"


def _check_disjoint(views: dict[str, np.ndarray], alias: dict[str, str]) -> None:
    """Refuse a target whose writable views partly overlap in memory.

    Exact aliases (tied weights) are fine: unique_views applies through one name only. A partial
    overlap is not: writes through one name would change another's words behind the digests,
    which the apply kernels compute from what they write without re-reading memory, and chunks
    applying in parallel could race on the shared words. One sort of the views' byte extents;
    extents that intersect (strided views can interleave without sharing a byte) are decided by
    np.shares_memory, bounded, and a pair it cannot decide counts as overlapping. `alias`: the
    views' unique_views. ~2 µs a view (1236 views: 2.5 ms).
    """
    spans = sorted((*_byte_extent(views[name]), name) for name, first in alias.items()
                   if first == name and views[name].size)
    open_: list[tuple[int, str]] = []  # (end, name) of extents still reaching past the cursor
    for lo, hi, name in spans:
        open_ = [(end, other) for end, other in open_ if end > lo]
        for _end, other in open_:
            try:
                shared = np.shares_memory(views[name], views[other], max_work=1 << 16)
            except np.exceptions.TooHardError:
                shared = True
            if shared:
                raise PlacementError(f"the target's tensors {other!r} and {name!r} partly share "
                                     "memory (neither is an exact alias of the other): weighthub "
                                     "cannot update one without the other; give each tensor its "
                                     "own storage, or tie them as exact aliases")
        open_.append((hi, name))


def _byte_extent(v: np.ndarray) -> tuple[int, int]:
    """[first, last + 1) byte addresses an array's elements occupy."""
    lo = hi = v.ctypes.data
    if v.flags.c_contiguous:
        return lo, lo + v.nbytes
    for n, st in zip(v.shape, v.strides, strict=True):
        lo += min(0, (n - 1) * st)
        hi += max(0, (n - 1) * st)
    return lo, hi + v.itemsize


def _old_digest(seg: Segment, specs: list[TensorSpec], base_bits: dict[str, np.ndarray],
                where: str) -> bytes | None:
    spec = specs[seg.tensor] if seg.tensor < len(specs) else None
    base = base_bits.get(spec.name) if spec is not None else None
    if spec is None or base is None or base.dtype != spec.dtype.uint or base.size != spec.numel:
        return None  # a mismatch the apply step reports properly
    return staged_old_digest(seg, base[seg.start: seg.stop], spec.dtype, where)


def _digests(views: dict[str, np.ndarray], names: list[str]) -> dict[str, str]:
    with ThreadPoolExecutor(2) as pool:  # the digest kernels release the GIL
        return dict(zip(names, pool.map(lambda n: digest_bits(views[n], threads=1).hex(), names),
                        strict=True))


def _check_segments(frame: ChunkFrame, ref: ChunkRef, m: Manifest, where: str, *,
                    inverse: bool = False) -> None:
    """Every segment must lie inside the chunk's declared coverage (no writes elsewhere), and
    for a delta applied inversely be invertible (the planner took the manifest's word for it).

    A segment in a box (part of a trainer rank's strided shard, spec §3) spans a flat range
    that interleaves other chunks' elements: its positions are decoded here, before anything is
    applied, and must all lie in one of the chunk's boxes (chunks apply in parallel and roll
    back exactly only if what they write is disjoint).
    """
    boxes = [(ti, ShardBox(tuple(m.tensors[ti].shape), tuple(o), tuple(s))) for ti, o, s in ref.boxes]
    for i, seg in enumerate(frame.segments):
        if not any(seg.tensor == ti and start <= seg.start and seg.stop <= stop
                   for ti, start, stop in ref.covers):
            why = [segment_outside(seg, box) for ti, box in boxes if ti == seg.tensor]
            if None not in why:
                raise FormatError(f"{where}: segment {i} writes tensor {seg.tensor} "
                                  f"[{seg.start}, {seg.stop}) outside the chunk's coverage"
                                  + (f" ({why[0]})" if why else ""))
        if m.base is None and seg.op != Op.DENSE:
            raise FormatError(f"{where}: a full representation may only hold dense segments")
        if inverse and not seg.invertible:
            name = m.tensors[seg.tensor].name if seg.tensor < len(m.tensors) else seg.tensor
            raise FormatError(f"{where}: segment {i} of tensor {name!r} is "
                              f"{seg.op.name.lower()}/{seg.positions.name.lower()}, which cannot "
                              "be applied inversely, though the manifest lists only invertible ops "
                              "for it: the manifest misstates its chunks; nothing applied")
    if m.base is None:
        total = sum(seg.numel for seg in frame.segments)
        need = (sum(stop - start for _t, start, stop in ref.covers)
                + sum(box.numel for _t, box in boxes))
        if total != need:
            raise FormatError(f"{where}: full chunk carries {total} of {need} covered elements")

