"""vLLM CPU's packed linear kernels for a staged version, built beside the serving ones, so that
the pause swaps them in instead of running vLLM's loader.

vLLM CPU serves an unquantized linear layer from a kernel that the layer's quant method builds
from the loaded weight (`layer.cpu_linear`: a oneDNN handle, or SGL's packed weight on CPUs with
AMX tiles; the weight itself is then dropped), and its loader rebuilds that kernel for every
layer a refit touches. At 2% of the words changed every layer is touched: on SmolLM2 that
rebuild was the refit's pause (0.6–1.1 s, two thirds of the refit). The kernel depends only on
the layer's weight and bias, so it can be built while the version stages, from the staged
version's canonical values, by the layer's own quant method run on a shadow module holding
them; the pause then puts it in place (`install`: one attribute, and the bias, per layer).

Recipes, one per module with a `cpu_linear` kernel:
    packed  a linear layer whose weight vLLM dropped after packing: the shadow's weight is its
            group's canonical tensors stacked in `packed_modules_mapping` order (a bias the same)
    kept    a module that keeps its weight as a plain copy (the embedding) or shares another's
            (a tied lm_head): the shadow's weight is the live one with the canonical rows put in;
            the live weight itself is written in the pause like any plain parameter

`Prepacker.prove` (at bind) builds every recipe's kernel from the bound version's tensors and
compares its outputs on a probe input with the live kernel's, bit for bit; a module whose loader
does anything but stack its tensors (permute, shard, convert), or whose processing sets anything
but `cpu_linear` and the bias, fails the proof and its group stays on the loader route.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .vllm_placement import Group

_PROBE_ROWS = 3  # rows of the probe input a kernel's proof multiplies


@dataclass(frozen=True, slots=True)
class Recipe:
    """How to build one module's kernel from canonical tensors."""

    module: str
    weight: tuple[str, ...]  # stacked along dim 0 (packed), or the one whose rows it holds (kept)
    bias: tuple[str, ...]  # stacked into the bias (packed layers with one); else ()
    kept: bool  # the module keeps (or shares) its weight as a plain copy


@dataclass(slots=True)
class Built:
    """Kernels built for one staged version, and what installing them replaced."""

    version: int
    root: str
    kernels: dict[str, tuple[Any, torch.Tensor | None]]  # module → (cpu_linear, bias data)
    replaced: dict[str, tuple[Any, torch.Tensor | None]] = field(default_factory=dict)


class Prepacker:
    """The kernel recipes of one live vLLM model, proven at bind (see the module doc).

    Args:
        model: the engine's nn.Module.
        groups: canonical name → its Group (`EnginePlacement.groups`).
        packed: the model's `packed_modules_mapping`.
        tied: (user, owner) module pairs sharing a weight (`EnginePlacement.tied`).
    """

    def __init__(self, model: torch.nn.Module, groups: Mapping[str, Group],
                 packed: Mapping[str, list[str]], tied: list[tuple[str, str]]) -> None:
        self.model = model
        self.recipes: dict[str, Recipe] = {}
        self.refused: dict[str, str] = {}  # module → why its kernel is rebuilt by the loader
        by_module = {g.module: g for g in groups.values()}
        owner_of = dict(tied)
        for name, module in model.named_modules():
            if not callable(getattr(module, "cpu_linear", None)):
                continue
            # a tied user (lm_head) is built from its owner's group (the embedding)
            group = by_module.get(owner_of.get(name, name))
            recipe, why = _recipe(name, module, group, packed, name in owner_of)
            if recipe is None:
                self.refused[name] = why
            else:
                self.recipes[name] = recipe

    def prove(self, state: Mapping[str, torch.Tensor]) -> None:
        """Keep the recipes whose kernel, built from `state` (what the engine serves), computes
        exactly what the live kernel computes on a probe input; refuse the others."""
        gen = torch.Generator().manual_seed(0)
        for name, recipe in list(self.recipes.items()):
            module: Any = self.model.get_submodule(name)
            try:
                own = {n: state[n].clone() for n in recipe.weight}  # overwritten below
                kernel, bias = self._build(recipe, {**state, **own})
                k = _in_features(module, recipe, state)
                x = torch.randn(_PROBE_ROWS, k, generator=gen).to(state[recipe.weight[0]].dtype)
                with torch.no_grad():
                    live = module.cpu_linear(x, module._parameters.get("weight"),
                                             getattr(module, "bias", None))
                    built = kernel(x, None, bias)  # a kernel reading the weight passed fails
                    for t in own.values():  # a kernel still reading its source would change
                        t.fill_(1)
                    again = kernel(x, None, bias)
                why = ("" if _same(live, built) else
                       "a kernel built from its canonical tensors computes otherwise")
                if not why and not _same(built, again):
                    why = "its kernel reads the tensors it was built from"
            except Exception as exc:  # any failure keeps the module on vLLM's loader
                why = f"building its kernel failed ({type(exc).__name__}: {exc})"
            if why:
                del self.recipes[name]
                self.refused[name] = why

    def covers(self, group: Group, plain: set[str], users: Iterable[str]) -> bool:
        """Whether installing kernels (and writing `plain` parameters) brings `group` to its new
        values without the loader: every name is stacked into a proven kernel or written as a
        plain copy, and the group's module and every module sharing its weight (`users`) have
        a proven kernel wherever they have one at all."""
        recipe = self.recipes.get(group.module)
        stacked = set(recipe.weight + recipe.bias) if recipe is not None and not recipe.kept else set()
        if any(n not in stacked and n not in plain for n in group.names):
            return False
        return all(m not in self.refused for m in (group.module, *users))

    def build(self, modules: Iterable[str], state: Mapping[str, torch.Tensor], version: int,
              root: str) -> Built:
        """The kernels of `modules` from `state` (the staged version's values)."""
        return Built(version, root, {m: self._build(self.recipes[m], state) for m in modules})

    def install(self, built: Built) -> None:
        """Put the built kernels in place; `restore` puts back what they replaced."""
        for name, (kernel, bias) in built.kernels.items():
            module: Any = self.model.get_submodule(name)
            live_bias = module._parameters.get("bias")
            built.replaced[name] = (module.cpu_linear,
                                    live_bias.data if live_bias is not None else None)
            module.cpu_linear = kernel
            if live_bias is not None and bias is not None:
                live_bias.data = bias

    def restore(self, built: Built) -> None:
        for name, (kernel, bias) in built.replaced.items():
            module: Any = self.model.get_submodule(name)
            module.cpu_linear = kernel
            live_bias = module._parameters.get("bias")
            if live_bias is not None and bias is not None:
                live_bias.data = bias
        built.replaced.clear()

    def _build(self, recipe: Recipe, state: Mapping[str, torch.Tensor]
               ) -> tuple[Any, torch.Tensor | None]:
        """(cpu_linear, processed bias) built by the module's quant method on a shadow."""
        module: Any = self.model.get_submodule(recipe.module)
        # the canonical tensors themselves where they are the whole weight: `prove` showed that
        # the kernel keeps no reference to them (its own copy, packed)
        if recipe.kept:
            live = module._parameters["weight"]
            weight = state[recipe.weight[0]]
            if weight.shape != live.shape:  # padded rows: the live ones, the canonical put in
                weight = live.detach().clone()
                weight[: state[recipe.weight[0]].shape[0]].copy_(state[recipe.weight[0]])
        else:
            parts = [state[n] for n in recipe.weight]
            weight = parts[0] if len(parts) == 1 else torch.cat(parts)
        # a copy always: processing may keep the bias as it is, and the layer then serves it
        bias = torch.cat([state[n] for n in recipe.bias]) if recipe.bias else None
        shadow: Any = torch.nn.Module()
        shadow.weight = torch.nn.Parameter(weight, requires_grad=False)
        shadow.register_parameter(
            "bias", None if bias is None else torch.nn.Parameter(bias, requires_grad=False))
        with torch.no_grad():
            module.quant_method.process_weights_after_loading(shadow)
        extra = sorted(k for k in vars(shadow) if not k.startswith("_") and k != "training")
        if extra != ["cpu_linear"]:
            raise RuntimeError(f"its processing set {extra}, not only cpu_linear")
        out_bias = shadow._parameters.get("bias")
        return shadow.cpu_linear, (out_bias.data if out_bias is not None else None)


def _recipe(name: str, module: Any, group: Group | None, packed: Mapping[str, list[str]],
            tied_user: bool) -> tuple[Recipe | None, str]:
    """The recipe of one module with a kernel, or (None, why not)."""
    method = getattr(module, "quant_method", None)
    weight = module._parameters.get("weight")
    if method is None or weight is None or group is None \
            or (weight.numel() > 0 and weight.ndim != 2):
        return None, "not a 2-D weight of a canonical group with a quant method"
    if getattr(module, "_cpu_skip_gemm_dispatch", False):
        return None, "vLLM serves it without a packed kernel"
    if weight.numel() > 0 or tied_user:  # the weight stays: its canonical rows go in
        names = [n for n in group.names if n.endswith(".weight")]
        if len(names) != 1 or group.fused or module._parameters.get("bias") is not None:
            return None, "keeps a weight that is not one canonical tensor"
        return Recipe(name, (names[0],), (), kept=True), ""
    if getattr(module, "tp_size", 1) != 1:
        return None, "sharded across tensor-parallel ranks"
    parent, _, leaf = name.rpartition(".")
    prefix = f"{parent}." if parent else ""
    parts = [f"{prefix}{p}" for p in packed[leaf]] if group.fused else [name]
    weights = tuple(f"{p}.weight" for p in parts)
    biases = tuple(f"{p}.bias" for p in parts) if module._parameters.get("bias") is not None else ()
    if set(weights + biases) != set(group.names):
        return None, f"its group holds {list(group.names)[:4]}, not its weight and bias parts"
    return Recipe(name, weights, biases, kept=False), ""


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _in_features(module: Any, recipe: Recipe, state: Mapping[str, torch.Tensor]) -> int:
    """The probe input's width: the layer's (it dropped its weight) or its weight's columns."""
    width = getattr(module, "input_size_per_partition", None)
    return int(width) if width is not None else int(state[recipe.weight[0]].shape[1])
