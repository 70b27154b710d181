"""An nn.Module as a target: its parameters and buffers, updated in place, wherever they live."""

from __future__ import annotations

import torch

from ..errors import UsageError
from ..tensors import TensorSpec, specs_of
from .base import Held, KeptViews, Views, check_backend


class ModuleTarget:
    """Receives into a module's state_dict tensors (parameters and persistent buffers).

    The module must already have the model's structure; tied weights are handled (applied once).
    Tensors on a CUDA device are updated there (the device backend: positions and values cross
    to the device, the words never come to the host); CPU tensors by the host kernels. A model
    may mix both. `backend="torch"` runs the device code on CPU tensors too (tests without a
    GPU); "host" refuses device tensors.
    """

    def __init__(self, module: torch.nn.Module, held: Held | None = None, *,
                 backend: str = "auto") -> None:
        self.module = module
        self._held = held
        self.backend = check_backend(backend)
        self._kept = KeptViews()

    def _tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            if not t.is_contiguous():
                raise UsageError(f"{name!r} is not contiguous; cannot update it in place")
            out[name] = t.data
        return out

    def held(self) -> Held | None:
        return self._held

    def specs(self) -> list[TensorSpec] | None:
        return specs_of(self._tensors())

    def peek(self) -> Views:
        """The module's views (kept while its tensors stay the same: `KeptViews`)."""
        return self._kept.of(self._tensors(), self.backend)

    def open(self, specs: list[TensorSpec]) -> Views:
        return self.peek()

    def commit(self, held: Held) -> None:
        self._held = held

    def abort(self) -> None:
        pass
