"""The publisher side's handles on demo worker processes.

Every wait is bounded: replies are read by one thread per worker into a queue, and the caller
waits on the queue with a timeout. A worker that dies, stalls or answers garbage raises
WorkerFailed; `WorkerPool.close()` (always call it, e.g. in a `finally`) asks every worker to
quit, then kills and reaps whatever is left, so no process outlives the demo.
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any

from ..errors import WeighthubError

REPLY_TIMEOUT_S = 120.0
QUIT_GRACE_S = 5.0
_EOF = object()


class WorkerFailed(WeighthubError):
    """A demo worker process died, timed out or sent something that is not a reply."""


class Worker:
    """One receiver process (`python -m weighthub.demo.worker STORE`)."""

    def __init__(self, name: str, store: str) -> None:
        self.name = name
        # stderr goes to a file: shown when the worker fails, never interleaved with the report
        self._log: IO[bytes] = tempfile.TemporaryFile(prefix=f"weighthub-{name}-")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weighthub.demo.worker", store],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            text=True, encoding="utf-8", bufsize=1,
        )
        if self.proc.stdin is None or self.proc.stdout is None:  # cannot happen with PIPE
            raise WorkerFailed(f"{name}: no pipes to the worker process")
        self._stdin: IO[str] = self.proc.stdin
        self._stdout: IO[str] = self.proc.stdout
        self._replies: queue.Queue[Any] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        for line in self._stdout:
            self._replies.put(line)
        self._replies.put(_EOF)

    def send(self, command: str) -> None:
        try:
            self._stdin.write(command + "\n")
            self._stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerFailed(f"{self.name} (pid {self.pid}) is gone: {exc}{self._tail()}") from exc

    def receive(self, timeout: float = REPLY_TIMEOUT_S) -> dict[str, Any]:
        """The next reply, or WorkerFailed after `timeout` seconds / when the worker exits."""
        try:
            line = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise WorkerFailed(f"{self.name} (pid {self.pid}) did not answer within {timeout:.0f} s"
                               f"{self._tail()}") from None
        if line is _EOF:
            code = self.proc.wait(timeout=QUIT_GRACE_S)
            raise WorkerFailed(f"{self.name} (pid {self.pid}) exited with code {code}{self._tail()}")
        try:
            reply = json.loads(line)
        except ValueError:
            raise WorkerFailed(f"{self.name} sent a line that is not JSON: {line[:200]!r}") from None
        if not isinstance(reply, dict):
            raise WorkerFailed(f"{self.name} sent {reply!r}, expected a JSON object")
        return reply

    def request_quit(self) -> None:
        """Ask the worker to exit (quit command, then end of input); does not wait."""
        if self.proc.poll() is None and not self._stdin.closed:
            try:
                self.send("quit")
                self._stdin.close()
            except (WorkerFailed, OSError):
                pass

    def close(self) -> None:
        """Ask the worker to quit; kill it if it has not exited after a grace period. Reaps it."""
        self.request_quit()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=QUIT_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=QUIT_GRACE_S)
        self._reader.join(timeout=QUIT_GRACE_S)
        for stream in (self._stdin, self._stdout):
            with contextlib.suppress(OSError):
                stream.close()
        self._log.close()

    def _tail(self, limit: int = 2000) -> str:
        try:
            self._log.flush()
            self._log.seek(0)
            text = self._log.read().decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            return ""
        return f"\n--- {self.name} stderr (tail) ---\n{text[-limit:]}" if text else ""


class WorkerPool:
    """Starts `count` workers on one store and talks to all of them at once."""

    def __init__(self, store: str, count: int, *, timeout: float = REPLY_TIMEOUT_S) -> None:
        """Spawn the workers (they import and warm up in the background); see `wait_ready`."""
        self.timeout = timeout
        self.workers: list[Worker] = []
        try:
            for i in range(count):
                self.workers.append(Worker(f"receiver-{i}", store))
        except BaseException:
            self.close()
            raise

    def wait_ready(self) -> None:
        """Wait (bounded) until every worker has said it is ready."""
        for w in self.workers:
            reply = w.receive(self.timeout)
            if not reply.get("ready"):
                raise WorkerFailed(f"{w.name} started with {reply!r} instead of a ready line")

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    def sync(self, version: int) -> list[dict[str, Any]]:
        """Tell every worker to sync to `version` (they run in parallel); collect the replies."""
        for w in self.workers:
            w.send(f"sync {version}")
        deadline = time.monotonic() + self.timeout
        return [w.receive(max(0.0, deadline - time.monotonic())) for w in self.workers]

    def close(self) -> None:
        """Stop every worker: all are asked to quit first, so their grace periods overlap."""
        for w in self.workers:
            w.request_quit()
        for w in self.workers:
            try:
                w.close()
            except Exception:  # keep closing the others; kill as the last resort
                w.proc.kill()
                w.proc.wait()
