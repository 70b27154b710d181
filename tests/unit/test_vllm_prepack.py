"""`targets.vllm_prepack` without vLLM: modules that build a kernel from their weight the way
vLLM CPU's quant methods do (a closure over a packed copy, the weight dropped), to check which
recipes are proven, what a group needs to skip the loader, and that install/restore swap exactly
the kernels and biases."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from weighthub.targets.vllm_placement import plan_groups
from weighthub.targets.vllm_prepack import Prepacker

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}


class PackingMethod:
    """Packs the weight (a transposed copy here), drops it (`keep=False`), converts the bias to
    fp32, as vLLM's SGL path does; `permute` mimics a loader that reorders rows."""

    def __init__(self, keep: bool = False, extra: bool = False) -> None:
        self.keep, self.extra = keep, extra

    def process_weights_after_loading(self, layer: Any) -> None:
        packed = layer.weight.detach().t().contiguous().float()
        bias = layer._parameters.get("bias")
        if bias is not None:
            bias.data = bias.data.float()
        layer.cpu_linear = lambda x, _w, b: (x.float() @ packed + (b if b is not None else 0)
                                             ).to(torch.bfloat16)
        if self.extra:
            layer.cache = packed  # something a swap of cpu_linear alone would not carry
        if not self.keep:
            layer.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16),
                                              requires_grad=False)


class Linear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, method: PackingMethod,
                 permute: bool = False) -> None:
        super().__init__()
        self.quant_method = method
        self.input_size_per_partition = weight.shape[1]
        loaded = weight.flip(0) if permute else weight  # a loader that reorders rows
        self.weight = torch.nn.Parameter(loaded.clone(), requires_grad=False)
        self.register_parameter("bias", None if bias is None
                                else torch.nn.Parameter(bias.clone(), requires_grad=False))
        method.process_weights_after_loading(self)


class Embedding(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.quant_method = PackingMethod(keep=True)
        self.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        self.quant_method.process_weights_after_loading(self)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    state = {"embed.weight": r(32, 8), "norm.weight": r(8)}
    for p, rows in (("q_proj", 8), ("k_proj", 4), ("v_proj", 4)):
        state[f"attn.{p}.weight"], state[f"attn.{p}.bias"] = r(rows, 8), r(rows)
    state["attn.o_proj.weight"] = r(8, 8)
    return state


def _model(state: dict[str, torch.Tensor], *, permute: bool = False,
           extra: bool = False) -> torch.nn.Module:
    model = torch.nn.Module()
    model.embed = Embedding(state["embed.weight"])
    model.norm = torch.nn.Module()
    model.norm.weight = torch.nn.Parameter(state["norm.weight"].clone(), requires_grad=False)
    model.attn = torch.nn.Module()
    qkv = [state[f"attn.{p}.weight"] for p in PACKED["qkv_proj"]]
    bias = [state[f"attn.{p}.bias"] for p in PACKED["qkv_proj"]]
    model.attn.qkv_proj = Linear(torch.cat(qkv), torch.cat(bias), PackingMethod(extra=extra))
    model.attn.o_proj = Linear(state["attn.o_proj.weight"], None, PackingMethod(), permute=permute)
    model.lm_head = torch.nn.Module()  # tied: shares the embedding's weight
    model.lm_head.quant_method = PackingMethod(keep=True)
    model.lm_head.weight = model.embed.weight
    model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
    return model


def _prepacker(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> Prepacker:
    modules = dict(model.named_modules())
    groups = plan_groups(sorted(state), PACKED, lambda m: m in modules)
    p = Prepacker(model, groups, PACKED, [("lm_head", "embed")])
    p.prove(state)
    return p


def _out(module: Any, x: torch.Tensor) -> torch.Tensor:
    return module.cpu_linear(x, module.weight, module._parameters.get("bias")).view(torch.int16)


def test_recipes_are_proven_and_a_reordering_loader_is_refused() -> None:
    state = _state()
    p = _prepacker(_model(state), state)
    assert sorted(p.recipes) == ["attn.o_proj", "attn.qkv_proj", "embed", "lm_head"]
    qkv = p.recipes["attn.qkv_proj"]
    assert qkv.weight == ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight")
    assert qkv.bias == ("attn.q_proj.bias", "attn.k_proj.bias", "attn.v_proj.bias")
    assert p.recipes["lm_head"].weight == ("embed.weight",) and p.recipes["lm_head"].kept
    p = _prepacker(_model(state, permute=True), state)
    assert "computes otherwise" in p.refused["attn.o_proj"] and "attn.o_proj" not in p.recipes
    p = _prepacker(_model(state, extra=True), state)
    assert "not only cpu_linear" in p.refused["attn.qkv_proj"]


def test_covers_needs_every_name_and_every_kernel_proven() -> None:
    state = _state()
    model = _model(state, permute=True)
    p = _prepacker(model, state)
    modules = dict(model.named_modules())
    groups = plan_groups(sorted(state), PACKED, lambda m: m in modules)
    qkv, o, embed = groups["attn.q_proj.weight"], groups["attn.o_proj.weight"], groups["embed.weight"]
    assert p.covers(qkv, set(), [])
    assert not p.covers(o, set(), [])  # its kernel failed the proof: the loader rebuilds it
    assert p.covers(embed, {"embed.weight"}, ["lm_head"])
    assert not p.covers(embed, set(), ["lm_head"])  # the embedding's rows must be written


def test_install_serves_the_new_values_and_restore_the_old() -> None:
    old, new = _state(0), _state(1)
    model = _model(old)
    p = _prepacker(model, old)
    x = torch.randn(5, 8).to(torch.bfloat16)
    qkv, head = model.attn.qkv_proj, model.lm_head
    before = (_out(qkv, x), _out(head, x), qkv.bias.data_ptr())
    built = p.build(["attn.qkv_proj", "lm_head"], new, version=1, root="r")
    assert torch.equal(_out(qkv, x), before[0])  # building touches nothing served
    p.install(built)
    expect = _model(new)
    assert torch.equal(_out(qkv, x), _out(expect.attn.qkv_proj, x))
    assert torch.equal(_out(head, x), _out(expect.lm_head, x))
    assert torch.equal(model.embed.weight, old["embed.weight"])  # its rows: written by the caller
    p.restore(built)
    assert torch.equal(_out(qkv, x), before[0]) and torch.equal(_out(head, x), before[1])
    assert qkv.bias.data_ptr() == before[2]  # the very storage it served from


def test_a_kernel_that_reads_the_weight_passed_is_refused() -> None:
    """vLLM's fallback kernel multiplies by the weight the layer passes: not buildable aside."""
    state = _state()
    model = _model(state)
    model.attn.o_proj.cpu_linear = lambda x, w, b: torch.nn.functional.linear(x, w, b)

    class Fallback(PackingMethod):
        def process_weights_after_loading(self, layer: Any) -> None:
            layer.cpu_linear = lambda x, w, b: torch.nn.functional.linear(x, w, b)

    model.attn.o_proj.quant_method = Fallback()
    model.attn.o_proj.weight = torch.nn.Parameter(state["attn.o_proj.weight"].clone(),
                                                  requires_grad=False)
    p = _prepacker(model, state)
    assert "attn.o_proj" in p.refused


def test_a_kernel_that_keeps_reading_its_source_is_refused() -> None:
    """The pause installs kernels built from the scratch copy, which the next staging changes:
    a kernel that reads the tensor it was built from instead of a copy of its own is refused."""
    state = _state()
    model = _model(state)

    class Aliasing(PackingMethod):
        def process_weights_after_loading(self, layer: Any) -> None:
            w = layer.weight.detach()
            layer.cpu_linear = lambda x, _w, b: (x.float() @ w.t().float()).to(torch.bfloat16)

    model.embed.quant_method = Aliasing()
    model.embed.quant_method.process_weights_after_loading(model.embed)
    p = _prepacker(model, state)
    assert "reads the tensors it was built from" in p.refused["embed"]
    assert "lm_head" in p.recipes


@pytest.mark.parametrize("flag", ["yes", "2"])
def test_a_bad_prepack_setting_is_refused(monkeypatch: pytest.MonkeyPatch, flag: str) -> None:
    from weighthub.engines.vllm_target import PREPACK, EngineTarget
    from weighthub.errors import UsageError

    monkeypatch.setenv(PREPACK, flag)
    target = EngineTarget.__new__(EngineTarget)
    with pytest.raises(UsageError, match=PREPACK):
        target.prove_kernels()
