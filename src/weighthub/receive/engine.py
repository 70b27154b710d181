"""The transaction engine: the one code path that changes a target's bits.

    open      the target's writable views (materializing an empty target; a file target locks
              itself across processes); refuse views that partly share memory, and a target
              that no longer holds what the steps were staged against (another process)
    bind      each step to the state it applies to: a delta's base root (invariant 4)
    apply     in place, every old word recorded in an undo log first (and, for a target that
              journals, the words each step may write made durable before it starts)
    verify    tensor digests of every touched tensor against the manifest of each version the
              steps pass through (incremental, O(changed)), or every touched tensor digested
              again at the end (full); with verify_base, the held bits against their root first
    commit    the target records the new version; or, on any failure anywhere in between,
              roll back exactly (undo log, then `target.abort()`) and raise

Every input goes through `transact`: a store route staged by `Receiver`, an elastic join's
dense tensors streamed from holders (`cluster.join`), a compact LoGRA step's replayed words
(`train.compact`). The caller holds whatever lock makes the change atomic to observers
(`Receiver.lock`); the engine does not import cluster/ or train/, which sit above it. No cyclic
garbage collection runs inside a transaction (`nogc`: one that lands there walks the heap).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal

from ..codec import UndoLog
from ..errors import ApplyError, BaseMismatch, UsageError, WeighthubError
from ..nogc import collections_deferred
from ..targets.base import Held, Target, journal_step
from ..tensors import TensorSpec
from .apply import apply_step, layout_of
from .clock import PhaseClock
from .inputs import Step
from .routes import check_binding
from .undo_plan import plan_step
from .verify import check_root, check_step, check_touched

Verify = Literal["incremental", "full"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """A committed transaction: where its time went, and the digests it proved."""

    held: Held  # what the target holds now
    apply_seconds: float
    verify_seconds: float  # including verify_base's full pass
    # tensor digests of the committed version (incremental verification only; None otherwise)
    digests: dict[str, bytes] | None


def transact(target: Target, steps: Sequence[Step], *, store: str, held: Held | None,
             specs: list[TensorSpec], fresh: bool, verify: Verify = "incremental",
             held_digests: dict[str, bytes] | None = None, verify_base: bool = False,
             apply_workers: int = 2) -> Outcome:
    """Apply `steps` to `target` in one transaction: all of them and commit, or none.

    Args:
        target: where the bits live; it must hold `held` (checked by the caller).
        steps: in order; the last one's `arrives` is the version committed.
        store: url recorded in the committed `Held` (and named in messages).
        held: what the target holds (None: nothing).
        specs: the tensor table to open the target with (the last step's).
        fresh: the target holds nothing worth restoring (it is being materialized, and is
            discarded by `abort` on failure): full steps skip the undo copy.
        verify: "incremental" or "full" (see module doc).
        held_digests: the held version's tensor digests (incremental verification of a delta;
            tensors without one are digested in the pause).
        verify_base: prove the held bits against `held.root` before applying.
        apply_workers: threads applying chunks.

    Raises:
        BaseMismatch (a step not bound to the state), IntegrityError (digests), FormatError,
        PlacementError, or ApplyError wrapping anything outside the error tree: in every case
        after rolling back and aborting the target.
    """
    if not steps:
        raise UsageError("a transaction needs at least one step")
    with collections_deferred():  # no collection walks the heap inside the pause
        return _transact(target, steps, store, held, specs, fresh, verify == "incremental",
                         held_digests, verify_base, apply_workers)


def _transact(target: Target, steps: Sequence[Step], store: str, held: Held | None,
              specs: list[TensorSpec], fresh: bool, incremental: bool,
              held_digests: dict[str, bytes] | None, verify_base: bool,
              apply_workers: int) -> Outcome:
    final = steps[-1].arrives
    undo = UndoLog(fresh=fresh)
    clock = PhaseClock()
    try:
        views = target.open(specs)
        _check_unmoved(target, held, final.version, store)
        alias = layout_of(views, [s.name for s in specs])
        if held is not None and verify_base:
            with clock.phase("verify"):
                held_digests = check_root(views, specs, held.root)
        touched: set[int] = set()
        digests = dict(held_digests) if held_digests is not None else None
        state_root = held.root if held else None
        for step in steps:
            check_binding(step, state_root)
            # a fresh target needs no undo copy for the full representation it starts with;
            # deltas after it record their dense writes (verification reads the old words)
            undo.fresh = fresh and step.full
            if not undo.fresh:  # a file target journals the old words first (crash recovery)
                with clock.phase("apply"):
                    journal_step(target, partial(plan_step, step, views, alias))
            with clock.shared() as busy:
                applied = apply_step(step, views, alias, undo, touched, incremental=incremental,
                                     where=store, workers=apply_workers)
                busy.apply, busy.verify = applied.busy_apply, applied.busy_verify
            if incremental:
                with clock.phase("verify"):
                    digests = check_step(views, alias, step.arrives, step.specs, applied.changes,
                                         digests, from_nothing=step.full)
            state_root = step.arrives.root
        if not incremental:
            with clock.phase("verify"):
                check_touched(views, final, touched)
            digests = None
        now = Held(store, final.model, final.version, final.root)
        target.commit(now)
    except BaseException as exc:
        undo.rollback()
        target.abort()
        if isinstance(exc, WeighthubError):
            raise
        if isinstance(exc, Exception):
            raise ApplyError(f"applying version {final.version} failed ({type(exc).__name__}: "
                             f"{exc}); the target was rolled back to its previous version") from exc
        raise
    return Outcome(now, clock.apply, clock.verify, digests)


def _check_unmoved(target: Target, held: Held | None, version: int, store: str) -> None:
    """Refuse (nothing applied) if the target no longer holds what the steps were staged
    against: another process committed to it between staging and the target's lock."""
    now = target.held()
    if now != held:
        def say(h: Held | None) -> str:
            return "nothing" if h is None else f"version {h.version} (root {h.root[:12]}…)"
        raise BaseMismatch(f"version {version} from {store} was staged against {say(held)}, but "
                           f"the target now holds {say(now)}, committed by another process "
                           "meanwhile; nothing applied: pull again")
