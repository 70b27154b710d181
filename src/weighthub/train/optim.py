"""LoGRA: an optimizer that keeps the learning signal of 2-D weights in rank-r gradient sketches.

For a sketched weight W (m×n, fp32 master), each backward folds the gradient into a sketch
S = G·P (m×r) with a seeded projection P (n×r, ±1/√r, see `projection`), inside a
post-accumulate-grad hook that then drops `p.grad`: no dense gradient outlives the hook, and
microbatches accumulate into S. Optimizer state lives in sketch space: an Adam first moment
M (m×r) and a row-wise second moment V (m,) (row scale survives a projection refresh, since
E‖g_i·P‖² = ‖g_i‖²). The step is

    U = M̂ / (√V̂ + ε)             (m×r)          W ← W·(1 − α·lr·wd) − α·lr · U·Pᵀ

applied by `apply_low_rank`'s fixed-order reconstruction, so a receiver holding fp32 masters
can replay it bit-exactly from (U, seed, epoch, α·lr) alone (`compact`). Every `refresh_every`
steps P is redrawn (a new epoch) and M restarts (old-sketch momentum means nothing in the new
basis). Other parameters ("dense") get plain AdamW.

Before applying, an optional `KLProbe` predicts the KL the step would cause (a JVP quadratic
estimate) and scales it by α so the prediction stays under `kl_target`; after applying it
measures the realized KL. A non-finite gradient skips the whole step: weights and moments stay
bit-identical, accumulators are cleared and the skip is reported in the returned `StepStats`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import torch

from ..errors import UsageError
from .kl import Direction, KLProbe, step_scale
from .projection import apply_low_rank, fp32, rademacher
from .record import DenseRecord, SketchRecord, UpdateRecord

log = logging.getLogger(__name__)

NamedParams = Iterable[tuple[str, torch.nn.Parameter]]


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
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class LoGRA(torch.optim.Optimizer):
    """Low-rank gradient sketch optimizer with predicted-KL step control.

    Args:
        sketched: (name, parameter) pairs of fp32 2-D weights to sketch (e.g. attention/MLP
            matrices); names must be the model's `named_parameters()` names (KL probe, sync).
        dense: (name, parameter) pairs updated with plain AdamW (norms, biases, embeddings…).
        rank: sketch rank r, 1 ≤ r ≤ min(m, n) for every sketched weight.
        lr, betas, eps, weight_decay: as in AdamW (decoupled decay), for both groups.
        refresh_every: redraw projections every K applied steps (0: never).
        seed: seeds every projection (with the tensor name and the refresh epoch).
        kl_target: keep predicted per-token KL at or below this (> 0); None: no scaling.
        kl_probe: the batch to predict/measure KL on; with None, no KL is predicted or measured.
        update_dtype: dtype the sketch-space update U is rounded to before it is applied
            (bf16 halves compact sync payloads; the trainer applies the same rounded U).
        record_updates: keep the last applied update as an `UpdateRecord` (`last_update`) for
            compact sync; costs a digest pass and a copy of the dense group's new values.

    Raises:
        UsageError: a non-2-D or non-fp32 sketched parameter, rank out of range, a parameter in
            both groups, kl_target ≤ 0 or non-finite, or other out-of-range settings.
    """

    def __init__(self, sketched: NamedParams, dense: NamedParams = (), *, rank: int, lr: float = 1e-5,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, refresh_every: int = 200, seed: int = 0,
                 kl_target: float | None = None, kl_probe: KLProbe | None = None,
                 update_dtype: torch.dtype = torch.float32, record_updates: bool = False) -> None:
        sk, dn = list(sketched), list(dense)
        _check_settings(rank, lr, betas, eps, weight_decay, refresh_every, kl_target, update_dtype)
        seen: dict[int, str] = {}
        for name, p in sk + dn:
            if id(p) in seen:
                raise UsageError(f"parameter '{name}' is listed twice (also as '{seen[id(p)]}'); "
                                 "give each parameter to exactly one group")
            seen[id(p)] = name
        for name, p in sk:
            _check_sketchable(name, p, rank)
        if not sk and not dn:
            raise UsageError("LoGRA got no parameters")
        groups = [{"params": [p for _, p in g], "sketch": s}
                  for g, s in ((sk, True), (dn, False)) if g]
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.rank, self.seed, self.refresh_every = rank, seed, refresh_every
        self.kl_target, self.kl_probe = kl_target, kl_probe
        self.update_dtype, self.record_updates = update_dtype, record_updates
        self.names = {id(p): n for n, p in sk + dn}
        self.sketched = [p for _, p in sk]
        self.dense = [p for _, p in dn]
        self.epoch = 0  # refresh epoch of the current projections
        self.steps = 0  # step() calls
        self.applied_steps = 0
        self.history: list[StepStats] = []
        self.last_update: UpdateRecord | None = None
        self.peak_transient_grad_bytes = 0  # largest dense p.grad a hook saw (freed at once)
        self._hooks = []
        for p in self.sketched:
            st = self.state[p]
            st["P"] = rademacher(seed, self.names[id(p)], 0, p.shape[1], rank).to(p.device)
            st["S"] = torch.zeros(p.shape[0], rank, device=p.device)
            st["M"] = torch.zeros(p.shape[0], rank, device=p.device)
            st["V"] = torch.zeros(p.shape[0], device=p.device)
            st["m_t"], st["v_t"] = 0, 0  # bias-correction counts (M restarts on refresh)
            self._hooks.append(p.register_post_accumulate_grad_hook(self._fold))

    # -- gradient folding -------------------------------------------------------------------

    @torch.no_grad()
    def _fold(self, p: torch.Tensor) -> None:
        """Autograd hook: S += G·P, then free G (so no dense gradient stays alive)."""
        g = p.grad
        if g is None:
            return
        self.peak_transient_grad_bytes = max(self.peak_transient_grad_bytes, g.nbytes)
        st = self.state[p]
        st["S"].addmm_(g.to(torch.float32), st["P"])
        p.grad = None

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the optimizer can no longer see sketched gradients)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear dense gradients and the sketch accumulators."""
        super().zero_grad(set_to_none)
        for p in self.sketched:
            self.state[p]["S"].zero_()

    # -- the step ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> StepStats:  # type: ignore[override]
        """Apply one update from the accumulated sketches and dense gradients.

        Returns the step's `StepStats` (skipped steps included). Raises UsageError if kl_target
        is set but no kl_probe is.
        """
        if closure is not None:
            with torch.enable_grad():
                closure()
        t0 = time.perf_counter()
        self.steps += 1
        if self.kl_target is not None and self.kl_probe is None:
            raise UsageError("kl_target is set but no kl_probe: give LoGRA(kl_probe=KLProbe(...))")
        bad = self._first_nonfinite()
        if bad is not None:
            self.zero_grad()
            stats = StepStats(self.steps, False, f"non-finite gradient in '{bad}'; step skipped, "
                              "weights and optimizer state untouched")
            log.warning("LoGRA step %d: %s", self.steps, stats.skipped_reason)
            return self._done(stats, t0)
        directions = self._directions()  # moments advance here: the gradient was finite
        stats = StepStats(self.steps, True)
        before = None
        if self.kl_probe is not None:
            full, before = self.kl_probe.predict(self._tangents(directions))
            if not math.isfinite(full):
                self.zero_grad()
                stats = StepStats(self.steps, False, f"predicted KL is {full}; step skipped")
                log.warning("LoGRA step %d: %s", self.steps, stats.skipped_reason)
                return self._done(stats, t0)
            stats.alpha = step_scale(full, self.kl_target)
            stats.predicted_kl_full, stats.predicted_kl = full, full * stats.alpha ** 2
        self._apply(directions, stats.alpha)
        self.applied_steps += 1
        if self.kl_probe is not None and before is not None:
            stats.realized_kl = self.kl_probe.realized(before)
        if self.refresh_every and self.applied_steps % self.refresh_every == 0:
            self._refresh()
            stats.refreshed = True
        self.zero_grad()
        return self._done(stats, t0)

    def _done(self, stats: StepStats, t0: float) -> StepStats:
        stats.seconds = time.perf_counter() - t0
        self.history.append(stats)
        return stats

    def _first_nonfinite(self) -> str | None:
        """Name of the first parameter whose (sketched) gradient has a NaN or inf, else None."""
        for p in self.sketched:  # a NaN/inf in G always reaches S (NaN·x = NaN, inf·±1 = ±inf)
            if not bool(torch.isfinite(self.state[p]["S"]).all()):
                return self.names[id(p)]
        for p in self.dense:
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                return self.names[id(p)]
        return None

    def _directions(self) -> dict[torch.Tensor, torch.Tensor]:
        """Advance the moments; return the unscaled update per parameter (U for sketched, d for dense)."""
        out: dict[torch.Tensor, torch.Tensor] = {}
        for group in self.param_groups:
            b1, b2 = group["betas"]
            eps = group["eps"]
            for p in group["params"]:
                st = self.state[p]
                if group["sketch"]:
                    s = st["S"]
                    st["M"].mul_(b1).add_(s, alpha=1 - b1)
                    st["V"].mul_(b2).add_(s.square().mean(dim=1), alpha=1 - b2)
                    st["m_t"] += 1
                    st["v_t"] += 1
                    denom = (st["V"] / (1 - b2 ** st["v_t"])).sqrt_().add_(eps)
                    u = (st["M"] / (1 - b1 ** st["m_t"])) / denom[:, None]
                    out[p] = u.to(self.update_dtype).to(torch.float32)  # what is applied and sent
                elif p.grad is not None:
                    if "exp_avg" not in st:
                        st["exp_avg"], st["exp_avg_sq"], st["t"] = (torch.zeros_like(p),
                                                                    torch.zeros_like(p), 0)
                    g = p.grad.to(p.dtype)
                    st["t"] += 1
                    st["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
                    st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                    denom = (st["exp_avg_sq"] / (1 - b2 ** st["t"])).sqrt_().add_(eps)
                    out[p] = (st["exp_avg"] / (1 - b1 ** st["t"])) / denom
        return out

    def _tangents(self, directions: dict[torch.Tensor, torch.Tensor]) -> list[Direction]:
        """The dense step at α = 1 per parameter, built lazily (one KL chunk at a time)."""
        out: list[Direction] = []
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p not in directions:
                    continue
                d = directions[p]
                if group["sketch"]:
                    def make(p=p, d=d, lr=lr, wd=wd) -> torch.Tensor:
                        return (d @ self.state[p]["P"].t()).mul_(-lr).sub_(p.detach(), alpha=lr * wd)
                else:
                    def make(p=p, d=d, lr=lr, wd=wd) -> torch.Tensor:
                        return d.mul(-lr).sub_(p.detach(), alpha=lr * wd)
                out.append((self.names[id(p)], make))
        return out

    def _apply(self, directions: dict[torch.Tensor, torch.Tensor], alpha: float) -> None:
        record = UpdateRecord(self.applied_steps + 1) if self.record_updates else None
        for group in self.param_groups:
            coef = fp32(-alpha * group["lr"])
            decay = fp32(1.0 - alpha * group["lr"] * group["weight_decay"])
            for p in group["params"]:
                if p not in directions:
                    continue
                name, d = self.names[id(p)], directions[p]
                base = record.digest(p) if record is not None else b""
                if group["sketch"]:
                    apply_low_rank(p.data, d, self.state[p]["P"], coef=coef, decay=decay)
                    if record is not None:
                        record.sketches.append(SketchRecord(
                            name, tuple(p.shape), d.to(self.update_dtype).clone(), self.seed,
                            self.epoch, coef, decay, base, record.digest(p)))
                else:
                    if decay != 1.0:
                        p.data.mul_(decay)
                    p.data.add_(d.mul_(coef))
                    if record is not None:
                        record.dense.append(DenseRecord(name, p.detach().clone(), base,
                                                        record.digest(p)))
        if record is not None:
            self.last_update = record

    def _refresh(self) -> None:
        """New epoch: redraw every projection and restart the first moments (V is kept)."""
        self.epoch += 1
        for p in self.sketched:
            st = self.state[p]
            st["P"] = rademacher(self.seed, self.names[id(p)], self.epoch, p.shape[1],
                                 self.rank).to(p.device)
            st["M"].zero_()
            st["m_t"] = 0

    # -- accounting -------------------------------------------------------------------------

    def memory_report(self) -> dict[str, int]:
        """Bytes of tensors this optimizer holds, by kind (exact, from the tensors themselves).

        `adamw_equivalent_sketched` is what AdamW would hold for the same sketched weights
        (gradient + two moments, all m×n fp32), the baseline of the ≥ 40% memory target.
        """
        rep = {"sketch_projection": 0, "sketch_accumulator": 0, "sketch_moments": 0,
               "dense_moments": 0, "dense_grads": 0, "adamw_equivalent_sketched": 0,
               "peak_transient_grad": self.peak_transient_grad_bytes}
        for p in self.sketched:
            st = self.state[p]
            rep["sketch_projection"] += st["P"].nbytes
            rep["sketch_accumulator"] += st["S"].nbytes
            rep["sketch_moments"] += st["M"].nbytes + st["V"].nbytes
            rep["adamw_equivalent_sketched"] += 3 * p.numel() * 4
        for p in self.dense:
            st = self.state[p]
            rep["dense_moments"] += sum(st[k].nbytes for k in ("exp_avg", "exp_avg_sq") if k in st)
            rep["dense_grads"] += p.numel() * p.element_size()  # held between backward and step
        rep["sketched_total"] = (rep["sketch_projection"] + rep["sketch_accumulator"]
                                 + rep["sketch_moments"])
        return rep


def _check_settings(rank: int, lr: float, betas: tuple[float, float], eps: float, wd: float,
                    refresh_every: int, kl_target: float | None, update_dtype: torch.dtype) -> None:
    if not isinstance(rank, int) or rank < 1:
        raise UsageError(f"rank must be an integer >= 1, got {rank!r}")
    if not (lr > 0 and math.isfinite(lr)):
        raise UsageError(f"lr must be finite and > 0, got {lr}")
    if not all(0.0 <= b < 1.0 for b in betas) or eps <= 0 or wd < 0 or refresh_every < 0:
        raise UsageError(f"need 0 <= betas < 1, eps > 0, weight_decay >= 0, refresh_every >= 0; "
                         f"got betas={betas}, eps={eps}, weight_decay={wd}, refresh_every={refresh_every}")
    if kl_target is not None and not (kl_target > 0 and math.isfinite(kl_target)):
        raise UsageError(f"kl_target must be a finite KL > 0 (nats per token), got {kl_target}; "
                         "use None to turn step control off")
    if update_dtype not in (torch.float32, torch.bfloat16):
        raise UsageError(f"update_dtype must be torch.float32 or torch.bfloat16, got {update_dtype}")


def _check_sketchable(name: str, p: torch.Tensor, rank: int) -> None:
    if p.dim() != 2:
        raise UsageError(f"sketched parameter '{name}' has shape {tuple(p.shape)}: only 2-D weights "
                         "can be sketched; pass it in the dense group")
    if p.dtype != torch.float32:
        raise UsageError(f"sketched parameter '{name}' is {p.dtype}: LoGRA updates fp32 master "
                         "weights; keep the master in fp32 and cast for inference")
    if rank > min(p.shape):
        raise UsageError(f"rank {rank} exceeds min(m, n) = {min(p.shape)} of '{name}' "
                         f"{tuple(p.shape)}: lower the rank or put '{name}' in the dense group")
