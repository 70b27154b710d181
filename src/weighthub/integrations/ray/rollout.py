"""The rollout side: a vLLM engine in a Ray actor, attached to a sync group.

`RolloutEngine` is a mixin for a user's rollout actor that owns a `vllm.LLM` in `self.llm`,
started with `worker_extension_cls=weighthub.engines.vllm.EXTENSION`. Its methods (all Ray actor
methods) bind the engine to the group, stage a version in a background thread while the actor
keeps generating, refit (the only pause), attest and audit.

Staging overlaps generation only with an in-process engine core
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, which `VLLMRollout` sets): the staging thread then calls the
worker directly while `generate` runs on the actor's thread. With a multiprocess core the RPC
queues behind the engine's steps (correct, but no overlap).

`VLLMRollout` is a ready-made rollout actor: token-id prompts in, sampled token ids and their
log-probabilities out, each batch attested.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from ...engines.vllm import EXTENSION, bind, decode_early, refit, stage
from ...engines.vllm_plugin import keep_cpu_weights_plain
from ...errors import AttestationError, UsageError, WeighthubError
from .attest import Attestation
from .pauses import pause_turn
from .spec import SyncSpec

STAGE_WAIT_S = 120.0  # longest a stage waits for this node's daemon to serve the version
_LOCKS = threading.Lock()


class RolloutEngine:
    """Mixin: weighthub methods for a Ray actor owning a vLLM engine in `self.llm`.

    Create the actor with `max_concurrency=2` (or more) and generate inside
    `with self._wh_serving():` (VLLMRollout does): a refit then stages on its own thread while
    the engine generates, and waits for the generation to end only to apply.

    Set `weighthub_pause_in_turn = True` where the engines of a node share its cores (weights
    in host memory): their pauses then take turns (`pauses`), each waiting while it serves.
    """

    llm: Any
    weighthub_pause_in_turn: bool = False
    _wh_spec: SyncSpec | None = None
    _wh_node_id: str = ""
    _wh_thread: threading.Thread | None = None
    _wh_staged: dict[str, Any] | None = None
    _wh_stage_error: BaseException | None = None

    def weighthub_attach(self, spec: SyncSpec, version: int | None = None) -> dict[str, Any]:
        """Bind the engine (serving `version`, default found by digest) to the group's store;
        chunks come from this Ray node daemon's relay cache (read in place), its staging cache,
        the daemon itself, then the store."""
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        node = spec.node(node_id)
        with self._wh_lock("_wh_refit_lock"), self._wh_serving():
            bound = bind(self.llm, spec.store_url, version, stage_dir=node.stage_dir,
                         node_cache=node.cache_dir or None, peers=(node.address,),
                         secret=spec.secret)
            self._wh_spec, self._wh_node_id = spec, node_id
        return bound | {"node": node_id, "daemon": node.address}

    def weighthub_stage(self, version: int, *, wait_node: bool = True, early: bool = False) -> None:
        """Start staging `version` on a thread of its own and return at once (generate
        meanwhile); the next `weighthub_refit` of that version applies it. `early`: `version`
        is not published yet; decode its chunks as they are pushed to this node meanwhile."""
        spec = self._wh_bound()
        with self._wh_lock("_wh_refit_lock"):
            self._wh_join()  # one staging at a time; a failed one is forgotten here

            def run() -> None:
                try:
                    self._wh_staged = self._wh_stage_now(spec, version, wait_node, early)
                except BaseException as exc:  # reported by weighthub_refit
                    self._wh_stage_error = exc

            self._wh_thread = threading.Thread(target=run, name="weighthub-stage", daemon=True)
            self._wh_thread.start()

    def weighthub_refit(self, version: int | None = None, *, wait_node: bool = True) -> dict[str, Any]:
        """Bring the engine to `version` (default: the staged one, else the latest).

        Stages first unless `weighthub_stage` already staged that version — without pausing
        the engine: a generation in flight keeps running — then waits for it to end and
        pauses only to apply, verify and commit. All or nothing. A staging that failed (a dead
        daemon, a chunk that did not verify) is reported in `stage_error`; the apply then
        stages inline from the remaining sources. `wait_node`: as for staging, wait until this
        node's daemon holds the version first, so this host fetches each chunk once."""
        spec = self._wh_bound()
        with self._wh_lock("_wh_refit_lock"):
            t0 = time.perf_counter()
            self._wh_join()
            staged, error = self._wh_staged, self._wh_stage_error
            self._wh_staged, self._wh_stage_error = None, None
            if version is None and staged is not None:
                version = int(staged["version"])
            if staged is None or staged["version"] != version:
                try:
                    staged = self._wh_stage_now(spec, version, wait_node)
                except Exception as exc:  # the apply stages inline; said in the result
                    staged, error = None, exc
            t1 = time.perf_counter()
            stage_dir = spec.node(self._wh_node_id).stage_dir if self.weighthub_pause_in_turn else None
            # this host's turn first, still serving; then wait for a generation in flight to end
            with pause_turn(stage_dir) as turn, self._wh_serving():
                t2 = time.perf_counter()
                result = refit(self.llm, version)
        return result | {"staging_wait_s": t1 - t0, "turn_wait_s": turn.wait_s,
                         "in_turn": turn.held, "serve_wait_s": t2 - t1 - turn.wait_s,
                         "staged": staged, "stage_error": None if error is None else repr(error)}

    def _wh_stage_now(self, spec: SyncSpec, version: int | None, wait_node: bool,
                      early: bool = False) -> dict[str, Any]:
        t0 = time.perf_counter()
        served: dict[str, Any] = {}
        if wait_node and version is not None:
            import ray
            # while the daemon waits for the version, decode its chunks as they are pushed here
            # (staging takes them once the commit vouches for them); a failure to start is no
            # failure of the staging, which decodes them itself
            if early:
                with contextlib.suppress(WeighthubError):
                    decode_early(self.llm, version)
            daemon = ray.get_actor(f"{spec.name}-node-{self._wh_node_id[:16]}")
            # the daemon's chunks as soon as they were pushed to it whole, or once it holds
            # the version: not after its own apply into its host copy
            served = dict(ray.get(daemon.wait_available.remote(version, STAGE_WAIT_S),
                                  timeout=STAGE_WAIT_S + 10))
        t1 = time.perf_counter()
        # planned from the manifest the daemon was relayed (the hub's digest vouches for it):
        # no listing or manifest read from the store, which may be across the slow link
        staged = stage(self.llm, version, manifest=served.get("manifest"),
                       manifest_sha256=served.get("manifest_sha256"))
        return dict(staged) | {"node_wait_s": t1 - t0,
                               "node_relayed": bool(served.get("relayed"))}

    @contextlib.contextmanager
    def _wh_serving(self) -> Iterator[None]:
        """Held while the engine generates or applies: a refit never changes weights mid-batch."""
        with self._wh_lock("_wh_serve_lock"):
            yield

    def _wh_lock(self, name: str) -> threading.Lock:
        with _LOCKS:  # created on first use: the mixin has no __init__ of its own
            lock = self.__dict__.get(name)
            if lock is None:
                lock = self.__dict__[name] = threading.Lock()
        return lock

    def weighthub_attestation(self) -> Attestation:
        """The committed policy this engine serves now."""
        held = self.llm.collective_rpc("weighthub_held")[0]
        if "error" in held:
            raise UsageError(f"this engine cannot attest: {held['message']}")
        return Attestation(engine=self._wh_name(), store=held["store"], model=held["model"],
                           version=int(held["version"]), root=str(held["root"]))

    def weighthub_audit(self) -> dict[str, Any]:
        """Read back the engine's plain-copy parameters and digest them against the committed
        version (see `WeighthubWorker.weighthub_audit`)."""
        return dict(self.llm.collective_rpc("weighthub_audit")[0])

    def weighthub_digests(self) -> dict[str, Any]:
        """Per-tensor digests of what the engine serves (`WeighthubWorker.weighthub_digests`)."""
        return dict(self.llm.collective_rpc("weighthub_digests")[0])

    def weighthub_load_state(self, state: Any) -> dict[str, Any]:
        """The baseline route: a full state (or an ObjectRef to one) through vLLM's loader."""
        import ray

        t0 = time.perf_counter()
        if isinstance(state, ray.ObjectRef):
            state = ray.get(state)
        got = time.perf_counter() - t0
        result = dict(self.llm.collective_rpc("weighthub_load_state", args=(state,))[0])
        if "error" in result:
            raise UsageError(f"baseline load refused: {result['message']}")
        return result | {"get_s": got}

    def _wh_join(self) -> None:
        thread = self._wh_thread
        if thread is not None:
            thread.join()
            self._wh_thread = None

    def _wh_bound(self) -> SyncSpec:
        if self._wh_spec is None:
            raise UsageError("this rollout engine is not attached: call sync.attach_engine(actor)")
        return self._wh_spec

    def _wh_name(self) -> str:
        return f"{getattr(self, 'name', 'engine')}@{getattr(self, '_wh_node_id', '?')[:8]}"


class VLLMRollout(RolloutEngine):
    """A rollout actor: one in-process vLLM engine (CPU or GPU build) on a checkpoint directory.

    Args:
        name: how it is named in attestations and reports.
        checkpoint: the directory the engine starts from (a published version's bits).
        sync: attach to this group at start-up, serving `version` (the checkpoint's), then
            refit to the newest version: an actor that Ray restarts (`max_restarts`) comes back
            attached and current, with nothing for the driver to do.
        plain_cpu_weights: on vLLM CPU, keep linear weights as loaded instead of packing them
            for oneDNN (`engines.vllm_plugin`): refits then apply in place in the engine's
            memory, and generation uses torch's CPU GEMM. GPU builds keep them plain anyway.
        pause_in_turn: the engines of a node pause one at a time (`pauses`); default: on
            vLLM's CPU build (engines share the host's cores), off on GPUs.
        engine_args: more `vllm.LLM` keyword arguments (max_model_len, dtype, ...).
    vLLM logs at WARNING in this actor unless `VLLM_LOGGING_LEVEL` says otherwise (its INFO
    lines, several per request, would bury the run's own output); with `skip_tokenizer_init`
    its warnings that only say there is no tokenizer are dropped.
    """

    def __init__(self, name: str, checkpoint: str, *, sync: SyncSpec | None = None,
                 version: int | None = None, plain_cpu_weights: bool = False,
                 pause_in_turn: bool | None = None, **engine_args: Any) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # staging overlaps generate
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # a step's INFO lines drown the run's
        from vllm import LLM
        from vllm.platforms import current_platform

        if plain_cpu_weights:  # in-process engine: this process loads the model
            keep_cpu_weights_plain()
        self.name = name
        self.weighthub_pause_in_turn = (current_platform.is_cpu() if pause_in_turn is None
                                        else pause_in_turn)
        if engine_args.get("skip_tokenizer_init"):
            _quiet_tokenizerless()
        with _vllm_scan_safe():
            self.llm = LLM(checkpoint, worker_extension_cls=EXTENSION, **engine_args)
        if sync is not None:
            self.weighthub_attach(sync, version)
            self.weighthub_refit(None)

    def generate(self, prompts: Sequence[Sequence[int]], *, samples: int, max_tokens: int,
                 temperature: float = 1.0, seed: int = 0, ignore_eos: bool = False) -> dict[str, Any]:
        """`samples` completions per token-id prompt, with the sampled tokens' log-probabilities
        and the attestation of the policy that generated them (the same before and after).
        `ignore_eos`: every completion runs to `max_tokens` (a throughput probe: the same work
        whatever the policy answers)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(n=samples, temperature=temperature, max_tokens=max_tokens,
                                logprobs=0, seed=seed, detokenize=False, ignore_eos=ignore_eos)
        with self._wh_serving():
            before = self.weighthub_attestation()
            t0 = time.perf_counter()
            out = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                    params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            after = self.weighthub_attestation()
        if after != before:
            raise AttestationError(f"engine {self.name}: its policy changed during generation "
                                   f"({before.version} -> {after.version}): batch discarded")
        completions = [[list(c.token_ids) for c in o.outputs] for o in out]
        logprobs = [[[step[t].logprob for step, t in zip(c.logprobs, c.token_ids, strict=True)]
                     for c in o.outputs] for o in out]
        tokens = sum(len(c) for group in completions for c in group)
        return {"completions": completions, "logprobs": logprobs, "attestation": after,
                "seconds": seconds, "tokens": tokens}

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


@contextlib.contextmanager
def _vllm_scan_safe() -> Iterator[None]:
    """Hide, while an in-process vLLM engine starts, module globals that break its scan.

    vLLM 0.32's CPU worker rebinds Triton kernels by walking every loaded module's globals and
    calling `vars(value).get(...)` on each; llvmlite's `ffi.lib` (loaded with numba, which
    weighthub's kernels use) answers `__dict__` through its `__getattr__` with an object that
    has no `.get`, and the engine dies at start-up. A separate engine process never has numba
    loaded at that point; an in-process one does. Nothing else runs meanwhile in this process
    (the actor is being constructed), so the globals are simply put back afterwards.
    """
    hidden: list[tuple[dict[str, Any], str, Any]] = []
    # probing every global (this scan and vLLM's own) trips deprecation warnings of modules that
    # have nothing to do with the engine (torch.distributed.reduce_op, ...)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        _hide_breaking_globals(hidden)
        try:
            yield
        finally:
            for namespace, name, value in hidden:
                namespace[name] = value


def _hide_breaking_globals(hidden: list[tuple[dict[str, Any], str, Any]]) -> None:
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            try:
                breaks = hasattr(value, "__dict__") and not hasattr(vars(value), "get")
            except TypeError:
                continue
            if breaks:
                hidden.append((namespace, name, value))
                del namespace[name]


class _DropTokenizerless(logging.Filter):
    """Drops vLLM's start-up warnings that only say the engine has no tokenizer."""

    NOISE = ("Chat template warmup failed", "Using None for EOS token id")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.NOISE)


def _quiet_tokenizerless() -> None:
    """With `skip_tokenizer_init` (token-id prompts), vLLM 0.32's start-up still warms up a chat
    template and logs the failure as a warning with a traceback, then warns that EOS is None at
    the first request: expected without a tokenizer, and alarming in an RL run's output. The
    filter stays on that logger (the EOS warning comes later); its other records pass."""
    logging.getLogger("vllm.renderers.base").addFilter(_DropTokenizerless())
