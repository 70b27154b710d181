"""Residual conversion: fp8 block-quantized receivers re-quantize only changed blocks, exactly."""

from __future__ import annotations

import math

import pytest
import torch

from weighthub import catalog
from weighthub.errors import ChecksumError, UsageError
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import MemoryStore
from weighthub.targets.base import Target
from weighthub.targets.converted import Fp8BlockTarget, quantize_fp8_blocks
from weighthub.targets.state_dict import StateDictTarget
from weighthub.testing import TargetTests

BLOCK = (32, 32)  # small blocks so small tensors have many


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": (0.05 * torch.randn(100, 70, generator=g)).to(torch.bfloat16),  # ragged edges
        "b.weight": (0.05 * torch.randn(64, 96, generator=g)).to(torch.bfloat16),
        "b.bias": torch.randn(64, generator=g).to(torch.bfloat16),  # 1-D: not converted
    }


def _touch(state: dict[str, torch.Tensor], hits: dict[str, list[tuple[int, int]]]) -> dict[str, torch.Tensor]:
    """±1 ulp at the given (row, col) positions (an RL step confined to known blocks)."""
    out = {k: v.clone() for k, v in state.items()}
    for name, positions in hits.items():
        words = out[name].view(torch.int16)
        for r, c in positions:
            words[r, c] += 1
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32)


def _same_as_scratch(target: Fp8BlockTarget, state: dict[str, torch.Tensor]) -> None:
    for name in ("a.weight", "b.weight"):
        q, s = target.weight(name)
        q0, s0 = quantize_fp8_blocks(state[name], BLOCK)
        assert q.shape == state[name].shape
        assert torch.equal(_bits(q), _bits(q0)), name  # integer views: bit-identical
        assert torch.equal(_bits(s), _bits(s0)), name


def test_only_changed_blocks_are_requantized_and_result_is_bit_identical() -> None:
    store = MemoryStore()
    pub = Publisher(store)
    target = Fp8BlockTarget(StateDictTarget({}), block=BLOCK)
    rx = Receiver(store, target)
    states = [_state(0)]
    pub.publish(states[0])
    rx.sync()
    blocks_a, blocks_b = math.ceil(100 / 32) * math.ceil(70 / 32), 2 * 3
    assert target.report.requantized == target.report.blocks == blocks_a + blocks_b
    _same_as_scratch(target, states[0])
    # v1: two changes in one block of a, one in its ragged corner block, one in b; bias too
    states.append(_touch(states[0], {"a.weight": [(0, 0), (5, 9), (99, 69)], "b.weight": [(40, 90)]}))
    states[1]["b.bias"].view(torch.int16)[3] += 1
    pub.publish(states[1])
    rx.sync()
    assert target.report.per_tensor == {"a.weight": 2, "b.weight": 1}
    _same_as_scratch(target, states[1])
    # v2: nothing converted changes (only the bias): no block re-quantized
    states.append({k: v.clone() for k, v in states[1].items()})
    states[2]["b.bias"].view(torch.int16)[0] += 1
    pub.publish(states[2])
    rx.sync()
    assert target.report.requantized == 0
    _same_as_scratch(target, states[2])


def test_failed_sync_leaves_quantized_weights_untouched() -> None:
    store = MemoryStore()
    pub = Publisher(store)
    target = Fp8BlockTarget(StateDictTarget({}), block=BLOCK)
    rx = Receiver(store, target)
    s0 = _state(0)
    pub.publish(s0)
    rx.sync()
    pub.publish(_touch(s0, {"a.weight": [(1, 1)]}))
    manifest = catalog.primary_manifest(store, 1)
    key = manifest.chunks[0].key
    blob = bytearray(store.get(key))
    blob[-1] ^= 0xFF
    store.put(key, bytes(blob))  # a corrupt chunk: refused at stage
    with pytest.raises(ChecksumError):
        rx.sync()
    assert rx.version == 0
    _same_as_scratch(target, s0)


def test_quantize_checks_input() -> None:
    with pytest.raises(UsageError, match="2-D float"):
        quantize_fp8_blocks(torch.zeros(4, dtype=torch.bfloat16))
    q, s = quantize_fp8_blocks(torch.zeros(3, 3), (2, 2))  # zero blocks: scale 1, q 0
    assert torch.equal(s, torch.ones(2, 2)) and not q.float().any()
    with pytest.raises(UsageError, match="not a converted tensor"):
        Fp8BlockTarget(StateDictTarget({})).weight("x")


class TestFp8BlockTargetKit(TargetTests):
    """The shipped Target kit (weighthub.testing) on the fp8 wrapper over an empty mirror; its
    2-D bf16 tensor is not a whole number of blocks, and the kit's bit patterns include NaN
    payloads and infinities."""

    def make_target(self) -> Target:
        return Fp8BlockTarget(StateDictTarget({}), block=BLOCK)

    def test_kit_commits_quantize_like_scratch(self) -> None:
        target = Fp8BlockTarget(StateDictTarget({}), block=BLOCK)
        for version, seed in ((1, 5), (2, 6)):
            views = target.open(self.model_specs())
            for spec in self.model_specs():
                views[spec.name][...] = self.pattern(spec, seed).view(views[spec.name].dtype)
            target.commit(self.held_for({}, version))
            inner = target.inner
            assert isinstance(inner, StateDictTarget)
            w = inner.state["embed.weight"]
            q, s = target.weight("embed.weight")
            q0, s0 = quantize_fp8_blocks(w, BLOCK)
            assert torch.equal(_bits(q), _bits(q0)) and torch.equal(_bits(s), _bits(s0))
