"""Which of a chunk's staged segments the pause scatters as rows, chosen while staging.

Staging prepares a chunk's small gap-coded segments of one dtype as the rows of one
`PreparedGroup` (`codec.prepared_many`); the pause writes 32 or more of them in one call
(`apply_prepared_rows`) and every other segment one at a time. Choosing the rows reads each
segment's view and its address: ~1.5 µs of Python a segment, which a pause into 8000 small
tensors paid ~12 ms for. So staging chooses them (`plan_rows`, off the pause) against the views
it read, and the pause takes that plan when its views hold the very same arrays, none of them
tied to an earlier name (`RowPlan.holds`: then the staged addresses are the views' own); else
it plans again, with its own views and ties.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..codec.prepared import SEALED_SCATTER, PreparedSegment
from ..codec.prepared_many import PreparedGroup
from ..codec.segment import Segment
from ..targets.base import host_words_at
from ..tensors import TensorSpec, Words

# From this many rows of one group in a chunk they are scattered in one call; fewer go one by
# one through `apply_segment`, as larger segments do (their words outweigh the call).
ROWS_AT_ONCE = 32


@dataclass(frozen=True, slots=True, eq=False)
class Rows:
    """Rows of one group scattered in one call: `rows` (increasing) of `group`, for the chunk's
    segments `segments`, each into the words at `dsts` (the address of its segment's range) of
    view `keep[i]` of tensor `tensors[i]` named `names[i]`. `keep` holds the arrays the
    addresses point into."""

    group: PreparedGroup
    rows: np.ndarray
    dsts: np.ndarray
    segments: list[int]
    tensors: list[int]
    names: list[str]
    keep: list[np.ndarray]


@dataclass(frozen=True, slots=True, eq=False)
class RowPlan:
    """A chunk's segments as the pause applies them: `batches` scattered as rows, `others`
    (indices into the chunk's segments, increasing) one by one."""

    batches: tuple[Rows, ...]
    others: tuple[int, ...]

    @classmethod
    def of(cls, batches: list[Rows], count: int) -> RowPlan:
        """The plan of a chunk of `count` segments: `batches`, and every other one alone."""
        single = np.ones(count, np.bool_)
        for b in batches:
            single[b.segments] = False
        return cls(tuple(batches), tuple(np.flatnonzero(single).tolist()))

    def holds(self, views: Mapping[str, Words], alias: Mapping[str, str]) -> bool:
        """Do `views` hold the arrays this plan was made against, each under its own name (not
        tied to an earlier one)? One dict look-up each, against ~1.5 µs to plan again.

        Identity, not equal bits: the staged addresses are valid only in those very arrays, and
        incremental verification takes the rows' digest changes from the staged lanes without
        reading memory again, so words written through stale addresses (a tensor given new
        storage after staging) would pass it while the target kept its old bits."""
        return all(views.get(n) is v and alias.get(n) == n
                   for b in self.batches for n, v in zip(b.names, b.keep, strict=True))


# a row as the planners collect it: (segment index, row, address, name, view, tensor)
Row = tuple[int, int, int, str, np.ndarray, int]


def rows_of(group: PreparedGroup, items: list[Row]) -> Rows | None:
    """`items` (rows of `group`, increasing) as one batch, or None for fewer than ROWS_AT_ONCE
    (those go one by one)."""
    if len(items) < ROWS_AT_ONCE:
        return None
    m = len(items)
    return Rows(group, np.fromiter((r[1] for r in items), np.int64, m),
                np.fromiter((r[2] for r in items), np.int64, m), [r[0] for r in items],
                [r[5] for r in items], [r[3] for r in items], [r[4] for r in items])


def plan_rows(segments: Sequence[Segment], specs: list[TensorSpec], views: Mapping[str, Words],
              prepared: Sequence[PreparedSegment | None] | None,
              alias: Mapping[str, str]) -> RowPlan:
    """The rows among `segments` (with their staged `prepared`; None: none staged) as the pause
    finds them in `views`: each small segment staged in bulk (below SEALED_SCATTER changes)
    into contiguous host words of its word type that hold its range, where its group has at
    least ROWS_AT_ONCE of them. A segment tied to an earlier name (`alias`) is left to the
    others, which the pause skips. (Staging plans from what it prepared: `stage`.)"""
    if prepared is None:
        return RowPlan((), tuple(range(len(segments))))
    groups: dict[int, tuple[PreparedGroup, list[Row]]] = {}
    for i, (seg, prep) in enumerate(zip(segments, prepared, strict=True)):
        if prep is None or prep.group is None or prep.pos.size >= SEALED_SCATTER:
            continue
        name = specs[seg.tensor].name
        words = host_words_at(views, name) if alias[name] == name else None
        if words is None:
            continue
        view, address, dtype, size = words
        if dtype != prep.old.dtype or seg.stop > size or seg.stop - seg.start != prep.numel:
            continue  # `apply_segment` refuses what does not fit
        groups.setdefault(id(prep.group), (prep.group, []))[1].append(
            (i, prep.row, address + seg.start * dtype.itemsize, name, view, seg.tensor))
    made = [rows_of(group, items) for group, items in groups.values()]
    return RowPlan.of([b for b in made if b is not None], len(segments))
