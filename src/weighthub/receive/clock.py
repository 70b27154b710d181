"""Where a transaction's pause goes: apply and verify seconds, kept out of the apply loop.

The engine brackets its phases with `PhaseClock.phase`; apply and incremental verification
interleave on the apply threads (each chunk's digest change is taken by the thread that just
applied it), so `PhaseClock.shared` splits that wall time between the two in proportion to the
threads' busy time in each.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(slots=True)
class Busy:
    """Thread busy seconds of one shared phase, summed over the threads (filled by the caller)."""

    apply: float = 0.0
    verify: float = 0.0


@dataclass(slots=True)
class PhaseClock:
    """Wall seconds per phase ("apply", "verify") of one transaction."""

    seconds: dict[str, float] = field(default_factory=lambda: {"apply": 0.0, "verify": 0.0})

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t

    @contextmanager
    def shared(self) -> Iterator[Busy]:
        """Wall time in which apply and verify interleave on threads; the caller records the
        threads' busy seconds in the yielded `Busy`."""
        busy = Busy()
        t = time.perf_counter()
        try:
            yield busy
        finally:
            wall = time.perf_counter() - t
            share = busy.verify / (busy.apply + busy.verify) if busy.verify else 0.0
            self.seconds["apply"] += wall * (1 - share)
            self.seconds["verify"] += wall * share

    @property
    def apply(self) -> float:
        return self.seconds["apply"]

    @property
    def verify(self) -> float:
        return self.seconds["verify"]
