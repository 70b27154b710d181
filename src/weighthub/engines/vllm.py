"""vLLM as a weighthub receiver: a worker extension driven through `collective_rpc`.

Start the engine the way a user would, from the trainer's checkpoint directory, with
`worker_extension_cls="weighthub.engines.vllm.WeighthubWorker"`; then, from the driver::

    bind(llm, "/stores/policy")        # adopt the store's version whose bits the engine loaded
    refit(llm)                         # latest version: fetch, stage, apply, verify, commit

or in two steps, so that the refit pauses the engine only to apply, verify and commit::

    stage(llm)                         # latest version: fetch, check, decode; weights untouched
    refit(llm)                         # applies what was staged

Each worker keeps a canonical mirror of the checkpoint (a StateDictTarget) that the Receiver
brings to the version bit-exactly and verifies by digest. `_EngineTarget` wraps that mirror: at
commit it pushes the tensors whose digests changed, expanded to whole fused groups, through vLLM's
own loader (`vllm_engine.EnginePlacement`). If the push fails the Receiver rolls the mirror back
and `abort` reloads the touched groups from it, so the engine keeps serving its previous version.

Only small values cross the RPC boundary (a store URL, a version, a dict of results); errors come
back as {"error": class name, "message": ...} and `bind`/`stage`/`refit` re-raise them as the same
weighthub error class on the driver.

Limitations: ranks of a tensor-parallel group commit independently (no prepare/commit vote
yet); `stage` is itself an RPC that runs on the worker's thread, so the engine does not step
while it runs either: it moves the fetch out of the refit (schedule it between generate calls,
e.g. while the trainer is still busy), it does not overlap it with generation; a refit without
a staged version stages inline (`stage_s` vs `pause_s` in the result); the mirror costs one host copy of the
canonical model per worker; an exception raised inside vLLM's own layerwise reload may leave
vLLM's reload bookkeeping half done, which the restore path has not been tested against (the
restore is tested with a loader that fails between tensors).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import catalog, errors
from ..digest import digest_bits
from ..errors import BaseMismatch, UsageError, WeighthubError
from ..receive import Receiver, Staged
from ..sources.staging import host_sources
from ..store import Store, open_store
from ..targets.base import Held, TargetWrapper
from ..targets.safetensors_file import load_checkpoint
from ..targets.state_dict import StateDictTarget
from ..targets.vllm_engine import EnginePlacement, PushReport
from ..targets.vllm_placement import Group, expand
from ..tensors import bits

EXTENSION = "weighthub.engines.vllm.WeighthubWorker"


class _EngineTarget(TargetWrapper):
    """The mirror as the Receiver's target; commit pushes into the engine, abort restores it.
    Reads (held, specs, peek) and open are the mirror's (TargetWrapper)."""

    def __init__(self, mirror: StateDictTarget, placement: EnginePlacement, store: Store,
                 digests: dict[str, str]) -> None:
        super().__init__(mirror)
        self.mirror = mirror  # typed: the engine pushes from its `state`
        self.placement = placement
        self.store = store
        self.digests = digests  # per-tensor digests of the committed version (from its manifest)
        self.report = PushReport()
        self._pushed: list[Group] = []

    def commit(self, held: Held) -> None:
        new = _digests_of(self.store, held.version)
        changed = [n for n, d in new.items() if self.digests.get(n) != d]
        self._pushed = expand(changed, self.placement.groups)  # before pushing: abort restores
        self.report = self.placement.push(changed, self.mirror.state)
        self.mirror.commit(held)
        self.digests = new
        self._pushed = []

    def abort(self) -> None:
        self.mirror.abort()
        groups, self._pushed = self._pushed, []
        if not groups:
            return
        try:  # the mirror already holds the previous version's bits again
            self.placement.overwrite(groups, self.mirror.state)
        except Exception as exc:
            raise errors.ApplyError(
                f"restoring {len(groups)} group(s) of the engine to the previous version failed "
                f"({type(exc).__name__}: {exc}); the engine may serve mixed weights: restart it"
            ) from exc


class WeighthubWorker:
    """Mixed into vLLM's worker class (`worker_extension_cls`); methods run on every worker.

    State lives in `self._weighthub` (set by `weighthub_bind`). Helpers are prefixed `_wh_`:
    vLLM refuses an extension with a name its worker class already has.
    """

    _weighthub: tuple[Receiver, _EngineTarget]
    _wh_staged: tuple[str | None, Receiver, Staged] | None  # (store_url asked for, by, staged)
    _wh_stage_dir: str | None  # the host staging cache given to bind (None: none)

    # vLLM's Worker provides these; declared for the type checker only
    model_runner: Any
    vllm_config: Any

    if TYPE_CHECKING:
        def reload_weights(self, *, weights_iterator: Any) -> None: ...

    def weighthub_bind(self, store_url: str, version: int | None = None, xor: bool = True,
                       stage_dir: str | None = None) -> dict[str, Any]:
        """Adopt `version` of the store as what the engine serves.

        The engine must serve exactly that version's bits: at first bind, the safetensors
        checkpoint it was started from (default version: the newest whose manifest digests are
        the checkpoint's); when rebinding, the version it was refitted to.
        A full reload of every tensor through vLLM's loader follows, which proves the loader
        reads every canonical tensor (and times a full reload for comparison); it writes the
        bits the engine already holds. `stage_dir`: a host staging cache shared by the workers
        on this host (`sources.staging`), so each chunk is fetched from the store once per host.
        """
        return _rpc(lambda: self._wh_bind(store_url, version, xor, stage_dir))

    def weighthub_stage(self, version: int | None = None,
                        store_url: str | None = None) -> dict[str, Any]:
        """Fetch, check and decode `version` (default: latest) against what the engine holds,
        leaving its weights untouched; kept for the next `weighthub_refit` (replaces any
        version staged before). `store_url`: as for `weighthub_refit`."""
        return _rpc(lambda: self._wh_stage(version, store_url))

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

    def weighthub_full_reload(self) -> dict[str, Any]:
        """Reload every tensor from the mirror through vLLM's loader (the baseline to beat)."""
        return _rpc(lambda: self._wh_full_reload())

    def weighthub_digests(self) -> dict[str, Any]:
        """Digests of the canonical view: read back from the engine where its parameter is a
        plain copy, else from the mirror (marked by source)."""
        return _rpc(lambda: self._wh_digests())

    # -- implementation -------------------------------------------------------------------------
    def _wh_bind(self, store_url: str, version: int | None, xor: bool,
                 stage_dir: str | None) -> dict[str, Any]:
        store = open_store(store_url)
        bound = getattr(self, "_weighthub", None)
        path = self.vllm_config.model_config.model
        # what the engine serves: its start-up checkpoint, or the version it was refitted to
        serving, what = ((bound[1].mirror.state, f"the engine (serving version {bound[0].version})")
                         if bound else (load_checkpoint(path), f"the engine's checkpoint {path}"))
        if version is None:
            version = _find_version(store, serving, what)
        mirror = StateDictTarget({})
        self._wh_stage_dir = stage_dir
        sources = host_sources(store, stage_dir)
        Receiver(store, mirror, sources=sources).sync(version)  # fetched and verified by digest
        held = mirror.held()
        if held is None:  # pragma: no cover - sync either commits or raises
            raise UsageError(f"{store_url}: nothing to bind to")
        # placement rules first: a renamed tensor or a partial fused group is named as such
        placement = EnginePlacement(self.model_runner.model, self._wh_reload, sorted(mirror.state),
                                    xor=xor)
        _check_same_bits(serving, mirror.state, what, f"version {held.version} of {store_url}")
        placement.verify(sorted(mirror.state), mirror.state)  # what it serves is that version
        t0 = time.perf_counter()
        placement.overwrite(sorted(set(placement.groups.values()), key=lambda g: g.module),
                            mirror.state)
        full_s = time.perf_counter() - t0
        target = _EngineTarget(mirror, placement, store, _digests_of(store, held.version))
        self._weighthub = (Receiver(store, target, sources=sources), target)
        self._wh_staged = None  # staged against the previous binding's target
        return {"version": held.version, "root": held.root, "full_reload_s": full_s,
                "xor": sorted(placement.xor_names), "groups": len(set(placement.groups.values()))}

    def _wh_receiver(self, store_url: str | None) -> tuple[Receiver, _EngineTarget]:
        receiver, target = self._wh_bound()
        if store_url is not None:
            store = open_store(store_url)
            receiver = Receiver(store, target, sources=host_sources(store, self._wh_stage_dir))
        return receiver, target

    def _wh_stage(self, version: int | None, store_url: str | None) -> dict[str, Any]:
        self._wh_staged = None  # a failed stage leaves nothing staged
        receiver, _target = self._wh_receiver(store_url)
        staged = receiver.stage(version)
        self._wh_staged = (store_url, receiver, staged)
        return {"version": staged.version, "from_version": staged.from_version,
                "route": list(staged.route), "bytes_fetched": staged.bytes_fetched,
                "stage_s": staged.stage_seconds}

    def _wh_refit(self, version: int | None, store_url: str | None) -> dict[str, Any]:
        pending, self._wh_staged = getattr(self, "_wh_staged", None), None
        receiver, target = self._wh_receiver(store_url)
        staged = None
        if pending is not None and pending[0] == store_url \
                and version in (None, pending[2].version) and pending[2].held == target.held():
            _url, receiver, staged = pending
        target.store = receiver.store  # the manifest digests come from where the version came
        try:
            result = receiver.apply(staged) if staged is not None else receiver.sync(version)
        finally:
            target.store = self._weighthub[0].store
        report = target.report if result.route else PushReport()
        return {"version": result.version, "from_version": result.from_version,
                "prestaged": staged is not None,
                "route": list(result.route), "bytes_fetched": result.bytes_fetched,
                "stage_s": result.stage_seconds, "pause_s": result.pause_seconds,
                "mirror_apply_s": result.apply_seconds,
                "mirror_pause_s": result.pause_seconds,
                "engine_s": report.seconds, **report.to_dict()}

    def _wh_full_reload(self) -> dict[str, Any]:
        _receiver, target = self._wh_bound()
        groups = sorted(set(target.placement.groups.values()), key=lambda g: g.module)
        t0 = time.perf_counter()
        target.placement.overwrite(groups, target.mirror.state)
        return {"seconds": time.perf_counter() - t0, "groups": len(groups)}

    def _wh_digests(self) -> dict[str, Any]:
        receiver, target = self._wh_bound()
        out: dict[str, Any] = {"version": receiver.version, "engine": {}, "mirror": {}}
        for name, t in target.mirror.state.items():
            view = target.placement.engine_view(name, t)
            if view is not None:
                out["engine"][name] = digest_bits(bits(view)).hex()
            else:
                out["mirror"][name] = digest_bits(bits(t)).hex()
        return out

    def _wh_bound(self) -> tuple[Receiver, _EngineTarget]:
        state = getattr(self, "_weighthub", None)
        if state is None:
            raise UsageError("this vLLM worker is not bound to a store: call bind(llm, store_url) "
                             "after the engine has loaded the checkpoint")
        return state

    def _wh_reload(self, weights: Any) -> None:
        self.reload_weights(weights_iterator=weights)


def bind(llm: Any, store_url: str, version: int | None = None, *, xor: bool = True,
         stage_dir: str | None = None) -> dict[str, Any]:
    """Bind every worker of `llm` (a vllm.LLM) to a store; returns rank 0's result.

    Raises:
        The weighthub error a worker raised (BaseMismatch, PlacementError, ...).
    """
    return _gather(llm.collective_rpc("weighthub_bind", args=(store_url, version, xor, stage_dir)))


def stage(llm: Any, version: int | None = None, *, store_url: str | None = None) -> dict[str, Any]:
    """Fetch, check and decode `version` (default: latest) on every worker of `llm`, weights
    untouched, for the next `refit`; returns rank 0's result (`stage_s`, `bytes_fetched`)."""
    return _gather(llm.collective_rpc("weighthub_stage", args=(version, store_url)))


def refit(llm: Any, version: int | None = None, *, store_url: str | None = None) -> dict[str, Any]:
    """Bring every worker of `llm` to `version` (default: latest; or the staged version, if
    `stage` staged one); returns rank 0's result (`stage_s`, `pause_s`, `prestaged`, ...)."""
    return _gather(llm.collective_rpc("weighthub_refit", args=(version, store_url)))


def _gather(results: list[dict[str, Any]]) -> dict[str, Any]:
    for r in results:
        if "error" in r:
            cls = getattr(errors, r["error"], WeighthubError)
            if not (isinstance(cls, type) and issubclass(cls, WeighthubError)):
                cls = WeighthubError
            raise cls(r["message"])
    return results[0]


def _rpc(call: Any) -> dict[str, Any]:
    """Run a worker method; weighthub errors come back as data (they pickle as plain dicts)."""
    try:
        result: dict[str, Any] = call()
        return result
    except WeighthubError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}


def _find_version(store: Store, state: dict[str, torch.Tensor], what: str) -> int:
    """The newest committed version whose per-tensor digests are those of `state`."""
    digests = {n: digest_bits(bits(t)).hex() for n, t in state.items()}
    versions = catalog.list_versions(store)
    for v in reversed(versions):
        if _digests_of(store, v) == digests:
            return v
    raise BaseMismatch(f"{what} is none of the {len(versions)} version(s) in {store.url}: no "
                       "manifest has its digests; start the engine from a published checkpoint")


def _digests_of(store: Store, version: int) -> dict[str, str]:
    return {e.name: e.digest for e in catalog.primary_manifest(store, version).tensors}


def _check_same_bits(have: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str,
                     version: str) -> None:
    differ = sorted(n for n in set(have) & set(want) if have[n].shape != want[n].shape
                    or have[n].dtype != want[n].dtype or not np.array_equal(bits(have[n]), bits(want[n])))
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    if differ or missing or extra:
        raise BaseMismatch(f"{what} is not {version}: differs in {differ[:5]}, lacks {missing[:5]}, "
                           f"has extra {extra[:5]}; start the engine from that version's checkpoint "
                           "or bind to the version it was started from")
