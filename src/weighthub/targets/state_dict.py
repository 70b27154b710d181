"""A state dict of CPU tensors as a target, updated in place (materialized if empty)."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import UsageError
from ..tensors import TensorSpec, bits, specs_of
from .base import Held


class StateDictTarget:
    """Receives into `state` (name → CPU tensor). An empty dict is filled on first sync."""

    def __init__(self, state: dict[str, torch.Tensor], held: Held | None = None) -> None:
        for name, t in state.items():
            if t.device.type != "cpu":
                raise UsageError(f"tensor {name!r} is on {t.device}; StateDictTarget needs CPU")
        self.state = state
        self._held = held
        self._materialized: list[str] = []

    def held(self) -> Held | None:
        return self._held

    def specs(self) -> list[TensorSpec] | None:
        return specs_of(self.state) if self.state else None

    def peek(self) -> dict[str, np.ndarray]:
        return {name: bits(t) for name, t in self.state.items()}

    def open(self, specs: list[TensorSpec]) -> dict[str, np.ndarray]:
        if not self.state:
            for s in specs:
                self.state[s.name] = torch.empty(s.shape, dtype=s.dtype.torch_dtype)
                self._materialized.append(s.name)
        return {name: bits(t) for name, t in self.state.items()}

    def commit(self, held: Held) -> None:
        self._held = held
        self._materialized.clear()

    def abort(self) -> None:
        for name in self._materialized:
            del self.state[name]
        self._materialized.clear()
