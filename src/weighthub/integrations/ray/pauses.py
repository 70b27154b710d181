"""Pauses in turn: rollout engines sharing one host's cores apply their refits one at a time.

Engines whose weights live in host memory (vLLM's CPU build) compete for the same cores and
memory bandwidth when they pause together: the apply is a scatter into the weights (memory
bound) on every core, so two pauses at once each last about as long as both in turn. In turn,
the last engine serves the new version no later, and each engine stops serving for its own
apply only. Engines on GPUs apply on their own devices and pause together.

`pause_turn(stage_dir)` holds an exclusive flock on `pauses.lock` in the host's staging
directory, which the engines of one node share. Take it before stopping generation, so the
wait for another engine's pause is spent serving, not paused. The kernel drops the lock of a
holder that dies. The wait is bounded: past `timeout_s` the engine pauses without its turn and
says so (`Turn.held`). Turns only order pauses; no correctness depends on them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ...sources.staging import flock_within

TURN_TIMEOUT_S = 30.0  # a pause takes well under a second; longer means a stuck holder
_POLL_MAX_S = 0.002  # the next engine starts within ~2 ms of the previous one's release


@dataclass(slots=True)
class Turn:
    held: bool = False  # False: paused without the lock (disabled, or the wait timed out)
    wait_s: float = 0.0  # serving meanwhile


@contextlib.contextmanager
def pause_turn(stage_dir: str | None, *, timeout_s: float = TURN_TIMEOUT_S) -> Iterator[Turn]:
    """This host's pause turn (None: no turns, pause at once). See the module doc."""
    turn = Turn()
    if stage_dir is None:
        yield turn
        return
    path = Path(stage_dir) / "pauses.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        t0 = time.perf_counter()
        turn.held = flock_within(fd, fcntl.LOCK_EX, timeout_s, max_sleep=_POLL_MAX_S)
        turn.wait_s = time.perf_counter() - t0
        yield turn
    finally:
        os.close(fd)  # releases the lock
