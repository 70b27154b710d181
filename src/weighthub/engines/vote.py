"""The commit vote: the ranks of one tensor-parallel engine commit a version together, or none.

    prepare   every rank stages, applies into its mirror, pushes into its shard of the engine
              and verifies, then holds its transaction open (the commit waits) and votes yes;
              a rank that fails on the way has already rolled back, and votes no
    decide    the driver commits every rank if all voted yes, else aborts every rank: each rolls
              back its mirror (undo log) and restores the groups it pushed, so every rank serves
              the previous version, bit-exactly
    timeout   a rank without a decision `timeout_s` after its prepare began (the driver or
              another rank died mid-vote) aborts by itself. The driver sends "commit" only while
              `timeout_s - margin` has not passed since it sent the prepare, which every rank
              received after that: so a commit never reaches a rank that has already aborted

A `Vote` is one rank's side. The transaction runs on a thread of its own (the RPC that prepares
must return while the commit waits); `EngineTarget.commit` calls `reached_commit` after its
push, so a no raises inside the transaction and the receive engine's rollback undoes it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import ApplyError, UsageError

PREPARED, DONE, FAILED = "prepared", "done", "failed"


def commit_margin(timeout_s: float) -> float:
    """How long before the ranks' deadline the driver stops sending "commit": more than an
    RPC's latency."""
    return max(1.0, 0.1 * timeout_s)


class Vote:
    """One rank's vote on one version. `start(fn)`, `wait_ready()`, then `decide(commit)`."""

    def __init__(self, timeout_s: float) -> None:
        if not 0 < timeout_s <= 3600:
            raise UsageError(f"vote timeout must be in (0, 3600] seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s  # from the prepare, not from the commit
        self._ready = threading.Event()  # reached the commit, or finished without one
        self._decided = threading.Event()
        self._commit = False
        self._prepared = False
        self._result: dict[str, Any] | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, transaction: Callable[[], dict[str, Any]]) -> None:
        def run() -> None:
            try:
                self._result = transaction()
            except BaseException as exc:  # handed to decide()
                self._error = exc
            finally:
                self._ready.set()

        self._thread = threading.Thread(target=run, name="weighthub-vote", daemon=True)
        self._thread.start()

    def reached_commit(self) -> None:
        """Called inside the transaction, everything applied and pushed: vote yes and wait.

        Raises:
            ApplyError: the vote aborted, or no decision came within the timeout (rolled back).
        """
        self._prepared = True
        self._ready.set()
        if not self._decided.wait(max(0.0, self._deadline - time.monotonic())):
            raise ApplyError(f"no commit decision within {self.timeout_s:g} s (the driver or "
                             "another rank died mid-vote): this rank aborted and serves its "
                             "previous version")
        if not self._commit:
            raise ApplyError("another rank could not prepare this version: the vote aborted "
                             "every rank, which serve their previous version")

    def wait_ready(self) -> str:
        """PREPARED (waiting in its commit), DONE (finished without committing anything new)
        or FAILED (the transaction failed and rolled back)."""
        self._ready.wait()
        if self._prepared:
            return PREPARED
        return FAILED if self._error is not None else DONE

    @property
    def error(self) -> BaseException | None:
        return self._error

    def decide(self, commit: bool) -> dict[str, Any]:
        """Commit (or abort) and wait for the transaction to end; its result.

        Raises:
            Whatever the transaction raised (an abort: ApplyError after the rollback).
        """
        self._commit = commit
        self._decided.set()
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        if self._result is None:  # pragma: no cover - the thread either returns or raises
            raise ApplyError("the vote's transaction ended without a result")
        return self._result
