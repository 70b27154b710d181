"""vLLM as a weighthub receiver: a worker extension driven through `collective_rpc`.

Start the engine the way a user would, from the trainer's checkpoint directory, with
`worker_extension_cls="weighthub.engines.vllm.WeighthubWorker"`; then, from the driver::

    bind(llm, "/stores/policy")        # adopt the store's version whose bits the engine loaded
    refit(llm)                         # latest version: fetch, stage, apply, verify, commit

or in two steps, so that the refit pauses the engine only to apply, verify and commit::

    stage(llm)                         # latest version: fetch, check, decode; weights untouched
    refit(llm)                         # applies what was staged

Where the engine holds every canonical tensor as plain bits (GPU builds with unquantized weights;
vLLM CPU with `WEIGHTHUB_VLLM_PLAIN_CPU_WEIGHTS=1`, `engines.vllm_plugin`), bind finds each
tensor's parameter (or its rows of a fused one), checks its bits, and the Receiver applies every
delta in place there: the pause is the sparse apply, the digest check and the commit, failures
roll back through the undo log in the engine's memory, and no host copy of the model is kept
(`in_place` in bind's result; `in_place_refused` says why not).

Otherwise each worker keeps a canonical mirror of the checkpoint (a StateDictTarget) that the
Receiver brings to the version bit-exactly and verifies by digest. `EngineTarget` wraps that
mirror: at commit it pushes the tensors whose digests changed, expanded to whole fused groups,
through vLLM's own loader (`vllm_engine.EnginePlacement`), except where `stage` built the
changed layers' packed kernels beside the serving ones (`targets.vllm_prepack`, proven at bind;
`WEIGHTHUB_VLLM_PREPACK=0` turns it off): commit then installs those and writes the plain
parameters. If that fails the Receiver rolls the mirror back and `abort` restores the engine
from it, so the engine keeps serving its previous version.

Only small values cross the RPC boundary (a store URL, a version, a dict of results); errors come
back as {"error": class name, "message": ...} and `bind`/`stage`/`refit` re-raise them as the same
weighthub error class on the driver. The ranks of a tensor-parallel engine commit a version
together (`refit` runs the commit vote of `engines.vote`): all of them, or none.

Limitations: with vLLM's multiprocess engine core `stage` is an RPC that runs on the worker's
thread, so the engine does not step while it runs: it moves the fetch out of the refit, it does
not overlap it with generation. An in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) can stage
from another thread while it generates (`integrations.ray.rollout` does); a refit without
a staged version stages inline, through the loader (`stage_s` vs `pause_s` in the result); the
mirror (not in place) costs one host copy of the canonical model per worker, and building kernels
while staging a second copy and the changed layers' kernels until the pause; an exception inside
vLLM's layerwise reload may leave its bookkeeping half done (the restore is tested with a loader
that fails between tensors, not inside vLLM).
"""

from __future__ import annotations

import contextlib
import resource
import time
from typing import TYPE_CHECKING, Any

import torch

from ..cluster.peers import HolderSource
from ..cluster.relayed import RelayedManifests
from ..errors import UsageError, WeighthubError
from ..net.auth import MIN_SECRET_BYTES
from ..receive import Receiver, Staged
from ..sources import ChunkSource, NodeCacheReader, SourceList, StoreSource
from ..sources.staging import StagingSource
from ..store import Store, open_store
from ..targets.safetensors_file import load_checkpoint
from ..targets.state_dict import StateDictTarget
from ..targets.vllm_engine import EnginePlacement, PushReport
from .vllm_checks import check_committed, check_same_bits, digests_of, find_version, staged_relayed
from .vllm_driver import bind, decode_early, refit, stage
from .vllm_target import EngineTarget
from .vote import FAILED, Vote
from .warm import warm_kernels

__all__ = ["EXTENSION", "WeighthubWorker", "bind", "decode_early", "refit", "stage"]

EXTENSION = "weighthub.engines.vllm.WeighthubWorker"


class WeighthubWorker:
    """Mixed into vLLM's worker class (`worker_extension_cls`); methods run on every worker.

    State lives in `self._weighthub` (set by `weighthub_bind`). Helpers are prefixed `_wh_`:
    vLLM refuses an extension with a name its worker class already has.
    """

    _weighthub: tuple[Receiver, EngineTarget]
    _wh_staged: tuple[str | None, Receiver, Staged] | None  # (store_url asked for, by, staged)
    # bind's chunk sources: node_cache, stage_dir, peers, secret
    _wh_sources: tuple[str | None, str | None, tuple[str, ...], bytes]
    _wh_vote: Vote | None  # the refit prepared by weighthub_prepare, awaiting its decision

    # vLLM's Worker provides these; declared for the type checker only
    model_runner: Any
    vllm_config: Any

    if TYPE_CHECKING:
        def reload_weights(self, *, weights_iterator: Any) -> None: ...

    def weighthub_bind(self, store_url: str, version: int | None = None, xor: bool = True,
                       stage_dir: str | None = None, peers: tuple[str, ...] = (),
                       secret: bytes = b"", node_cache: str | None = None) -> dict[str, Any]:
        """Adopt `version` of the store as what the engine serves.

        The engine must serve exactly that version's bits: at first bind, the safetensors
        checkpoint it was started from (default version: the newest whose manifest digests are
        the checkpoint's); when rebinding, the version it was refitted to.
        A full reload of every tensor through vLLM's loader follows, which proves the loader
        reads every canonical tensor (and times a full reload for comparison); it writes the
        bits the engine already holds. Where the engine keeps a mirror, bind then proves which
        layers' packed kernels a staging may build itself (`targets.vllm_prepack`; `prepacked`
        and `prepack_refused` in the result). `stage_dir`: a host staging cache shared by the
        workers on this host (`sources.staging`), so each chunk is fetched from the store once
        per host.
        `peers`: chunk servers asked before the store (e.g. this host's node daemon, which the
        relay tree feeds), with the group's shared `secret`; one that fails is benched and the
        store serves instead. `node_cache`: that daemon's relay cache directory, read first and
        in place (`sources.NodeCacheReader`): a pushed chunk costs a file read, no request.
        """
        return _rpc(lambda: self._wh_bind(store_url, version, xor,
                                          (node_cache, stage_dir, tuple(peers), secret)))

    def weighthub_stage(self, version: int | None = None, store_url: str | None = None,
                        manifest: bytes | None = None,
                        manifest_sha256: str | None = None) -> dict[str, Any]:
        """Fetch, check and decode `version` (default: latest) against what the engine holds,
        leaving its weights untouched; kept for the next `weighthub_refit` (replaces any
        version staged before). `store_url`: as for `weighthub_refit`.

        `manifest`: `version`'s primary manifest as the relay tree delivered it to this host
        (e.g. by its node daemon), used only if it hashes to `manifest_sha256`, the digest the
        hub recorded at the commit, and is one delta from what the engine holds: the route is
        then planned from it, with no listing or manifest read from the store (its chunks are
        still checked against it). Otherwise the store plans, as without it.
        `relayed_manifest` in the result says which."""
        return _rpc(lambda: self._wh_stage(version, store_url, manifest, manifest_sha256))

    def weighthub_decode_early(self, version: int) -> dict[str, Any]:
        """Decode `version`'s chunks as they land in this host's node cache, before it is
        committed, for the next `weighthub_stage` of it (`Receiver.decode_early`)."""
        def start() -> dict[str, Any]:
            receiver, node_cache = self._wh_bound()[0], self._wh_sources[0]
            return {"started": node_cache is not None and receiver.decode_early(version, node_cache)}
        return _rpc(start)

    def weighthub_refit(self, version: int | None = None,
                        store_url: str | None = None) -> dict[str, Any]:
        """Bring the engine to `version` (default: latest). All or nothing.

        Applies the version `weighthub_stage` staged if it matches (same `store_url`, `version`
        None or the staged one, the engine still holding what it was staged against), else
        stages inline; either way the staged version is dropped. `prestaged` in the result says
        which. `store_url` reads this refit from another store (a replica of the bound one); the
        delta's base must still be exactly what the engine holds (BaseMismatch otherwise).
        """
        return _rpc(lambda: self._wh_refit(version, store_url))

    def weighthub_prepare(self, version: int | None = None, store_url: str | None = None,
                          timeout_s: float = 60.0) -> dict[str, Any]:
        """The commit vote's first phase (`engines.vote`): a refit as `weighthub_refit` that
        holds its commit open until `weighthub_decide` (or aborts after `timeout_s`). Returns
        {"state": prepared | done | failed, "error"?, "message"?}."""
        return _rpc(lambda: self._wh_prepare(version, store_url, timeout_s))

    def weighthub_decide(self, commit: bool) -> dict[str, Any]:
        """The vote's second phase: commit (or abort) the prepared refit; its result."""
        return _rpc(lambda: self._wh_decide(commit))

    def weighthub_full_reload(self) -> dict[str, Any]:
        """Reload every tensor from the mirror through vLLM's loader (the baseline to beat)."""
        return _rpc(lambda: self._wh_full_reload())

    def weighthub_held(self) -> dict[str, Any]:
        """The committed version the engine serves: {store, model, version, root}, read from the
        receiver's target (what the last commit recorded), for attesting rollouts."""
        return _rpc(lambda: self._wh_held())

    def weighthub_audit(self) -> dict[str, Any]:
        """Digest every parameter the engine holds as a plain copy (read back from the engine,
        not the mirror) against the committed version's manifest: `mismatched` names those
        whose bits changed outside weighthub. Repacked parameters cannot be read back (`checked`
        counts what could)."""
        return _rpc(lambda: self._wh_audit())

    def weighthub_load_state(self, state: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The usual route, as a baseline: every tensor of a full state through vLLM's loader.

        `state` must be the committed version's bits (checked by its manifest's digests first,
        untimed): the engine and its mirror stay one version, and an engine changed outside
        weighthub is healed, in place too. Tensors cross `collective_rpc` by value: use it
        with an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) or pay the pickling."""
        return _rpc(lambda: self._wh_load_state(state))

    def weighthub_digests(self) -> dict[str, Any]:
        """Digests of the canonical view: read back from the engine where its parameter is a
        plain copy, else from the mirror (marked by source)."""
        return _rpc(lambda: self._wh_digests())

    # -- implementation -------------------------------------------------------------------------
    def _wh_bind(self, store_url: str, version: int | None, xor: bool,
                 chunk_sources: tuple[str | None, str | None, tuple[str, ...], bytes]
                 ) -> dict[str, Any]:
        warm_kernels()  # once per process: the first refit then runs no JIT (engines.warm)
        store = open_store(store_url)
        bound = getattr(self, "_weighthub", None)
        path = self.vllm_config.model_config.model
        # what the engine serves: its start-up checkpoint, or the version it was refitted to
        serving, what = ((bound[1].mirror.state, f"the engine (serving version {bound[0].version})")
                         if bound else (load_checkpoint(path), f"the engine's checkpoint {path}"))
        if version is None:
            version = find_version(store, serving, what)
        mirror = StateDictTarget({})
        peers, secret = chunk_sources[2:]
        if peers and len(secret) < MIN_SECRET_BYTES:
            raise UsageError(f"peers {list(peers)[:3]} need the group's shared secret (at least "
                             f"{MIN_SECRET_BYTES} bytes), got {len(secret)} bytes")
        self._wh_sources = chunk_sources
        sources = self._wh_sources_for(store)
        Receiver(store, mirror, sources=sources).sync(version)  # fetched and verified by digest
        held = mirror.held()
        if held is None:  # pragma: no cover - sync either commits or raises
            raise UsageError(f"{store_url}: nothing to bind to")
        # placement rules first: a renamed tensor or a partial fused group is named as such
        placement = EnginePlacement(self.model_runner.model, self._wh_reload, sorted(mirror.state),
                                    xor=xor)
        check_same_bits(serving, mirror.state, what, f"version {held.version} of {store_url}")
        placement.verify(sorted(mirror.state), mirror.state)  # what it serves is that version
        target = EngineTarget(mirror, placement, store, digests_of(store, held.version))
        t0 = time.perf_counter()
        target.overwrite_all(mirror.state)
        full_s = time.perf_counter() - t0
        views, why = placement.plain_views(mirror.state) if xor else ({}, "xor=False")
        if views:  # apply in the engine's own memory; the host mirror is dropped
            target = EngineTarget(StateDictTarget(views, held), placement, store, target.digests,
                                   in_place=True)
        refused = target.prove_kernels()  # mirror: which layers' kernels a staging builds
        # manifests relayed to this host may answer a stage's plan (`weighthub_stage`)
        self._weighthub = (Receiver(RelayedManifests(store), target, sources=sources), target)
        self._wh_staged = None  # staged against the previous binding's target
        return {"version": held.version, "root": held.root, "full_reload_s": full_s,
                "in_place": target.in_place, "in_place_refused": why, "prepack_refused": refused,
                "prepacked": sorted(target.prepacker.recipes) if target.prepacker else [],
                "xor": sorted(placement.xor_names), "groups": len(set(placement.groups.values()))}

    def _wh_receiver(self, store_url: str | None) -> tuple[Receiver, EngineTarget]:
        receiver, target = self._wh_bound()
        if store_url is not None:
            store = open_store(store_url)
            receiver = Receiver(store, target, sources=self._wh_sources_for(store))
        return receiver, target

    def _wh_stage(self, version: int | None, store_url: str | None, manifest: bytes | None = None,
                  manifest_sha256: str | None = None) -> dict[str, Any]:
        self._wh_staged = None  # a failed stage leaves nothing staged
        receiver, target = self._wh_receiver(store_url)
        cpu0, use0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        staged = staged_relayed(receiver, version, manifest, manifest_sha256)
        relayed = staged is not None
        if staged is None:
            staged = receiver.stage(version)
        prepack_s = target.prestage(receiver, staged)  # the changed layers' kernels, if it can
        self._wh_staged = (store_url, receiver, staged)
        use = resource.getrusage(resource.RUSAGE_SELF)
        return {"version": staged.version, "from_version": staged.from_version,
                "route": list(staged.route), "bytes_fetched": staged.bytes_fetched,
                # the whole staging: the receiver's, then the changed layers' kernels (prepack_s)
                "stage_s": staged.stage_seconds + prepack_s, "prepack_s": prepack_s,
                # CPU of the whole worker process meanwhile (every thread: staging's and vLLM's)
                "stage_process_cpu_s": time.process_time() - cpu0,
                # of which in the kernel, and the pages first touched (fresh allocations)
                "stage_process_sys_s": use.ru_stime - use0.ru_stime,
                "stage_minor_faults": use.ru_minflt - use0.ru_minflt,
                "served": dict(receiver.sources.served),
                "relayed_manifest": relayed, "early_chunks": receiver.early_used}

    def _wh_refit(self, version: int | None, store_url: str | None) -> dict[str, Any]:
        pending, self._wh_staged = getattr(self, "_wh_staged", None), None
        receiver, target = self._wh_receiver(store_url)
        staged = None
        if pending is not None and pending[0] == store_url \
                and version in (None, pending[2].version) and pending[2].held == target.held():
            _url, receiver, staged = pending
        target.store = receiver.store  # the manifest digests come from where the version came
        target.expect(staged.arrives if staged is not None else None)
        try:
            result = receiver.apply(staged) if staged is not None else receiver.sync(version)
        finally:
            target.store = self._weighthub[0].store
            target.expect(None)
        report = target.report if result.route else PushReport()
        return {"version": result.version, "from_version": result.from_version,
                "prestaged": staged is not None,
                "route": list(result.route), "bytes_fetched": result.bytes_fetched,
                "stage_s": result.stage_seconds, "pause_s": result.pause_seconds,
                "mirror_apply_s": result.apply_seconds,
                "mirror_pause_s": result.pause_seconds, "verify_s": result.verify_seconds,
                "engine_s": report.seconds, "served": dict(receiver.sources.served),
                **report.to_dict()}

    def _wh_prepare(self, version: int | None, store_url: str | None,
                    timeout_s: float) -> dict[str, Any]:
        _receiver, target = self._wh_bound()
        if getattr(self, "_wh_vote", None) is not None:  # an earlier vote never decided
            with contextlib.suppress(WeighthubError):
                self._wh_decide(False)
        vote = Vote(timeout_s)
        target.vote = vote
        self._wh_vote = vote
        vote.start(lambda: self._wh_refit(version, store_url))
        state = vote.wait_ready()
        error = vote.error
        if state == FAILED and isinstance(error, WeighthubError):
            return {"state": state, "error": type(error).__name__, "message": str(error)}
        if state == FAILED:
            return {"state": state, "error": "ApplyError", "message": f"{type(error).__name__}: {error}"}
        return {"state": state}

    def _wh_decide(self, commit: bool) -> dict[str, Any]:
        vote, self._wh_vote = getattr(self, "_wh_vote", None), None
        if vote is None:
            raise UsageError("no refit is prepared on this worker: call weighthub_prepare first")
        try:
            return vote.decide(commit)
        finally:
            self._wh_bound()[1].vote = None

    def _wh_full_reload(self) -> dict[str, Any]:
        _receiver, target = self._wh_bound()
        # in place, the loader must not read the parameters it writes: feed a copy (untimed)
        state = ({n: t.clone() for n, t in target.mirror.state.items()} if target.in_place
                 else target.mirror.state)
        t0 = time.perf_counter()
        groups = target.overwrite_all(state)
        return {"seconds": time.perf_counter() - t0, "groups": groups}

    def _wh_sources_for(self, store: Store) -> SourceList:
        """This host's node cache (in place), its staging cache, the peers, then `store`."""
        node_cache, stage_dir, peers, secret = self._wh_sources
        sources: list[ChunkSource] = [StoreSource(store)]
        if peers:
            sources.insert(0, HolderSource(lambda _ref: peers, secret, name="node daemons"))
        if stage_dir is not None:
            sources.insert(0, StagingSource(stage_dir))
        if node_cache is not None:
            sources.insert(0, NodeCacheReader(node_cache))
        return SourceList(sources)

    def _wh_held(self) -> dict[str, Any]:
        _receiver, target = self._wh_bound()
        held = target.held()
        if held is None:  # pragma: no cover - a bound engine's mirror holds a committed version
            raise UsageError("the engine's mirror holds no committed version: bind it again")
        return {"store": held.store, "model": held.model, "version": held.version, "root": held.root}

    def _wh_audit(self) -> dict[str, Any]:
        held = self._wh_held()
        _receiver, target = self._wh_bound()
        engine, _mirror = target.canonical_digests()
        mismatched = [n for n, d in engine.items() if d != target.digests[n]]
        return held | {"checked": len(engine), "mismatched": sorted(mismatched)}

    def _wh_load_state(self, state: dict[str, torch.Tensor]) -> dict[str, Any]:
        _receiver, target = self._wh_bound()
        check_committed(state, target.mirror.state, target.digests, "the state given",
                        f"the committed version {target.held()}")
        t0 = time.perf_counter()
        groups = target.overwrite_all(state)
        return {"seconds": time.perf_counter() - t0, "groups": groups,
                "bytes": sum(t.numel() * t.element_size() for t in state.values())}

    def _wh_digests(self) -> dict[str, Any]:
        receiver, target = self._wh_bound()
        engine, mirror = target.canonical_digests()
        return {"version": receiver.version, "engine": engine, "mirror": mirror,
                "in_place": target.in_place}

    def _wh_bound(self) -> tuple[Receiver, EngineTarget]:
        state = getattr(self, "_weighthub", None)
        if state is None:
            raise UsageError("this vLLM worker is not bound to a store: call bind(llm, store_url) "
                             "after the engine has loaded the checkpoint")
        return state

    def _wh_reload(self, weights: Any) -> None:
        self.reload_weights(weights_iterator=weights)


def _rpc(call: Any) -> dict[str, Any]:
    """Run a worker method; weighthub errors come back as data (they pickle as plain dicts)."""
    try:
        result: dict[str, Any] = call()
        return result
    except WeighthubError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
