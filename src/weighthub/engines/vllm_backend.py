"""weighthub as a vLLM weight-transfer backend: vLLM's own RL API refits the engine from a store.

Select it when starting the engine; weighthub registers the name "weighthub" in every vLLM process
through its `vllm.general_plugins` entry point (`engines.vllm_plugin`; if `VLLM_PLUGINS` is set,
it must list "weighthub")::

    llm = LLM(ckpt_dir, weight_transfer_config={"backend": "weighthub"})  # or the CLI's
                                       # --weight-transfer-config.backend weighthub
    llm.init_weight_transfer_engine({"init_info": {"store_url": url}})   # once: bind
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 5}})                   # None: the latest
    llm.finish_weight_update(weight_version="5")

init_info: `store_url`, and optionally `version` (what the engine serves; default: the store's
version whose digests are the start-up checkpoint's), `xor`, `stage_dir` (see
`WeighthubWorker.weighthub_bind`). update_info: `version` and optionally `store_url` (a replica of
the bound store). Only these small values cross vLLM's RPCs: each worker pulls the chunks itself.

Each `update_weights` is a whole weighthub refit (`WeighthubWorker.weighthub_refit`): the version
is fetched, applied and verified by digest, in the engine's own parameters where it keeps them
plain (see `engines.vllm_plugin`), else into the worker's canonical mirror, whose changed groups
then go through vLLM's layerwise reload and are read back. All or nothing:
if it fails, the engine keeps serving its previous version and the error names it. So
`start_weight_update` only checks the binding and `finish_weight_update` has nothing to flush;
after a failed update vLLM ends the session itself (call `start_weight_update` again, not
`finish_weight_update`). Pause generation between start and finish with AsyncLLM or HTTP.

Errors reach the driver as vLLM's `Exception("Call to update_weights method failed: ...")`, so
the messages start with "weighthub", and a failed update's names the weighthub error class.
Limitations: the ranks of a tensor-parallel engine commit independently (one `update_weights`
RPC leaves no room for the commit vote `engines.vllm.refit` runs); no draft-model updates; the
encoder and multimodal caches are not reset (`reload_weights` does it; text models have none),
nor is the prefix cache (KV blocks of the previous version): pause generation with
`clear_cache=True`, or call `llm.reset_prefix_cache()` after `finish_weight_update`
(`engines.vllm.refit` does it itself).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .. import errors
from ..errors import ApplyError, UsageError, WeighthubError

if TYPE_CHECKING:  # imported when vLLM creates the engine, not at plugin load: see `register_backend`
    from .vllm import WeighthubWorker

BACKEND = "weighthub"
_log = logging.getLogger(__name__)


@dataclass
class WeighthubInitInfo(WeightTransferInitInfo):
    """`init_weight_transfer_engine({"init_info": {...}})`: the store to bind to."""

    store_url: str
    version: int | None = None
    xor: bool = True
    stage_dir: str | None = None


@dataclass
class WeighthubUpdateInfo(WeightTransferUpdateInfo):
    """`update_weights({"update_info": {...}})`: the version to bring the engine to."""

    version: int | None = None
    store_url: str | None = None


def _model_worker(model: torch.nn.Module, vllm_config: Any) -> WeighthubWorker:
    """WeighthubWorker's machinery on the bare model a weight-transfer engine holds: a worker
    whose `reload_weights` is vLLM's layerwise reload of `model`, as the model runner's does it."""
    from .vllm import WeighthubWorker

    worker = WeighthubWorker()
    worker.model_runner = SimpleNamespace(model=model)
    worker.vllm_config = vllm_config
    setattr(worker, "reload_weights", functools.partial(_layerwise_reload, model, vllm_config))  # noqa: B010
    return worker


def _layerwise_reload(model: torch.nn.Module, vllm_config: Any, *,
                      weights_iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    with set_current_vllm_config(vllm_config):
        initialize_layerwise_reload(model)
        model.load_weights(weights_iterator)  # type: ignore[operator]
        finalize_layerwise_reload(model, vllm_config.model_config)


def _call(method: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """A `weighthub_*` worker method; the error it returns as data is raised again as its class."""
    result = method(*args)
    if "error" in result:
        cls = getattr(errors, result["error"], WeighthubError)
        if not (isinstance(cls, type) and issubclass(cls, WeighthubError)):
            cls = WeighthubError
        raise cls(result["message"])
    return result


class WeighthubWeightTransferEngine(WeightTransferEngine[WeighthubInitInfo, WeighthubUpdateInfo]):
    """The engine vLLM creates in each worker (after `load_model`) for backend "weighthub"."""

    init_info_cls = WeighthubInitInfo
    update_info_cls = WeighthubUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._worker = _model_worker(model, vllm_config)  # keeps its mirror across re-inits
        self._init: WeighthubInitInfo | None = None
        self.last_update: dict[str, Any] | None = None  # the last refit's result (timings, paths)

    # -- info parsing: weighthub errors that name the accepted fields -----------------------------
    def parse_init_info(self, init_dict: dict[str, Any]) -> WeighthubInitInfo:
        info = _parse(WeighthubInitInfo, init_dict, "init_info")
        if not isinstance(info.store_url, str) or not info.store_url:
            raise UsageError(f"weighthub init_info: store_url must be a store URL, got "
                             f"{info.store_url!r}")
        _check_version(info.version, "init_info")
        return info

    def parse_update_info(self, update_dict: dict[str, Any]) -> WeighthubUpdateInfo:
        info = _parse(WeighthubUpdateInfo, update_dict, "update_info")
        _check_version(info.version, "update_info")
        return info

    # -- lifecycle ------------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: WeighthubInitInfo) -> None:
        """Bind to the store (`weighthub_bind`): the engine must serve that version's bits.
        If it fails, an earlier binding stays."""
        bound = _call(self._worker.weighthub_bind, init_info.store_url, init_info.version, init_info.xor,
                      init_info.stage_dir)
        self._init = init_info
        _log.info("weighthub: bound to version %s of %s", bound["version"], init_info.store_url)

    def start_weight_update(self) -> None:
        self._bound()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """As the base class, without its unconditional `torch.accelerator.synchronize()`
        (it raises on a CPU-only torch): sync only where there is an accelerator."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.current_accelerator() is not None:
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: WeighthubUpdateInfo) -> None:
        """Refit to `update_info.version`, all or nothing (`weighthub_refit`)."""
        init = self._bound()
        held = self.held_version()
        url = update_info.store_url or init.store_url
        want = "the latest version" if update_info.version is None else f"version {update_info.version}"
        try:
            self.last_update = _call(self._worker.weighthub_refit, update_info.version,
                                     update_info.store_url)
        except WeighthubError as exc:
            kept = ("the engine may serve mixed weights" if isinstance(exc, ApplyError)
                    else f"the engine still serves version {held}")
            raise type(exc)(f"weighthub update to {want} of {url} failed ({type(exc).__name__}), "
                            f"{kept}: {exc}") from exc
        _log.info("weighthub: version %s -> %s (%.1f ms paused)", self.last_update["from_version"],
                  self.last_update["version"], self.last_update["pause_s"] * 1e3)

    def finish_weight_update(self) -> None:
        self._bound()  # each update was committed whole: nothing left to apply

    def shutdown(self) -> None:
        """Forget the store; the engine keeps serving what it holds (re-init binds again)."""
        self._init = None

    # -- reads ----------------------------------------------------------------------------------
    def held_version(self) -> int:
        """The version the engine serves (what the last commit recorded)."""
        self._bound()
        version: int = _call(self._worker.weighthub_held)["version"]
        return version

    def digests(self) -> dict[str, Any]:
        """`weighthub_digests`: per-tensor digests, read back from the engine where its parameter
        is a plain copy ("engine"), else from the verified mirror ("mirror")."""
        self._bound()
        return _call(self._worker.weighthub_digests)

    def _bound(self) -> WeighthubInitInfo:
        if self._init is None:
            raise UsageError("weighthub backend: not bound to a store: call "
                             "llm.init_weight_transfer_engine({'init_info': {'store_url': ...}}) first")
        return self._init


def digests(worker: Any) -> dict[str, Any]:
    """For `llm.collective_rpc(digests)`: this worker's `WeighthubWeightTransferEngine.digests()`
    (needs VLLM_ALLOW_INSECURE_SERIALIZATION=1, as any callable sent to collective_rpc)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    if not isinstance(engine, WeighthubWeightTransferEngine):
        raise UsageError(f"this vLLM worker's weight-transfer engine is {type(engine).__name__}, not "
                         f"weighthub's: start it with weight_transfer_config={{'backend': '{BACKEND}'}}")
    return engine.digests()


def register_backend() -> None:
    """Register backend "weighthub" with vLLM's WeightTransferEngineFactory (idempotent).

    The `vllm.general_plugins` entry point (`vllm_plugin.register`) calls it in every vLLM
    process, before the workers load the model; so importing this module must stay light:
    weighthub's machinery (its numba digest kernels) is imported only when vLLM creates the
    engine. Loaded earlier, llvmlite sits
    in sys.modules when vLLM's CPU worker scans every module to rebind its Triton kernel
    overrides, and that scan fails on llvmlite's function wrappers (vLLM 0.32)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # "already registered": by an earlier call
        WeightTransferEngineFactory.register_engine(BACKEND, WeighthubWeightTransferEngine)


def _parse(cls: Any, given: Any, what: str) -> Any:
    names = [f.name for f in fields(cls)]
    if not isinstance(given, dict):
        raise UsageError(f"weighthub {what} must be a dict with keys {names}, got {type(given).__name__}")
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise UsageError(f"weighthub {what}: unknown keys {unknown}; it takes {names}")
    try:
        return cls(**given)
    except TypeError as exc:  # a required key is missing
        raise UsageError(f"weighthub {what} {given}: {exc}; it takes {names}") from exc


def _check_version(version: Any, what: str) -> None:
    if version is not None and (not isinstance(version, int) or isinstance(version, bool)
                                or version < 0):
        raise UsageError(f"weighthub {what}: version must be a non-negative int or None, "
                         f"got {version!r}")
