"""Step 1 of a publish: the ranks agree on the version, its base and its tensor table.

Every rank gathers every rank's proposal (tensor table, shard boxes, baseline, asked version;
the committer adds the store's latest version when the group has no baseline, and the token
naming this publish's chunk directories) and checks the same gathered facts, so every rank
reaches the same plan or raises the same error, and nothing is written before they agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import BaseMismatch, ModelMismatch, VersionError
from ..layout import ShardBox, check_tiling
from ..tensors import TensorSpec, check_same_model, dtype_named
from .group import Failure, Group, raise_failures
from .shards import Table


@dataclass(frozen=True, slots=True)
class Proposal:
    """What a rank holds and asks for."""

    rank: int
    failure: Failure | None
    table: Table
    boxes: dict[str, ShardBox]
    base: tuple[int, str] | None  # committed (version, root) of the rank's baseline
    asked: int | None
    latest: int | None = None  # committer only: the store's latest version (looked up without a base)
    token: str = ""  # committer only: names this publish's chunk directories


@dataclass(frozen=True, slots=True)
class Plan:
    """What every rank agreed to publish."""

    version: int
    base: tuple[int, str] | None  # (version, root) the primary representation is a delta from
    specs: list[TensorSpec]
    token: str
    boxed: frozenset[int]  # tensors some rank holds strided: covered by boxes (spec §3)


def agree(group: Group, mine: Proposal, *, committer: int, own: BaseException | None,
          specs_before: list[TensorSpec] | None, tiled: dict[str, list[ShardBox]] | None
          ) -> tuple[Plan, dict[str, list[ShardBox]]]:
    """Gather every rank's proposal and check it; the plan and the layout checked.

    Args:
        own: this rank's own failure so far (raised as is once every rank has heard of it).
        specs_before: the tensor table of this rank's baseline (None without one).
        tiled: the layout checked by an earlier publish (not checked again when unchanged).

    Raises:
        the first failure of any rank; ModelMismatch (tables differ between ranks or from the
        baseline's); PlacementError (boxes that do not tile a tensor); BaseMismatch / VersionError
        (ranks disagree on the base or the version, or a version not after the latest).
    """
    props: list[Proposal] = group.all_gather(mine, "agreeing on the version")
    raise_failures([p.failure for p in props], group.rank, own)
    ref = props[0]
    for p in props[1:]:
        if p.table != ref.table:
            raise ModelMismatch(f"ranks disagree on the tensor table: rank {p.rank} has "
                                f"{_table_diff(ref.table, p.table)} (vs rank {ref.rank}); "
                                "every rank must pass the same tensor names")
    specs = [TensorSpec(n, dtype_named(d), tuple(shape)) for n, d, shape in ref.table]
    layout = {n: [p.boxes[n] for p in props] for n, _d, _s in ref.table}
    if layout != tiled:
        for name, _d, shape in ref.table:
            check_tiling(name, shape, list(enumerate(layout[name])))
    bases = {p.base for p in props}
    if len(bases) > 1:
        held = "; ".join(f"rank {p.rank}: " + (f"v{p.base[0]} (root {p.base[1][:12]}…)"
                                               if p.base else "nothing") for p in props)
        raise BaseMismatch(f"ranks disagree on the committed base ({held}); nothing was "
                           "written: restart every rank's ShardedPublisher together")
    asked = {p.asked for p in props}
    if len(asked) > 1:
        raise VersionError("ranks disagree on the version to publish ("
                           + "; ".join(f"rank {p.rank} asks {p.asked}" for p in props)
                           + "); nothing was written")
    base = ref.base
    if base is not None and specs_before is not None:
        check_same_model(specs_before, specs, "the published state")
    # another publisher committing on top of our base is caught by the create-only commit
    # (ObjectExists): looking the latest up here would list every version on every publish
    head = props[committer]
    floor = max(-1 if base is None else base[0], -1 if head.latest is None else head.latest)
    version = ref.asked if ref.asked is not None else floor + 1
    if version <= floor:
        raise VersionError(f"version {version} is not after the store's latest "
                           f"{head.latest} / the base {base and base[0]}; nothing was written")
    boxed = frozenset(i for i, (name, _d, _s) in enumerate(ref.table)
                      if any(b.primary and 0 < b.run_len < b.numel for b in layout[name]))
    return Plan(version, base, specs, head.token, boxed), layout


def _table_diff(a: Table, b: Table) -> str:
    da, db = {n: (d, s) for n, d, s in a}, {n: (d, s) for n, d, s in b}
    diffs = [f"{n!r} {db.get(n)} vs {da.get(n)}" for n in sorted(set(da) | set(db))
             if da.get(n) != db.get(n)]
    return ", ".join(diffs[:5])
