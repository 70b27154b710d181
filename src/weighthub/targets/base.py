"""The Target protocol: what a receiver needs from the place weights live.

Lifecycle (the receiver drives it, one transaction at a time):
    held()            the committed version the target holds, or None
    specs()           its tensor table, or None if it holds nothing yet
    peek()            read-only bit views of what it holds now (while staging, before the pause)
    open(specs)       writable bit views by canonical name; materializes an empty target
                      (allocated, not yet visible under its final name/place)
    ... the receiver applies, verifies digests ...
    journal_step(plan)  optional, before each step is applied: `plan()` lists the ranges (and
                      positions) the step may write; a file target updated in place journals
                      their old words durably first, for recovery after a crash
    commit(held)      make the new version durable and visible; record what is held
    abort()           discard whatever open() materialized (bits were already rolled back)

A target shared between processes (a file) also locks itself from open to commit/abort, and
held() inside that transaction answers what it held when opened.

`TargetWrapper` forwards all of these to an inner target; wrappers (fp8 blocks, read leases,
an engine's parameters) override only what they change. `weighthub.testing.TargetTests` is the
behaviour every target must have.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..tensors import TensorSpec


@dataclass(frozen=True, slots=True)
class Held:
    """What a target holds: a committed version of a model from a store."""

    store: str
    model: str
    version: int
    root: str


class Target(Protocol):
    def held(self) -> Held | None: ...

    def specs(self) -> list[TensorSpec] | None: ...

    def peek(self) -> dict[str, np.ndarray]: ...

    def open(self, specs: list[TensorSpec]) -> dict[str, np.ndarray]: ...

    def commit(self, held: Held) -> None: ...

    def abort(self) -> None: ...


class TargetWrapper:
    """A Target that forwards every call to `inner`; subclasses override only what they change.

    Wrappers add behaviour around a target's lifecycle (a lease gate around open/commit/abort,
    re-quantization or an engine push at commit), while the bits the receiver applies and
    verifies stay the inner target's. A subclass that overrides `open`, `commit` or `abort`
    calls the inner one itself (`self.inner.commit(held)`), at the point its own work needs.
    """

    def __init__(self, inner: Target) -> None:
        self.inner = inner

    def held(self) -> Held | None:
        return self.inner.held()

    def specs(self) -> list[TensorSpec] | None:
        return self.inner.specs()

    def peek(self) -> dict[str, np.ndarray]:
        return self.inner.peek()

    def open(self, specs: list[TensorSpec]) -> dict[str, np.ndarray]:
        return self.inner.open(specs)

    def journal_step(self, plan: Plan) -> None:
        journal_step(self.inner, plan)

    def commit(self, held: Held) -> None:
        self.inner.commit(held)

    def abort(self) -> None:
        self.inner.abort()


# what a step may write: (words of a range of a view, positions in it or None: all of them),
# or None when it cannot be known ahead (then a journaling target covers all it maps)
Plan = Callable[[], "list[tuple[np.ndarray, np.ndarray | None]] | None"]


def journal_step(target: Target, plan: Plan) -> None:
    """Offer `plan` to `target` before a step (`journal_step` is optional in the protocol);
    the plan is computed only if the target journals."""
    hook = getattr(target, "journal_step", None)
    if hook is not None:
        hook(plan)


def unique_views(views: dict[str, np.ndarray]) -> dict[str, str]:
    """Map each name to the first name sharing its exact memory (tied weights).

    Applying a delta twice through two aliases of one buffer would corrupt it, so the receiver
    applies only through the first name and checks the others' digests.
    """
    first: dict[tuple[int, int, str], str] = {}
    out = {}
    for name, v in views.items():
        key = (v.ctypes.data, v.size, v.dtype.str)
        out[name] = first.setdefault(key, name)
    return out
