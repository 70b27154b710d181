"""An nn.Module as a target: its parameters and buffers, updated in place."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import UsageError
from ..tensors import TensorSpec, bits, specs_of
from .base import Held


class ModuleTarget:
    """Receives into a module's state_dict tensors (parameters and persistent buffers).

    The module must already have the model's structure; tied weights are handled (applied once).
    """

    def __init__(self, module: torch.nn.Module, held: Held | None = None) -> None:
        self.module = module
        self._held = held

    def _tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            if t.device.type != "cpu":
                raise UsageError(f"{name!r} is on {t.device}; ModuleTarget applies on CPU tensors")
            if not t.is_contiguous():
                raise UsageError(f"{name!r} is not contiguous; cannot update it in place")
            out[name] = t.data
        return out

    def held(self) -> Held | None:
        return self._held

    def specs(self) -> list[TensorSpec] | None:
        return specs_of(self._tensors())

    def peek(self) -> dict[str, np.ndarray]:
        return {name: bits(t) for name, t in self._tensors().items()}

    def open(self, specs: list[TensorSpec]) -> dict[str, np.ndarray]:
        return {name: bits(t) for name, t in self._tensors().items()}

    def commit(self, held: Held) -> None:
        self._held = held

    def abort(self) -> None:
        pass
