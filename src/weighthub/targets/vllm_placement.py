"""Which canonical tensors a serving engine's loader must receive together.

vLLM fuses checkpoint tensors into one parameter (q/k/v → `qkv_proj`, gate/up → `gate_up_proj`)
and processes a layer (repacking, quantization) only once every element of it has been loaded;
a layer loaded in part is processed with uninitialised memory in the missing rows. So a partial
update must hand the loader every canonical tensor that lands in the same engine module. The
grouping is learned from the model's own `packed_modules_mapping` (fused name → checkpoint
names) and checked against the engine's module tree, never from a list kept here.

Pure functions: no vLLM import, so the rules are unit-testable without an engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ..errors import PlacementError


@dataclass(frozen=True, slots=True)
class Group:
    """Canonical tensors that land in one engine module (loaded and processed together)."""

    module: str  # the engine's module path, e.g. "model.layers.0.self_attn.qkv_proj"
    names: tuple[str, ...]  # canonical tensor names, sorted
    fused: bool  # several checkpoint modules packed into one engine module


def engine_module(name: str, packed: Mapping[str, list[str]]) -> tuple[str, str, bool]:
    """(engine module path, parameter name, fused?) of one canonical tensor name."""
    module, _, param = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    for fused, parts in packed.items():
        if leaf in parts:
            return (f"{parent}.{fused}" if parent else fused), param, True
    return module, param, False


def plan_groups(names: Iterable[str], packed: Mapping[str, list[str]],
                has_module: Callable[[str], bool]) -> dict[str, Group]:
    """Group canonical names by the engine module they land in, and check the grouping.

    Args:
        names: every canonical tensor name of the model.
        packed: the engine model's `packed_modules_mapping` (fused module → checkpoint modules).
        has_module: whether the engine has a module at a path.

    Returns:
        canonical name → its Group.

    Raises:
        PlacementError: a tensor whose module the engine does not have (renamed or unknown), or
            a fused group with a member missing (e.g. q and v without k).
    """
    members: dict[str, list[str]] = {}
    fused_of: dict[str, bool] = {}
    params: dict[str, set[str]] = {}
    for name in names:
        module, param, fused = engine_module(name, packed)
        members.setdefault(module, []).append(name)
        fused_of[module] = fused
        params.setdefault(module, set()).add(param)
    unknown = sorted(n for m, ns in members.items() if not has_module(m) for n in ns)
    if unknown:
        raise PlacementError(
            f"{len(unknown)} canonical tensor(s) map to no module of the engine: {unknown[:5]}; "
            "the trainer's names differ from the served model's (a rename or a tensor the "
            "engine does not accept): publish the served model's checkpoint names")
    for module, ns in members.items():
        if not fused_of[module]:
            continue
        parent, _, leaf = module.rpartition(".")
        prefix = f"{parent}." if parent else ""
        need = {f"{prefix}{part}.{p}" for part in packed[leaf] for p in params[module]}
        missing = sorted(need - set(ns))
        if missing:
            raise PlacementError(
                f"fused module {module!r} needs {sorted(need)} together but the model has no "
                f"{missing}: the engine's loader would process the fused parameter with "
                "uninitialised rows; publish every part of the fused group")
    out = {}
    for module, ns in members.items():
        group = Group(module, tuple(sorted(ns)), fused_of[module])
        for n in ns:
            out[n] = group
    return out


def expand(changed: Iterable[str], groups: Mapping[str, Group]) -> list[Group]:
    """The whole groups that contain any changed tensor, in module order."""
    picked = {groups[n].module: groups[n] for n in changed}
    return [picked[m] for m in sorted(picked)]
