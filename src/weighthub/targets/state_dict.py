"""A state dict of tensors as a target, updated in place (materialized if empty)."""

from __future__ import annotations

import torch

from ..tensors import TensorSpec, specs_of
from .base import Held, KeptViews, Views, check_backend, check_device


class StateDictTarget:
    """Receives into `state` (name → tensor). An empty dict is filled on first sync.

    Tensors on a CUDA device are updated there (see ModuleTarget); an empty state is
    materialized on `device` (default: the host).
    """

    def __init__(self, state: dict[str, torch.Tensor], held: Held | None = None, *,
                 backend: str = "auto", device: str | torch.device = "cpu") -> None:
        self.backend = check_backend(backend)
        self.device = check_device(device, self.backend)
        self.state = state
        self._held = held
        self._materialized: list[str] = []
        self._kept = KeptViews()
        self.peek()  # refuses what it cannot update, before anything runs

    def held(self) -> Held | None:
        return self._held

    def specs(self) -> list[TensorSpec] | None:
        return specs_of(self.state) if self.state else None

    def peek(self) -> Views:
        """The state's views (kept while its tensors stay the same: `KeptViews`)."""
        return self._kept.of(self.state, self.backend)

    def open(self, specs: list[TensorSpec]) -> Views:
        if not self.state:
            for s in specs:
                self.state[s.name] = torch.empty(s.shape, dtype=s.dtype.torch_dtype,
                                                 device=self.device)
                self._materialized.append(s.name)
        return self.peek()

    def commit(self, held: Held) -> None:
        self._held = held
        self._materialized.clear()

    def abort(self) -> None:
        if self._materialized:
            self._kept.drop()  # holds the storage of the tensors dropped here
        for name in self._materialized:
            del self.state[name]
        self._materialized.clear()
