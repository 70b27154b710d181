"""Push canonical tensors into a live vLLM model through vLLM's own loader.

`EnginePlacement` knows, for one model, which canonical tensors travel together (whole fused
groups, `vllm_placement`), which engine parameters are plain copies of a canonical tensor (those
can be read back and updated by XOR mask), and which modules share a weight (tied embeddings,
whose second user's processing vLLM's layerwise reload skips). It never writes engine memory
itself: every value goes through `reload_weights(weights_iterator=...)`, so fused layouts,
tensor-parallel slicing and the CPU backend's repacking stay vLLM's.

Paths per tensor:
    in place   the engine keeps every canonical tensor as plain bits (`plain_views`: GPU builds,
               or vLLM CPU with `WEIGHTHUB_VLLM_PLAIN_CPU_WEIGHTS=1`): the receiver applies the
               delta straight into those parameters, verifies and rolls back there; the loader
               is not involved at all (`engines.vllm` then keeps no mirror)
    xor        the loader is fed the mask new ^ old; `LoaderCopies` turns its copy into the plain
               parameter into an in-place XOR (then read back and compared with the mirror)
    overwrite  the loader is fed the new canonical values of the whole group (fused or repacked
               parameters, and any xor tensor whose copy turned out not to be plain)
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import PlacementError
from ..tensors import bits
from .vllm_copies import INT_BY_WIDTH, LoaderCopies, storage_key
from .vllm_placement import Group, engine_module, expand, plan_groups

Reload = Callable[[Iterable[tuple[str, torch.Tensor]]], None]
# vLLM warns for every layer a partial reload does not touch; those are expected here
_QUIET = ("vllm.model_executor.model_loader.reload.layerwise",
          "vllm.model_executor.model_loader.reload.inplace")


@dataclass(slots=True)
class PushReport:
    """What one push did: path per canonical tensor, and where the time went."""

    paths: dict[str, str] = field(default_factory=dict)
    groups: int = 0
    seconds: float = 0.0
    refreshed: list[str] = field(default_factory=list)  # tied modules re-processed

    def to_dict(self) -> dict[str, Any]:
        return {"paths": dict(self.paths), "groups": self.groups, "seconds": self.seconds,
                "refreshed": list(self.refreshed)}


class EnginePlacement:
    """Placement of one model's canonical tensors into one live vLLM model.

    Args:
        model: the engine's nn.Module (worker.model_runner.model).
        reload: feeds (name, tensor) pairs to vLLM's `reload_weights(weights_iterator=...)`.
        names: every canonical tensor name.
        xor: use the XOR path where a parameter is a plain copy (else overwrite everywhere).

    Raises:
        PlacementError: names the engine has no module for, or fused groups with parts missing.
    """

    def __init__(self, model: torch.nn.Module, reload: Reload, names: list[str], *,
                 xor: bool = True) -> None:
        self.model = model
        self.reload = reload
        packed = getattr(model, "packed_modules_mapping", None) or {}
        self.packed: dict[str, list[str]] = dict(packed)  # the model's packed_modules_mapping
        modules = dict(model.named_modules())
        self.groups = plan_groups(names, packed, lambda m: m in modules)
        # canonical name → (module, parameter) where one engine parameter holds just that tensor;
        # looked up at each use: vLLM may re-create parameters when it processes a layer
        self._unfused = {n: (mod, param) for n in names
                         for mod, param, fused in [engine_module(n, packed)] if not fused}
        self.xor_names = {n for n, (mod, _p) in self._unfused.items()
                          if xor and _copies_only(modules[mod])}
        self.tied = _tied_users(modules)

    def _param(self, name: str) -> torch.Tensor | None:
        where = self._unfused.get(name)
        if where is None:
            return None
        p = self.model.get_submodule(where[0])._parameters.get(where[1])
        return None if p is None or p.ndim == 0 or not p.is_contiguous() else p.data

    def engine_view(self, name: str, like: torch.Tensor) -> torch.Tensor | None:
        """The engine's bits for a canonical tensor that one parameter holds as a plain copy
        (rows may be padded); None where there is no such parameter (fused, repacked, emptied)."""
        view = self._plain_param(name, like)
        return view if view is not None and view.device.type == "cpu" else None

    def plain_views(self, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
        """The engine's own bits for every canonical tensor, or ({}, why not).

        A tensor's view is its unfused parameter (rows may be padded), or its rows of a fused
        parameter (parts stacked along dim 0 in `packed_modules_mapping` order, as vLLM's
        unsharded fused layers hold them). Every view must hold exactly `state`'s bits, so a
        parameter that was repacked, converted, transposed or sharded (tensor parallel) is never
        taken for a plain one: all or nothing, the caller falls back to the loader path.
        """
        views: dict[str, torch.Tensor] = {}
        for name, like in state.items():
            group = self.groups[name]
            view = (self._fused_view(group, name, state) if group.fused
                    else self._plain_param(name, like, same_device=False))
            if view is None:
                return {}, (f"{name}: the engine does not hold it as a plain copy (repacked, "
                            "converted or sharded)")
            as_int = INT_BY_WIDTH[like.element_size()]
            if not torch.equal(view.view(as_int), like.to(view.device).view(as_int)):
                return {}, f"{name}: the engine's parameter holds other bits than the canonical"
            views[name] = view
        return views, ""

    def _plain_param(self, name: str, like: torch.Tensor, *,
                     same_device: bool = True) -> torch.Tensor | None:
        p = self._param(name)
        if p is None or p.dtype != like.dtype or p.shape[1:] != like.shape[1:] \
                or p.shape[0] < like.shape[0] or (same_device and p.device != like.device):
            return None
        return p[: like.shape[0]]

    def _fused_view(self, group: Group, name: str, state: dict[str, torch.Tensor]
                    ) -> torch.Tensor | None:
        parent, _, leaf = group.module.rpartition(".")
        prefix = f"{parent}." if parent else ""
        param = name.rpartition(".")[2]
        fused = self.packed[leaf]
        parts = [state[f"{prefix}{part}.{param}"] for part in fused]
        p = self.model.get_submodule(group.module)._parameters.get(param)
        like = state[name]
        if p is None or p.ndim == 0 or not p.is_contiguous() or p.dtype != like.dtype \
                or p.shape[0] != sum(t.shape[0] for t in parts) \
                or any(t.shape[1:] != p.shape[1:] for t in parts):
            return None
        start = 0
        for part, t in zip(fused, parts, strict=True):
            if f"{prefix}{part}.{param}" == name:
                return p.data[start:start + t.shape[0]]
            start += t.shape[0]
        return None  # pragma: no cover - name is one of its group's parts

    # -- push / restore -------------------------------------------------------------------------
    def push(self, changed: Iterable[str], state: dict[str, torch.Tensor]) -> PushReport:
        """Bring the engine's copies of `changed` (expanded to whole groups) to `state`'s values.

        Raises:
            PlacementError: the loader skipped a tensor, or a plain parameter does not read back
                as the canonical bits after apply. The engine may hold a mix: the caller restores
                (`overwrite` of the same groups from the previous state).
        """
        t0 = time.perf_counter()
        groups = expand(changed, self.groups)
        report = PushReport(groups=len(groups))
        names = [n for g in groups for n in g.names]
        masks: dict[str, torch.Tensor] = {}
        xor_keys: dict[int, str] = {}  # engine storage → canonical name, for the xor path
        for n in names:
            view = self.engine_view(n, state[n]) if n in self.xor_names else None
            if view is not None:
                masks[n] = _xor(view, state[n])
                xor_keys[storage_key(view)] = n
        feed = [(n, masks.get(n, state[n])) for n in names]
        rec = self._run(feed, set(xor_keys))
        redo = {xor_keys[k] for k in xor_keys if k in rec.irregular or k not in rec.xored}
        for n in names:
            report.paths[n] = "xor" if n in masks and n not in redo else "overwrite"
        if redo:  # not a plain copy after all: overwrite those groups (old bits do not matter)
            again = expand(redo, self.groups)
            self._run([(n, state[n]) for g in again for n in g.names], set())
        report.refreshed = self.refresh_tied(groups)
        self.verify(names, state)
        report.seconds = time.perf_counter() - t0
        return report

    def overwrite(self, groups: list[Group], state: dict[str, torch.Tensor]) -> None:
        """Reload whole groups with `state`'s values (restore after a failed push)."""
        self._run([(n, state[n]) for g in groups for n in g.names], set())
        self.refresh_tied(groups)
        self.verify([n for g in groups for n in g.names], state)

    def verify(self, names: Iterable[str], state: dict[str, torch.Tensor]) -> None:
        """Every plain engine parameter among `names` must hold exactly the canonical bits."""
        bad = []
        for n in names:
            view = self.engine_view(n, state[n])
            if view is not None and not np.array_equal(bits(view), bits(state[n])):
                bad.append(n)
        if bad:
            raise PlacementError(f"after loading, the engine's parameters for {bad[:5]} do not hold "
                                 "the canonical bits: its loader transforms them; use xor=False")

    def _run(self, feed: list[tuple[str, torch.Tensor]], xor_storages: set[int]) -> LoaderCopies:
        sources = {storage_key(t): n for n, t in feed}
        rec = LoaderCopies(sources, xor_storages)
        with _quiet(), rec, torch.no_grad():
            self.reload(iter(feed))
        skipped = sorted({n for n, _ in feed} - rec.consumed)
        if skipped:
            raise PlacementError(f"the engine's loader did not read {skipped[:5]}: it skips or "
                                 "renames them, so they would never reach the served model; "
                                 "publish the served model's checkpoint names")
        return rec

    def refresh_tied(self, groups: list[Group]) -> list[str]:
        """Re-process modules sharing a weight with an updated module (tied lm_head).

        vLLM's layerwise reload processes a shared tensor only through its first owner; the
        other user (lm_head on CPU keeps a repacked copy) would keep serving the old values.
        """
        updated = {g.module for g in groups}
        done = []
        for user, owner in self.tied:
            if owner in updated:
                module = self.model.get_submodule(user)
                method: Any = module.quant_method
                method.process_weights_after_loading(module)
                done.append(user)
        return done


def _copies_only(module: torch.nn.Module) -> bool:
    """Whether the engine uses this module's parameters exactly as loaded.

    Modules without a quant method (norms) read their weights as loaded. vLLM's plain
    embedding looks rows up in its weight; the CPU GEMM handle its processing builds is used only
    by a tied lm_head, which `refresh_tied` rebuilds from the real weight. Linear layers repack.
    """
    method = getattr(module, "quant_method", None)
    return method is None or type(module).__name__ == "VocabParallelEmbedding"


def _tied_users(modules: dict[str, torch.nn.Module]) -> list[tuple[str, str]]:
    """(user, owner) for modules with a quant method whose weight is another module's weight."""
    owner: dict[int, str] = {}
    out = []
    for name, m in modules.items():
        w = m._parameters.get("weight")
        if w is None or (key := storage_key(w)) == 0:
            continue
        if key in owner and getattr(m, "quant_method", None) is not None:
            out.append((name, owner[key]))
        owner.setdefault(key, name)
    return out


def _xor(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    as_int = INT_BY_WIDTH[new.element_size()]
    return (old.view(as_int) ^ new.view(as_int)).view(new.dtype)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in _QUIET]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
