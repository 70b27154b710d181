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

On a GPU the step is a fixed number of batched kernels, not a loop over parameters: sketched
weights are stacked by shape (`sketch.Bucket`: one moment update per shape, the reconstruction's
rank-1 terms once per chunk of several weights), the dense group runs foreach AdamW (`dense`),
and the non-finite check is one fused kernel read back once: the step's only host sync without
a KL probe (the probe needs its predicted KL on the host to choose α, and syncs again for it).

All or nothing: `step` first *prepares* (new moments, U, the reconstruction's workspace, the
dense buffers, the KL prediction: every allocation of the step), then *commits* (writes into
existing memory only). An out-of-memory error while preparing leaves weights, gradients and
optimizer state bit-identical and says so; the commit allocates no device memory. Only the
realized-KL measurement runs after the commit: if it runs out of memory the step stays applied
and `StepStats.realized_kl_error` says why there is no realized KL.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UsageError
from .checks import check_one_device, check_settings, check_sketchable
from .counters import COUNTERS, counter
from .dense import DenseAdamW, DensePrepared
from .kl import Direction, KLProbe, step_scale
from .projection import fp32, scaled_update
from .record import DenseRecord, SketchRecord, StepStats, UpdateRecord
from .sketch import Prepared, buckets, workspace

log = logging.getLogger(__name__)

NamedParams = Iterable[tuple[str, torch.nn.Parameter]]


@dataclass(slots=True)
class _Record:
    """A step's UpdateRecord while it is being made: base digests, buffers for dense values."""

    update: UpdateRecord
    base: dict[int, bytes]  # id(parameter) → digest before the step
    values: list[torch.Tensor]  # preallocated copies of the dense group's new values


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
            compact sync; costs a digest pass and a copy of the dense group's new values (and,
            on a GPU, copies of the updated weights to the host for their digests).
        dense_state_dtype: dtype of the dense group's Adam moments (torch.bfloat16 halves them).

    Raises:
        UsageError: a non-2-D or non-fp32 sketched parameter, rank out of range, a parameter in
            both groups, parameters on more than one device, kl_target ≤ 0 or non-finite, or
            other out-of-range settings.
    """

    def __init__(self, sketched: NamedParams, dense: NamedParams = (), *, rank: int, lr: float = 1e-5,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, refresh_every: int = 200, seed: int = 0,
                 kl_target: float | None = None, kl_probe: KLProbe | None = None,
                 update_dtype: torch.dtype = torch.float32, record_updates: bool = False,
                 dense_state_dtype: torch.dtype = torch.float32) -> None:
        sk, dn = list(sketched), list(dense)
        check_settings(rank, lr, betas, eps, weight_decay, refresh_every, kl_target, update_dtype)
        if dense_state_dtype not in (torch.float32, torch.bfloat16):
            raise UsageError(f"dense_state_dtype must be torch.float32 or torch.bfloat16, got "
                             f"{dense_state_dtype}")
        seen: dict[int, str] = {}
        for name, p in sk + dn:
            if id(p) in seen:
                raise UsageError(f"parameter '{name}' is listed twice (also as '{seen[id(p)]}'); "
                                 "give each parameter to exactly one group")
            seen[id(p)] = name
        for name, p in sk:
            check_sketchable(name, p, rank)
        if not sk and not dn:
            raise UsageError("LoGRA got no parameters")
        check_one_device(sk + dn)
        groups = [{"params": [p for _, p in g], "sketch": s}
                  for g, s in ((sk, True), (dn, False)) if g]
        groups[0].update(dict.fromkeys(COUNTERS, 0))  # see `counters`
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.rank, self.seed, self.refresh_every = rank, seed, refresh_every
        self.kl_target, self.kl_probe = kl_target, kl_probe
        self.update_dtype, self.record_updates = update_dtype, record_updates
        self.names = {id(p): n for n, p in sk + dn}
        self.sketched = [p for _, p in sk]
        self.dense = [p for _, p in dn]
        self.history: list[StepStats] = []
        self.last_update: UpdateRecord | None = None
        self.peak_transient_grad_bytes = 0  # largest dense p.grad a hook saw (freed at once)
        self.buckets = buckets(sk, rank, seed)
        self._dense = DenseAdamW(self.dense, self.state, dense_state_dtype)
        self._hooks = []
        for bk in self.buckets:
            for i, p in enumerate(bk.params):
                self.state[p].update(P=bk.P[i], S=bk.S[i], M=bk.M[i], V=bk.V[i])  # views
                self._hooks.append(p.register_post_accumulate_grad_hook(self._fold))

    steps = counter("steps")  # step() calls
    applied_steps = counter("applied_steps")
    epoch = counter("epoch")  # refresh epoch of the current projections
    m_t = counter("m_t")  # sketch-space bias-correction counts (M restarts on refresh)
    v_t = counter("v_t")

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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch does, then copy each sketched weight's P, S, M, V into its bucket (the
        step reads the stacked buckets; loaded tensors would otherwise be ignored)."""
        super().load_state_dict(state_dict)
        self._dense.state = self.state  # torch replaces the state dict itself
        # a checkpoint from before the counters were saved kept m_t/v_t per sketched weight
        older = self.state[self.sketched[0]] if self.sketched else {}
        for key in COUNTERS:
            self.param_groups[0].setdefault(key, older.get(key, 0))
        for bk in self.buckets:
            for i, p in enumerate(bk.params):
                st = self.state[p]
                for key, buf in (("P", bk.P), ("S", bk.S), ("M", bk.M), ("V", bk.V)):
                    buf[i].copy_(st[key])
                    st[key] = buf[i]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear dense gradients and the sketch accumulators."""
        super().zero_grad(set_to_none)
        for bk in self.buckets:
            bk.S.zero_()

    # -- the step ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> StepStats:  # type: ignore[override]
        """Apply one update from the accumulated sketches and dense gradients.

        Returns the step's `StepStats` (skipped steps included; `seconds` is host time: the
        commit's kernels may still be running on a GPU when it returns).

        Raises:
            UsageError: kl_target is set but no kl_probe is.
            torch.OutOfMemoryError: the device ran out of memory while the step was prepared;
                weights, gradients and optimizer state are unchanged (step() may be retried).
        """
        if closure is not None:
            with torch.enable_grad():
                closure()
        t0 = time.perf_counter()
        if self.kl_target is not None and self.kl_probe is None:
            raise UsageError("kl_target is set but no kl_probe: give LoGRA(kl_probe=KLProbe(...))")
        self.steps += 1
        try:
            plan = self._prepare()
        except torch.OutOfMemoryError as exc:
            self.steps -= 1
            raise torch.OutOfMemoryError(
                f"LoGRA step {self.steps + 1} ran out of device memory while preparing the update "
                f"({exc}); nothing was applied: weights, gradients and optimizer state are "
                "unchanged. Free memory (a smaller batch or KL probe, sketch_embeddings=True, "
                "dense_state_dtype=torch.bfloat16) and call step() again, or zero_grad() to drop "
                "this step") from exc
        if isinstance(plan, StepStats):  # skipped
            self.zero_grad()
            log.warning("LoGRA step %d: %s", self.steps, plan.skipped_reason)
            return self._done(plan, t0)
        stats, sketch, dense, record, before = plan
        self._commit(stats, sketch, dense, record)
        if self.kl_probe is not None and before is not None:
            try:
                stats.realized_kl = self.kl_probe.realized(before)
            except torch.OutOfMemoryError as exc:  # the step is applied: report, do not fail
                stats.realized_kl_error = f"out of device memory measuring it ({exc})"
                log.warning("LoGRA step %d applied; realized KL not measured: %s", self.steps, exc)
        self.zero_grad()
        return self._done(stats, t0)

    def _prepare(self) -> StepStats | tuple[StepStats, list[Prepared], DensePrepared,
                                            _Record | None, torch.Tensor | None]:
        """Everything the step allocates, nothing it mutates: a skip's StepStats, or the plan."""
        bad = self._first_nonfinite()
        if bad is not None:
            return StepStats(self.steps, False, f"non-finite gradient in '{bad}'; step skipped, "
                             "weights and optimizer state untouched")
        stats = StepStats(self.steps, True)
        sk = self._group(True)
        prepared: list[Prepared] = []
        if sk is not None:
            (b1, b2), eps = sk["betas"], sk["eps"]
            prepared = [bk.prepare(b1, b2, eps, self.m_t + 1, self.v_t + 1, self.update_dtype)
                        for bk in self.buckets]
        dense = self._dense.prepare()
        before = None
        if self.kl_probe is not None:
            full, before = self.kl_probe.predict(self._tangents(prepared, dense))
            if not math.isfinite(full):
                return StepStats(self.steps, False, f"predicted KL is {full}; step skipped")
            stats.alpha = step_scale(full, self.kl_target)
            stats.predicted_kl_full, stats.predicted_kl = full, full * stats.alpha ** 2
        if sk is not None:
            coef = fp32(-stats.alpha * sk["lr"])
            work = workspace(self.buckets)  # one, shared: buckets are applied one after another
            for prep in prepared:
                prep.uc, prep.work = scaled_update(prep.u, coef), work
        record = None
        if self.record_updates:
            record = _Record(UpdateRecord(self.applied_steps + 1),
                             {id(p): UpdateRecord.digest(p) for p in self.sketched + dense.params},
                             [torch.empty_like(p) for p in dense.params])
        return stats, prepared, dense, record, before

    def _group(self, sketch: bool) -> dict[str, Any] | None:
        return next((g for g in self.param_groups if g["sketch"] is sketch), None)

    def _done(self, stats: StepStats, t0: float) -> StepStats:
        stats.seconds = time.perf_counter() - t0
        self.history.append(stats)
        return stats

    def _first_nonfinite(self) -> str | None:
        """Name of a parameter whose (sketched) gradient has a NaN or inf, else None.

        One fused check (the multi-tensor kernel AMP's GradScaler uses, scaling by exactly 1)
        and one host read, instead of a read per parameter; names are looked up only on failure.
        A NaN/inf in G always reaches S (NaN·x = NaN, inf·±1 = ±inf).
        """
        tensors = [bk.S for bk in self.buckets] + [p.grad for p in self.dense if p.grad is not None]
        if not tensors:
            return None
        found = torch.zeros(1, device=tensors[0].device)
        one = torch.ones(1, device=found.device)
        for dtype in {t.dtype for t in tensors}:
            torch._amp_foreach_non_finite_check_and_unscale_(
                [t for t in tensors if t.dtype == dtype], found, one)
        if not found.item():  # the step's one host sync without a KL probe
            return None
        for bk in self.buckets:
            names = bk.nonfinite()
            if names:
                return names[0]
        return next(self.names[id(p)] for p in self.dense
                    if p.grad is not None and not bool(torch.isfinite(p.grad).all()))

    def _tangents(self, sketch: list[Prepared], dense: DensePrepared) -> list[Direction]:
        """The dense step at α = 1 per parameter, built lazily (one KL chunk at a time)."""
        out: list[Direction] = []
        sk, dn = self._group(True), self._group(False)
        if sk is not None:
            lr, wd = sk["lr"], sk["weight_decay"]
            for bk, prep in zip(self.buckets, sketch, strict=True):
                for i, p in enumerate(bk.params):
                    def make_sk(bk=bk, prep=prep, i=i, p=p) -> torch.Tensor:
                        return bk.tangent_update(prep, i).mul_(-lr).sub_(p.detach(), alpha=lr * wd)
                    out.append((self.names[id(p)], make_sk))
        if dn is not None:
            (b1, b2), eps, lr, wd = dn["betas"], dn["eps"], dn["lr"], dn["weight_decay"]
            for i, p in enumerate(dense.params):
                def make_dn(i=i, p=p) -> torch.Tensor:
                    d = self._dense.tangent(dense, i, b1, b2, eps)
                    return d.mul_(-lr).sub_(p.detach(), alpha=lr * wd)
                out.append((self.names[id(p)], make_dn))
        return out

    def _commit(self, stats: StepStats, sketch: list[Prepared], dense: DensePrepared,
                record: _Record | None) -> None:
        """Apply the prepared step: moments, weights, counts, refresh (no device allocation)."""
        sk, dn = self._group(True), self._group(False)
        if sk is not None:
            decay = fp32(1.0 - stats.alpha * sk["lr"] * sk["weight_decay"])
            for bk, prep in zip(self.buckets, sketch, strict=True):
                bk.commit(prep, decay)
            self.m_t += 1
            self.v_t += 1
        if dn is not None:
            (b1, b2), eps = dn["betas"], dn["eps"]
            self._dense.commit(dense, b1, b2, eps, fp32(-stats.alpha * dn["lr"]),
                               fp32(1.0 - stats.alpha * dn["lr"] * dn["weight_decay"]))
        if record is not None:
            self._record_after(record, sketch, dense, stats.alpha)
        self.applied_steps += 1
        if self.refresh_every and self.applied_steps % self.refresh_every == 0:
            self._refresh()
            stats.refreshed = True

    def _record_after(self, rec: _Record, sketch: list[Prepared], dense: DensePrepared,
                      alpha: float) -> None:
        """Finish the step's UpdateRecord: the applied U, the dense values, digests after."""
        up = rec.update
        sk = self._group(True)
        if sk is not None:
            coef = fp32(-alpha * sk["lr"])
            decay = fp32(1.0 - alpha * sk["lr"] * sk["weight_decay"])
            for bk, prep in zip(self.buckets, sketch, strict=True):
                for i, (name, p) in enumerate(zip(bk.names, bk.params, strict=True)):
                    up.sketches.append(SketchRecord(name, tuple(p.shape), prep.u[i], self.seed,
                                                    self.epoch, coef, decay, rec.base[id(p)],
                                                    up.digest(p)))
        for p, value in zip(dense.params, rec.values, strict=True):
            value.copy_(p.detach())
            up.dense.append(DenseRecord(self.names[id(p)], value, rec.base[id(p)], up.digest(p)))
        self.last_update = up

    def _refresh(self) -> None:
        """New epoch: redraw every projection and restart the first moments (V is kept)."""
        self.epoch += 1
        for bk in self.buckets:
            bk.draw(self.epoch)
            bk.M.zero_()
        self.m_t = 0

    # -- accounting -------------------------------------------------------------------------

    def memory_report(self) -> dict[str, int]:
        """Bytes of tensors this optimizer holds, by kind (exact, from the tensors themselves).

        `adamw_equivalent_sketched` is what AdamW would hold for the same sketched weights
        (gradient + two moments, all m×n fp32), the baseline of the ≥ 40% memory target.
        """
        rep = {"sketch_projection": 0, "sketch_accumulator": 0, "sketch_moments": 0,
               "dense_moments": 0, "dense_grads": 0, "adamw_equivalent_sketched": 0,
               "peak_transient_grad": self.peak_transient_grad_bytes}
        for bk in self.buckets:
            rep["sketch_projection"] += bk.P.nbytes
            rep["sketch_accumulator"] += bk.S.nbytes
            rep["sketch_moments"] += bk.M.nbytes + bk.V.nbytes
            rep["adamw_equivalent_sketched"] += 3 * sum(p.numel() for p in bk.params) * 4
        for p in self.dense:
            st = self.state[p]
            rep["dense_moments"] += sum(st[k].nbytes for k in ("exp_avg", "exp_avg_sq") if k in st)
            rep["dense_grads"] += p.numel() * p.element_size()  # held between backward and step
        rep["sketched_total"] = (rep["sketch_projection"] + rep["sketch_accumulator"]
                                 + rep["sketch_moments"])
        return rep
