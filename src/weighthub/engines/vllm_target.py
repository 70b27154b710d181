"""The vLLM worker extension's Receiver target (`engines.vllm`): the canonical tensors, held in a
host mirror or in the engine's own parameters, and what commit and abort do to the engine."""

from __future__ import annotations

import time

import torch

from .. import errors
from ..digest import digest_bits
from ..format import Manifest
from ..store import Store
from ..targets.base import Held, TargetWrapper
from ..targets.state_dict import StateDictTarget
from ..targets.vllm_engine import EnginePlacement, PushReport
from ..targets.vllm_placement import Group, expand
from ..tensors import bits
from .vllm_checks import digests_of
from .vote import Vote


class EngineTarget(TargetWrapper):
    """The canonical tensors as the Receiver's target, in one of two modes.

    mirror    `mirror` is a host copy; commit pushes the changed tensors, expanded to whole
              fused groups, through vLLM's loader; abort reloads them from the rolled-back mirror.
    in place  `mirror` is a StateDictTarget over the engine's own parameters
              (`EnginePlacement.plain_views`): the Receiver applies, verifies and rolls back in
              the engine's memory, so commit only re-processes tied users (lm_head) and no host
              copy of the model exists.
    Reads (held, specs, peek) and open are the mirror's (TargetWrapper).
    """

    def __init__(self, mirror: StateDictTarget, placement: EnginePlacement, store: Store,
                 digests: dict[str, str], *, in_place: bool = False) -> None:
        super().__init__(mirror)
        self.mirror = mirror  # typed: the engine pushes from its `state`
        self.placement = placement
        self.store = store
        self.digests = digests  # per-tensor digests of the committed version (from its manifest)
        self.in_place = in_place
        self.report = PushReport()
        self._pushed: list[Group] = []
        self.vote: Vote | None = None  # a TP commit vote this transaction takes part in
        self.expected: Manifest | None = None  # the staged version's manifest (`expect`)

    def expect(self, manifest: Manifest | None) -> None:
        """The manifest of the version the next commit arrives at, read while staging: its
        digests then need no store read in the pause (the store may be across a slow link)."""
        self.expected = manifest

    def _digests_at(self, held: Held) -> dict[str, str]:
        m, self.expected = self.expected, None
        if m is not None and (m.version, m.root) == (held.version, held.root):
            return {e.name: e.digest for e in m.tensors}
        return digests_of(self.store, held.version)

    def commit(self, held: Held) -> None:
        new = self._digests_at(held)
        changed = [n for n, d in new.items() if self.digests.get(n) != d]
        self._pushed = expand(changed, self.placement.groups)  # before pushing: abort restores
        if self.in_place:  # the engine's parameters already hold the verified new bits
            t0 = time.perf_counter()
            self.report = PushReport(paths=dict.fromkeys(changed, "in place"))
            self.report.refreshed = self.placement.refresh_tied(self._pushed)
            self.report.seconds = time.perf_counter() - t0
        else:
            self.report = self.placement.push(changed, self.mirror.state)
        if self.vote is not None:  # every rank pushed and verified: commit together or abort
            self.vote.reached_commit()
        self.mirror.commit(held)
        self.digests = new
        self._pushed = []

    def abort(self) -> None:
        self.mirror.abort()
        groups, self._pushed = self._pushed, []
        if not groups:
            return
        try:  # the mirror (in place: the engine) already holds the previous version's bits again
            if self.in_place:
                self.placement.refresh_tied(groups)
            else:
                self.placement.overwrite(groups, self.mirror.state)
        except Exception as exc:
            raise errors.ApplyError(
                f"restoring {len(groups)} group(s) of the engine to the previous version failed "
                f"({type(exc).__name__}: {exc}); the engine may serve mixed weights: restart it"
            ) from exc

    def overwrite_all(self, state: dict[str, torch.Tensor]) -> int:
        """Every group through vLLM's loader from `state` (the committed bits); the group count.
        In place, the views are then taken afresh: the loader may re-create parameters."""
        groups = sorted(set(self.placement.groups.values()), key=lambda g: g.module)
        self.placement.overwrite(groups, state)
        if self.in_place:
            views, why = self.placement.plain_views(state)
            if not views:
                raise errors.PlacementError(f"after vLLM's reload the engine no longer holds its "
                                            f"weights as plain copies ({why}): bind it again")
            self.mirror.state.update(views)
        return len(groups)

    def canonical_digests(self) -> tuple[dict[str, str], dict[str, str]]:
        """Digests of the canonical view: (read back from the engine, from the mirror)."""
        engine, mirror = {}, {}
        for name, t in self.mirror.state.items():
            view = t if self.in_place else self.placement.engine_view(name, t)
            if view is not None:
                engine[name] = _digest(view)
            else:
                mirror[name] = _digest(t)
        return engine, mirror


def _digest(t: torch.Tensor) -> str:
    return digest_bits(bits(t if t.device.type == "cpu" else t.cpu())).hex()
