"""The shipped `TargetTests` kit on the built-in storage targets.

State dicts (empty, materialized by open; and pre-filled, holding a version), a module with tied
weights and a buffer, and safetensors outputs (one file; a directory). The fp8 block target runs
the kit in test_converted.py, the leased target in test_net_leases.py, the vLLM engine target in
tests/integration/test_vllm.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weighthub.targets import Held, ModuleTarget, SafetensorsTarget, StateDictTarget, Target
from weighthub.tensors import TensorSpec, specs_of
from weighthub.testing import TargetTests


class TestEmptyStateDictTarget(TargetTests):
    def make_target(self) -> Target:
        return StateDictTarget({})


class TestHeldStateDictTarget(TargetTests):
    def make_target(self) -> Target:
        state = {s.name: torch.zeros(s.shape, dtype=s.dtype.torch_dtype) for s in self.model_specs()}
        return StateDictTarget(state, Held("memory://kit", "kit-model", 3, "r" * 32))


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(33, 16).to(torch.bfloat16)
        self.proj = torch.nn.Linear(16, 24).to(torch.float16)
        self.head = torch.nn.Linear(16, 33, bias=False).to(torch.bfloat16)
        self.head.weight = self.embed.weight  # tied: one memory, two names
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))


class TestModuleTarget(TargetTests):
    def make_target(self) -> Target:
        return ModuleTarget(_Tied())

    def model_specs(self) -> list[TensorSpec]:
        return specs_of(_Tied().state_dict())


class TestTorchStateDictTarget(TargetTests):
    """The device backend's views (torch words; CUDA in production, CPU tensors here)."""

    def make_target(self) -> Target:
        return StateDictTarget({}, backend="torch")


class TestTorchModuleTarget(TargetTests):
    def make_target(self) -> Target:
        return ModuleTarget(_Tied(), backend="torch")

    def model_specs(self) -> list[TensorSpec]:
        return specs_of(_Tied().state_dict())


@pytest.mark.gpu
class TestCudaStateDictTarget(TargetTests):
    def make_target(self) -> Target:
        return StateDictTarget({}, device="cuda")


class TestSafetensorsFileTarget(TargetTests):
    @pytest.fixture(autouse=True)
    def _tmp(self, tmp_path: Path) -> None:
        self.tmp, self.made = tmp_path, 0

    def make_target(self) -> Target:
        self.made += 1
        return SafetensorsTarget(self.tmp / f"out{self.made}.safetensors")


class TestSafetensorsDirTarget(TestSafetensorsFileTarget):
    def make_target(self) -> Target:
        self.made += 1
        return SafetensorsTarget(self.tmp / f"out{self.made}")


class TestSafetensorsAtomicFileTarget(TestSafetensorsFileTarget):
    def make_target(self) -> Target:
        self.made += 1
        return SafetensorsTarget(self.tmp / f"out{self.made}.safetensors", mode="atomic")
