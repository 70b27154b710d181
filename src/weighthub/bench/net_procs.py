"""Processes of `weighthub bench net`: the hub, publisher agent and node daemons it spawns.

Each is a real process (loopback or inside a network namespace) whose stdout lines are read on
a thread, so every wait on it is bounded (`get(timeout)`); `stop` ends its whole process group.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import WeighthubError
from .netlab import NetLab, child_env

Spawn = Callable[[list[str], dict[str, str]], "subprocess.Popen[bytes]"]
Progress = Callable[[str], None]
START_S = 120.0  # process starts import torch: slow on a loaded 2-core machine
STEP_S = 120.0
RELAY_POLL_S = "2"
STORE_POLL_S = "0.1"


class BenchError(WeighthubError):
    """A benchmark process failed or did not answer in time."""


class Lines:
    """Reads a process's stdout lines on a thread; `get` waits with a timeout."""

    def __init__(self, proc: subprocess.Popen[bytes], name: str) -> None:
        self.proc, self.name = proc, name
        self.q: queue.Queue[tuple[float, str] | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.q.put((time.monotonic(), raw.decode(errors="replace")))
        self.q.put(None)

    def get(self, timeout: float) -> tuple[float, str]:
        try:
            item = self.q.get(timeout=timeout)
        except queue.Empty:
            raise BenchError(f"{self.name}: no output within {timeout:.0f}s") from None
        if item is None:
            raise BenchError(f"{self.name} exited ({self.proc.wait()})")
        return item

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class Agent(Lines):
    def call(self, op: str, timeout: float = STEP_S, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        self.proc.stdin.flush()
        doc = json.loads(self.get(timeout)[1])
        if not doc.pop("ok"):
            raise BenchError(f"{self.name}: {doc['error']}")
        return dict(doc)


class Node(Lines):
    """A `weighthub serve node --json` process; events are kept with their arrival time."""

    def __init__(self, proc: subprocess.Popen[bytes], name: str) -> None:
        super().__init__(proc, name)
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.address = ""

    def until(self, pred: Callable[[dict[str, Any]], bool], timeout: float) -> tuple[float, dict[str, Any]]:
        for t, e in self.events:
            if pred(e):
                return t, e
        end = time.monotonic() + timeout
        while True:
            t, line = self.get(max(0.01, end - time.monotonic()))
            try:
                e = json.loads(line)
            except ValueError:
                continue
            self.events.append((t, e))
            if e.get("event") == "listening":
                self.address = e["address"]
            if e.get("event") == "error":
                raise BenchError(f"{self.name}: {e['error']}")
            if pred(e):
                return t, e

    def synced(self, version: int, timeout: float = STEP_S) -> tuple[float, dict[str, Any]]:
        return self.until(lambda e: e.get("event") == "synced" and e["version"] == version, timeout)


class Cluster:
    """Spawns nodes for one region (a spawn function: loopback or a namespace)."""

    def __init__(self, spawn: Spawn, store: str, secret_file: Path, host: str, region: str,
                 env: dict[str, str]) -> None:
        self.spawn, self.store, self.secret_file = spawn, store, secret_file
        self.host, self.region, self.env = host, region, env
        self.count = 0

    def start(self, hub: str | None, n: int, tag: str) -> list[Node]:
        nodes = []
        # relay nodes learn of a version from the relayed manifest and poll the hub only as a
        # fallback; store nodes have only their poll of the store to learn from
        poll = RELAY_POLL_S if hub else STORE_POLL_S
        for _ in range(n):
            self.count += 1
            name = f"{tag}{self.count}"
            argv = [sys.executable, "-m", "weighthub.cli", "serve", "node", self.store, "memory://",
                    "--secret-file", str(self.secret_file), "--id", name, "--host", self.host,
                    "--labels", f"region={self.region},zone=z1,host={name}", "--poll", poll,
                    "--timeout", "5", "--json", *(["--hub", hub] if hub else [])]
            nodes.append(Node(self.spawn(argv, self.env), name))
        for nd in nodes:
            nd.until(lambda e: e.get("event") == "listening", START_S)
        return nodes


def spawner(lab: NetLab | None = None, ns: Any = None) -> Spawn:
    def spawn(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        kw: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE,
                              "stderr": subprocess.DEVNULL, "env": child_env(env)}
        if lab is not None:
            return lab.spawn(ns, argv, **kw)
        return subprocess.Popen(argv, start_new_session=True, **kw)
    return spawn
