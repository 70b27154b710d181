"""Placement rules and loader-copy interception of the vLLM target, on a toy engine (no vLLM).

The toy loader mimics vLLM's layerwise reload: it materializes a fresh tensor, lets the
parameter's loader copy the checkpoint tensor into it (fused rows by offset), then copies the
result into the engine's original ("kernel") storage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

from weighthub.errors import PlacementError
from weighthub.targets.vllm_copies import LoaderCopies, storage_key
from weighthub.targets.vllm_engine import EnginePlacement
from weighthub.targets.vllm_placement import expand, plan_groups

PACKED = {"qkv_proj": ["q_proj", "k_proj"]}
NAMES = ["m.norm.weight", "m.attn.q_proj.weight", "m.attn.k_proj.weight", "m.attn.q_proj.bias",
         "m.attn.k_proj.bias", "m.out.weight"]
MODULES = {"m.norm", "m.attn.qkv_proj", "m.out"}


def test_groups_follow_the_packed_mapping() -> None:
    groups = plan_groups(NAMES, PACKED, MODULES.__contains__)
    qkv = groups["m.attn.q_proj.weight"]
    assert qkv.fused and qkv.module == "m.attn.qkv_proj"
    assert set(qkv.names) == {n for n in NAMES if "attn" in n}  # weights and biases together
    assert [g.module for g in expand(["m.attn.k_proj.bias"], groups)] == ["m.attn.qkv_proj"]
    assert not groups["m.norm.weight"].fused


def test_partial_fused_group_and_unknown_module_are_refused() -> None:
    with pytest.raises(PlacementError, match=r"fused module 'm.attn.qkv_proj'.*k_proj.bias"):
        plan_groups([n for n in NAMES if n != "m.attn.k_proj.bias"], PACKED, MODULES.__contains__)
    with pytest.raises(PlacementError, match=r"map to no module.*m\.outt\.weight"):
        plan_groups([*NAMES[:-1], "m.outt.weight"], PACKED, MODULES.__contains__)


class _Toy(torch.nn.Module):
    packed_modules_mapping = PACKED

    def __init__(self) -> None:
        super().__init__()
        self.m = torch.nn.Module()
        self.m.norm = torch.nn.Module()
        self.m.norm.weight = torch.nn.Parameter(torch.randn(8).to(torch.bfloat16), requires_grad=False)
        self.m.attn = torch.nn.Module()
        self.m.attn.qkv_proj = torch.nn.Module()
        self.m.attn.qkv_proj.weight = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16),
                                                         requires_grad=False)
        self.m.attn.qkv_proj.bias = torch.nn.Parameter(torch.zeros(6, dtype=torch.bfloat16),
                                                       requires_grad=False)
        self.m.attn.qkv_proj.quant_method = object()  # "repacks": never on the xor path
        self.m.out = torch.nn.Module()
        self.m.out.weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16),
                                               requires_grad=False)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"m.norm.weight": (8,), "m.attn.q_proj.weight": (2, 4), "m.attn.k_proj.weight": (4, 4),
              "m.attn.q_proj.bias": (2,), "m.attn.k_proj.bias": (4,), "m.out.weight": (4, 4)}
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


def _loader(model: _Toy, *, skip: str = "", convert: str = "") -> Callable[..., None]:
    offsets = {"q_proj": 0, "k_proj": 2}

    def reload(feed: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in feed:
            if skip and skip in name:
                continue
            module, _, param = name.rpartition(".")
            leaf = module.rpartition(".")[2]
            if leaf in offsets:
                kernel = getattr(model.m.attn.qkv_proj, param)
                fresh = kernel.data.clone()
                fresh[offsets[leaf]: offsets[leaf] + t.shape[0]].copy_(t)
            else:
                kernel = model.get_parameter(name)
                fresh = torch.empty_like(kernel)
                fresh.copy_(t)
            kernel.data.copy_(fresh.float() if convert and convert in name else fresh)
    return reload


def _engine_holds(model: _Toy, state: dict[str, torch.Tensor]) -> bool:
    qkv = model.m.attn.qkv_proj
    expect = {"m.norm.weight": model.m.norm.weight, "m.out.weight": model.m.out.weight,
              "m.attn.q_proj.weight": qkv.weight[:2], "m.attn.k_proj.weight": qkv.weight[2:],
              "m.attn.q_proj.bias": qkv.bias[:2], "m.attn.k_proj.bias": qkv.bias[2:]}
    return all(torch.equal(expect[n].view(torch.int16), t.view(torch.int16)) for n, t in state.items())


def _bound(**loader: str) -> tuple[_Toy, EnginePlacement, dict[str, torch.Tensor]]:
    model = _Toy()
    placement = EnginePlacement(model, _loader(model, **loader), sorted(_state(0)))
    s0 = _state(0)
    placement.overwrite(sorted(set(placement.groups.values()), key=lambda g: g.module), s0)
    return model, placement, s0


def test_xor_through_the_loaders_copy_and_overwrite_of_whole_groups() -> None:
    model, placement, s0 = _bound()
    assert placement.xor_names == {"m.norm.weight", "m.out.weight"}
    assert _engine_holds(model, s0)
    s1 = {n: t.clone() for n, t in s0.items()}
    s1["m.norm.weight"].view(torch.int16)[3] += 1
    s1["m.attn.q_proj.weight"].view(torch.int16)[1, 2] -= 1
    norm_storage = storage_key(model.m.norm.weight)
    report = placement.push(["m.norm.weight", "m.attn.q_proj.weight"], s1)
    assert report.paths == {"m.norm.weight": "xor", "m.attn.q_proj.weight": "overwrite",
                            "m.attn.k_proj.weight": "overwrite", "m.attn.q_proj.bias": "overwrite",
                            "m.attn.k_proj.bias": "overwrite"}
    assert storage_key(model.m.norm.weight) == norm_storage  # in place
    assert _engine_holds(model, s1)


def test_a_converting_copy_falls_back_to_overwrite() -> None:
    model, placement, s0 = _bound(convert="m.norm")
    s1 = {n: t.clone() for n, t in s0.items()}
    s1["m.norm.weight"].view(torch.int16)[0] += 1
    report = placement.push(["m.norm.weight"], s1)
    assert report.paths == {"m.norm.weight": "overwrite"}
    assert _engine_holds(model, s1)


def test_a_loader_that_skips_a_tensor_is_a_placement_error() -> None:
    model = _Toy()
    placement = EnginePlacement(model, _loader(model, skip="k_proj.bias"), sorted(_state(0)))
    with pytest.raises(PlacementError, match=r"did not read \['m.attn.k_proj.bias'\]"):
        placement.push(["m.attn.q_proj.weight"], _state(0))


def test_overlapping_copies_are_not_xored_twice() -> None:
    dst = torch.zeros(4, dtype=torch.int16)
    src = torch.tensor([1, 2, 3, 4], dtype=torch.int16)
    rec = LoaderCopies({storage_key(src): "s"}, {storage_key(dst)})
    with rec:
        dst[:3].copy_(src[:3])
        dst[2:].copy_(src[2:])  # overlaps element 2: refused
    assert dst.tolist() == [1, 2, 3, 0] and rec.irregular == {storage_key(dst)}
    assert rec.consumed == {"s"}


def _published() -> tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """A store with v0 and v1 (every tensor changed), and a host mirror synced to v0."""
    from weighthub.publish import Publisher
    from weighthub.receive import Receiver
    from weighthub.store import MemoryStore
    from weighthub.targets.state_dict import StateDictTarget

    store = MemoryStore()
    pub = Publisher(store)
    s0 = _state(0)
    s1 = {n: t.clone() for n, t in s0.items()}
    for t in s1.values():
        t.view(torch.int16).view(-1)[0] += 1
    pub.publish(s0)
    pub.publish(s1)
    mirror = StateDictTarget({})
    Receiver(store, mirror).sync(0)
    return store, s0, s1, mirror


def _digests(store: Any, version: int) -> dict[str, str]:
    from weighthub import catalog
    return {e.name: e.digest for e in catalog.primary_manifest(store, version).tensors}


def test_a_failed_push_restores_the_engine_and_the_mirror() -> None:
    """Receiver + EngineTarget: the loader fails midway through v1; the engine is put back."""
    from weighthub.engines.vllm_target import EngineTarget
    from weighthub.errors import ApplyError
    from weighthub.receive import Receiver

    store, s0, s1, mirror = _published()
    model = _Toy()
    calls = {"n": 0, "fail_at": -1}
    inner = _loader(model)

    def flaky(feed: Iterable[tuple[str, torch.Tensor]]) -> None:
        for item in feed:
            calls["n"] += 1
            if calls["n"] == calls["fail_at"]:
                raise RuntimeError("loader died")
            inner([item])

    placement = EnginePlacement(model, flaky, sorted(s0))
    placement.overwrite(sorted(set(placement.groups.values()), key=lambda g: g.module), s0)
    rx = Receiver(store, EngineTarget(mirror, placement, store, _digests(store, 0)))
    calls.update(n=0, fail_at=3)  # after two tensors of v1 reached the engine
    with pytest.raises(ApplyError, match="loader died"):
        rx.sync(1)
    assert rx.version == 0 and _engine_holds(model, s0)
    assert all(torch.equal(mirror.state[n].view(torch.int16), t.view(torch.int16)) for n, t in s0.items())
    calls.update(n=0, fail_at=-1)
    rx.sync(1)
    assert rx.version == 1 and _engine_holds(model, s1)


class _Unreachable:
    """A store the pause must not touch (in a real cluster it may sit across a slow link)."""

    url = "s3://far-away/policy"

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the pause used the store ({name})")


def test_commit_takes_the_staged_manifest_without_reading_the_store() -> None:
    from weighthub.engines.vllm_target import EngineTarget
    from weighthub.errors import ApplyError
    from weighthub.receive import Receiver

    store, s0, s1, mirror = _published()
    model, placement, _ = _bound()
    target = EngineTarget(mirror, placement, store, _digests(store, 0))
    rx = Receiver(store, target)
    staged = rx.stage(1)
    assert staged.arrives is not None and staged.arrives.version == 1
    target.expect(staged.arrives)
    target.store = _Unreachable()  # type: ignore[assignment]
    rx.apply(staged)
    assert rx.version == 1 and _engine_holds(model, s1)
    assert target.digests == _digests(store, 1) and target.expected is None

    # an expectation of another version is not taken: the digests come from the store
    target.store = store
    target.expect(staged.arrives)
    rx.sync(0)  # back to v0 (inverse delta), expecting v1's manifest
    assert target.digests == _digests(store, 0) and _engine_holds(model, s0)
    target.store = _Unreachable()  # type: ignore[assignment]
    rx = Receiver(store, target)
    with pytest.raises(ApplyError, match="the pause used the store"):  # no expectation given
        rx.apply(rx.stage(1))
    assert rx.version == 0 and _engine_holds(model, s0)
