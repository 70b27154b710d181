"""The vLLM worker extension's Receiver target (`engines.vllm`): the canonical tensors, held in a
host mirror or in the engine's own parameters, and what commit and abort do to the engine."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from .. import errors
from ..digest import digest_bits
from ..format import Manifest
from ..store import Store
from ..targets.base import Held, TargetWrapper
from ..targets.state_dict import StateDictTarget
from ..targets.vllm_engine import EnginePlacement, PushReport
from ..targets.vllm_placement import Group, expand
from ..targets.vllm_prepack import Built, Prepacker
from ..tensors import bits
from .vllm_checks import digests_of
from .vote import Vote

if TYPE_CHECKING:
    from ..receive import Receiver, Staged

# "0": a staging builds no kernels (the loader rebuilds them in the pause; no second copy of the
# changed layers while staging). Read at bind.
PREPACK = "WEIGHTHUB_VLLM_PREPACK"


class EngineTarget(TargetWrapper):
    """The canonical tensors as the Receiver's target, in one of two modes.

    mirror    `mirror` is a host copy; commit pushes the changed tensors, expanded to whole
              fused groups, through vLLM's loader; abort reloads them from the rolled-back mirror.
              Where a staging built the packed kernels of the version's layers (`prestage`,
              `targets.vllm_prepack`), commit installs those instead and writes the plain
              parameters from the mirror: the loader takes only what they do not cover.
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
        self.prepacker: Prepacker | None = None  # mirror mode: kernels a staging may build
        self._built: Built | None = None  # kernels built for the staged version (`prestage`)
        # a second copy of the mirror that `prestage` brings to the staged version; once that
        # version commits it holds the mirror's bits, so the next staging copies nothing
        self._scratch = StateDictTarget({})
        self._installed: tuple[Built, list[str]] | None = None  # (kernels, plain names) this commit

    def prove_kernels(self) -> dict[str, str]:
        """Mirror mode: find the layers whose kernels a staging may build (`vllm_prepack`),
        proven against the engine as it serves now; the refused modules and why."""
        self.prepacker = None
        flag = os.environ.get(PREPACK, "1")
        if flag not in ("0", "1"):
            raise errors.UsageError(f"{PREPACK}={flag!r}: set it to 1 (build the kernels of a "
                                    "staged version while it stages, the default) or 0 (the "
                                    "loader rebuilds them in the pause)")
        if self.in_place or flag == "0":
            return {}
        p = self.placement
        prepacker = Prepacker(p.model, p.groups, p.packed, p.tied)
        prepacker.prove(self.mirror.state)
        self.prepacker = prepacker if prepacker.recipes else None
        return dict(prepacker.refused)

    def prestage(self, receiver: Receiver, staged: Staged) -> float:
        """Build the kernels of the layers `staged` changes, beside the serving ones (mirror
        mode, with proven recipes); the seconds it took. Commit installs them if it commits
        that very version; a later staging replaces them."""
        self._built = None
        arrives = staged.arrives
        if self.prepacker is None or arrives is None:
            return 0.0
        t0 = time.perf_counter()
        modules, _covered, _left = self._plan({e.name: e.digest for e in arrives.tensors})
        if modules:
            receiver.preview(staged, self._scratch, self.mirror.state)
            self._built = self.prepacker.build(modules, self._scratch.state, arrives.version,
                                               arrives.root)
        return time.perf_counter() - t0

    def _plan(self, new: dict[str, str]) -> tuple[list[str], list[Group], list[Group]]:
        """(modules whose kernels to build, groups they and plain writes cover, groups left to
        the loader) for a version with tensor digests `new`."""
        changed = [n for n, d in new.items() if self.digests.get(n) != d]
        groups = expand(changed, self.placement.groups)
        if self.prepacker is None:
            return [], [], groups
        plain = self._plain(n for g in groups for n in g.names)
        users: dict[str, list[str]] = {}
        for user, owner in self.placement.tied:
            users.setdefault(owner, []).append(user)
        covered = [g for g in groups if self.prepacker.covers(g, plain, users.get(g.module, []))]
        left = [g for g in groups if g not in covered]
        modules = [m for g in covered for m in (g.module, *users.get(g.module, []))
                   if m in self.prepacker.recipes]
        return modules, covered, left

    def _plain(self, names: Iterable[str]) -> set[str]:
        """The names the engine holds as plain copies that the pause may write."""
        state, p = self.mirror.state, self.placement
        return {n for n in names if n in p.xor_names and p.engine_view(n, state[n]) is not None}

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
        built, self._built = self._built, None
        if self.in_place:  # the engine's parameters already hold the verified new bits
            self._pushed = expand(changed, self.placement.groups)  # before: abort restores
            t0 = time.perf_counter()
            self.report = PushReport(paths=dict.fromkeys(changed, "in place"))
            self.report.refreshed = self.placement.refresh_tied(self._pushed)
            self.report.seconds = time.perf_counter() - t0
        elif built is None or (built.version, built.root) != (held.version, held.root) \
                or not self._install(built, new):  # nothing built for this version: the loader
            self._pushed = expand(changed, self.placement.groups)
            self.report = self.placement.push(changed, self.mirror.state)
        if self.vote is not None:  # every rank pushed and verified: commit together or abort
            self.vote.reached_commit()
        self.mirror.commit(held)
        self.digests = new
        self._pushed = []
        self._installed = None  # the kernels it replaced are dropped with it

    def _install(self, built: Built, new: dict[str, str]) -> bool:
        """The pause with kernels built while staging: write the plain parameters of the groups
        they cover from the mirror (it holds the new, verified bits: a copy, so not read back),
        install the kernels, and push the groups left through the loader. False, touching
        nothing, when the kernels built are not the ones this commit needs (the engine's
        parameters were re-created since staging: the loader then takes every group)."""
        t0 = time.perf_counter()
        modules, covered, left = self._plan(new)
        if set(modules) != set(built.kernels):
            return False
        state, prepacker = self.mirror.state, self.prepacker
        assert prepacker is not None  # built by it
        plain = sorted(self._plain(n for g in covered for n in g.names))
        self._pushed = left  # before writing anything: abort restores these too
        self._installed = (built, plain)
        for n in plain:
            view = self.placement.engine_view(n, state[n])
            assert view is not None  # `_plain` found it
            view.copy_(state[n])
        prepacker.install(built)
        report = (self.placement.push([n for g in left for n in g.names], state) if left
                  else PushReport())
        report.paths |= {n: "plain" if n in plain else "prepacked" for g in covered for n in g.names}
        report.groups += len(covered)
        tied = {user for user, _owner in self.placement.tied}
        report.refreshed += [m for m in built.kernels if m in tied]
        report.seconds = time.perf_counter() - t0
        self.report = report
        return True

    def abort(self) -> None:
        self.mirror.abort()
        installed, self._installed = self._installed, None
        if installed is not None:  # the mirror holds the previous version's bits again
            built, plain = installed
            assert self.prepacker is not None
            self.prepacker.restore(built)
            for n in plain:
                view = self.placement.engine_view(n, self.mirror.state[n])
                if view is not None:
                    view.copy_(self.mirror.state[n])
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
