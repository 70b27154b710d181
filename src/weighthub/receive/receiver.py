"""`Receiver`: keeps one target in sync with the versions in a store (the engine's facade).

`sync` = `stage` then `apply`, with no other sync in between. `stage` plans the route
(`catalog.plan`), reads its manifests (`routes`), fetches and decodes its chunks (`stage`) and
finds the held version's digests, touching nothing; `apply` runs the transaction (`engine`)
under `Receiver.lock`. A `Staged` version is tied to the version the target held when it was
staged, and `apply` refuses it (BaseMismatch, nothing touched) if the target has moved since.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from .. import catalog
from ..errors import BaseMismatch, ObjectNotFound, UsageError
from ..format import Manifest
from ..nogc import collections_deferred
from ..sources import SourceList
from ..store import Store
from ..targets.base import Held, Target
from ..targets.state_dict import StateDictTarget
from ..tensors import TensorSpec, check_same_model
from .early import EarlyChunks, EarlyDecoder
from .engine import transact
from .inputs import Step
from .routes import held_digests, read_route
from .stage import stage_route


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
    seconds: float  # stage + pause

    @property
    def backward(self) -> bool:
        """Did the route undo deltas (apply at least one inversely)?"""
        return _backward(self.route)


def _backward(route: tuple[str, ...]) -> bool:
    return any(step.endswith(catalog.INVERSE) for step in route)


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
    _steps: list[Step]
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

    @property
    def arrives(self) -> Manifest | None:
        """The manifest of `version` (its tensor digests and root), read while staging; None
        when the target already held it."""
        return self._steps[-1].arrives if self._steps else None


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

    Observers that must see all of one version (invariant 2) read the target under `lock`:
    the engine changes bits, and commits or rolls back, only while it is held.
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
        self._early: EarlyDecoder | None = None
        self.early_used = 0  # chunks the last staging took decoded from `decode_early`

    @property
    def version(self) -> int | None:
        held = self.target.held()
        return held.version if held else None

    def sync(self, version: int | None = None) -> SyncResult:
        """Bring the target to `version` (default: the latest committed): stage, then apply,
        with no other sync in between. See the package doc.

        If another process changes the target between staging and applying (a file target
        shared by two pulls: its lock serializes their transactions), the version is staged
        again from what the target then holds, once.
        """
        with self._sync_lock:
            staged = self._stage_version(version)
            try:
                return self._apply_staged(staged)
            except BaseMismatch:
                # another process (a second pull into the same file) committed between our
                # staging and the target's lock: stage again from what it holds now, once
                if self.target.held() == staged.held:
                    raise
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

    def decode_early(self, version: int, directory: str | Path) -> bool:
        """Start decoding `version`'s chunks as they appear in `directory` (a LocalStore filled
        by rename, e.g. this host's node daemon's relay cache), before its manifest exists:
        a delta from the held version, against the held bits (`receive.early`). The next
        staging of `version` takes what was decoded (after every check it makes) and stops
        it; any other staging or apply stops it first. False (nothing started) when the
        target holds nothing or nothing older than `version`."""
        with self._sync_lock:
            self._stop_early()
            held = self.target.held()
            if held is None or held.version >= version:
                return False
            specs = catalog.primary_manifest(self.store, held.version).specs()
            self._early = EarlyDecoder(Path(directory), version, held, specs, self.target.peek(),
                                       incremental=self.verify == "incremental")
            return True

    def _stop_early(self, version: int | None = None) -> EarlyChunks | None:
        """Stop the early decoder; what it decoded if it was decoding `version`."""
        early, self._early = self._early, None
        if early is None:
            return None
        chunks = early.stop()
        return chunks if early.version == version else None

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

    def preview(self, staged: Staged, scratch: StateDictTarget,
                state: Mapping[str, torch.Tensor]) -> None:
        """Bring `scratch`, a second copy of the target's tensors that the caller keeps, to
        `staged`'s version: the staged steps applied and verified in a transaction of its own,
        the target untouched. For work that needs a version's values before its pause (a
        serving engine's kernels, `targets.vllm_prepack`). A scratch that does not hold what
        `staged` was staged against (new, or its last preview was not committed) first gets
        `state`, the target's tensors, copied in; one kept from preview to preview costs only
        the apply (no copy, no fresh pages).

        Raises:
            UsageError: staged from another store. BaseMismatch: the target moved since
                staging. IntegrityError, ...: as `apply` (the scratch rolled back).
        """
        with self._sync_lock:
            if staged.store != self.store.url:
                raise UsageError(f"version {staged.version} was staged from {staged.store}, "
                                 f"not from this receiver's {self.store.url}")
            if self.target.held() != staged.held:
                raise BaseMismatch(f"version {staged.version} was staged against "
                                   f"{_describe(staged.held)} but the target now holds "
                                   f"{_describe(self.target.held())}: stage it again")
            if scratch.held() != staged.held or staged.held is None:
                copies = scratch.state
                if [(n, t.shape, t.dtype) for n, t in copies.items()] != \
                        [(n, t.shape, t.dtype) for n, t in state.items()]:
                    copies.clear()
                    copies.update((n, t.clone()) for n, t in state.items())
                else:
                    for n, t in state.items():
                        copies[n].copy_(t)
                if staged.held is None:
                    return  # nothing held: nothing to preview against
                scratch.commit(staged.held)  # its bits are the target's: the held version's
            if staged.route:
                transact(scratch, staged._steps, store=self.store.url, held=staged.held,
                         specs=staged._specs, fresh=False, verify=self.verify,
                         held_digests=staged._held_digests, apply_workers=1)

    def _stage_version(self, version: int | None) -> Staged:
        with collections_deferred():  # a staging's allocations set off a full collection
            return self._stage_deferred(version)

    def _stage_deferred(self, version: int | None) -> Staged:
        t0 = time.perf_counter()
        if version is None:
            version = catalog.latest_version(self.store)
            if version is None:
                raise ObjectNotFound(f"store {self.store.url} holds no committed version yet")
        early = self._stop_early(version)
        self.early_used = 0
        held = self.target.held()
        if held is not None and held.version == version:
            return Staged(version, held, self.store.url, (), 0, time.perf_counter() - t0,
                          [], None, [], None)
        route = catalog.plan(self.store, held.version if held else None, version)
        manifests = read_route(self.store, route)
        steps = stage_route(route, manifests, self.sources, self.target, held,
                            where=self.store.url, incremental=self.verify == "incremental",
                            workers=self.workers, early=early)
        self.early_used = early.used if early is not None else 0
        first = steps[0].manifest
        # the held version's digests, when the first step (a delta) is verified incrementally;
        # verify_base's full pass in the pause provides them otherwise
        digests = (held_digests(self.store, self.target, held, first, self._committed)
                   if self.verify == "incremental" and held is not None
                   and first.base is not None and not self.verify_base else None)
        specs = steps[-1].specs  # its arrival's table too; O(tensors) checks kept out of the pause
        current = self.target.specs()
        if current is not None:
            check_same_model(specs, current, "the target")
        return Staged(version, held, self.store.url, tuple(r.label for r in route),
                      sum(r.payload_bytes for r in route), time.perf_counter() - t0, steps,
                      digests, specs, current)

    def _apply_staged(self, staged: Staged) -> SyncResult:
        self._stop_early()  # it reads the bits this changes
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
                out = transact(self.target, staged._steps, store=self.store.url, held=held,
                               specs=staged._specs, fresh=staged._current is None,
                               verify=self.verify, held_digests=staged._held_digests,
                               verify_base=self.verify_base, apply_workers=self.apply_workers)
            self._committed = (out.held.root, out.digests) if out.digests is not None else None
            apply_s, verify_s = out.apply_seconds, out.verify_seconds
        pause = time.perf_counter() - t1 if staged.route else 0.0
        return SyncResult(staged.version, staged.from_version, staged.route, staged.bytes_fetched,
                          staged.stage_seconds, apply_s, verify_s, pause,
                          staged.stage_seconds + pause)


def _describe(held: Held | None) -> str:
    return f"version {held.version} (root {held.root[:12]}…)" if held else "nothing"
