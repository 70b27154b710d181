"""A cross-process lock on one file target: one transaction at a time (flock(2)).

Two receivers (processes, or two target objects in one process) bringing the same output to
different versions at once would interleave their writes and sidecars. Each transaction holds
an exclusive `flock` on a lock file next to the target from `open` to `commit`/`abort`; another
waits for it up to a bounded timeout, then fails with `TargetBusy` saying what the target holds.

The lock file (`.NAME.weighthub-lock` beside the target) is never deleted: removing a lock file
while another process waits on its inode would let two processes believe they hold the lock.
The kernel drops a flock when its holder dies (kill -9 included), so a crash never wedges it.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import TargetBusy

_POLL_S = (0.01, 0.2)  # first and longest sleep between attempts (a commit takes ms to seconds)


class TargetLock:
    """A reentrant (per object), process-exclusive lock on `path`.

    Args:
        path: the lock file (created if missing; its directory must exist or is created).
        timeout: seconds `acquire` waits for another holder before raising TargetBusy.
        describe: what the target holds now, for the TargetBusy message (read without the lock).
    """

    def __init__(self, path: Path, *, timeout: float, describe: Callable[[], str]) -> None:
        self.path = path
        self.timeout = timeout
        self.describe = describe
        self._fd: int | None = None
        self._depth = 0

    @property
    def held(self) -> bool:
        return self._depth > 0

    def acquire(self) -> None:
        """Take the lock (again, if this object holds it). Raises TargetBusy after `timeout`."""
        if self._depth:
            self._depth += 1
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + self.timeout
        sleep = _POLL_S[0]
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise self._busy(fd) from None
                    time.sleep(min(sleep, left))
                    sleep = min(sleep * 2, _POLL_S[1])
            # who holds it, for the messages of those who wait (advisory: read without a lock)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._depth = fd, 1

    def release(self) -> None:
        """Drop one level; the last one unlocks (closing the descriptor releases the flock)."""
        if not self._depth:
            return
        self._depth -= 1
        if not self._depth and self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> TargetLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _busy(self, fd: int) -> TargetBusy:
        try:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        except OSError:
            holder = "unknown"
        return TargetBusy(f"{self.path.name.removeprefix('.').removesuffix('.weighthub-lock')} in "
                          f"{self.path.parent} is being changed by another process (pid {holder}) "
                          f"and stayed locked for {self.timeout:g}s; it holds {self.describe()}; "
                          "nothing was changed: retry when that transaction ends, or wait longer "
                          "(lock_timeout)")


__all__ = ["TargetLock"]
