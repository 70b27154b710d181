"""What one LoGRA step did (`StepStats`) and what an applied one changed, in the terms a
compact-sync receiver needs to replay it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from ..digest import tensor_digest


@dataclass(frozen=True, slots=True)
class SketchRecord:
    """W ← W·decay + apply_low_rank(u·coef, P(seed, name, epoch)) for one sketched weight."""

    name: str
    shape: tuple[int, ...]
    u: torch.Tensor  # (m×r) in the optimizer's update dtype: exactly what was applied
    seed: int
    epoch: int
    coef: float  # fp32-representable (−α·lr)
    decay: float  # fp32-representable (1 − α·lr·wd)
    base_digest: bytes  # xxh3-128 of the fp32 master before the step
    digest: bytes  # … and after


@dataclass(frozen=True, slots=True)
class DenseRecord:
    """A densely updated parameter: its new fp32 values travel as they are."""

    name: str
    value: torch.Tensor
    base_digest: bytes
    digest: bytes


@dataclass(slots=True)
class UpdateRecord:
    """One applied step (`step` is the 1-based count of applied steps)."""

    step: int
    sketches: list[SketchRecord] = field(default_factory=list)
    dense: list[DenseRecord] = field(default_factory=list)

    @staticmethod
    def digest(t: torch.Tensor) -> bytes:
        return tensor_digest(t.detach().cpu())


@dataclass(slots=True)
class StepStats:
    """What one `LoGRA.step()` did (also appended to `LoGRA.history`)."""

    step: int  # 1-based count of step() calls
    applied: bool
    skipped_reason: str | None = None
    alpha: float = 1.0
    predicted_kl_full: float | None = None  # predicted KL at α = 1
    predicted_kl: float | None = None  # predicted KL at the applied α (= α²·full)
    realized_kl: float | None = None
    refreshed: bool = False  # the projections were redrawn after this step
    realized_kl_error: str | None = None  # why realized_kl is None although a probe is set
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)
