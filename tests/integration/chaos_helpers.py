"""The chaos suite's cluster: a hub, a publisher, nodes and a receiver as real processes, and
what a round checks them by.

`Cluster` starts and restarts every process on loopback (the hub on a fixed port and database
so that a restarted hub is the same hub; nodes with the same id, output file and cache), and
kills each with SIGKILL on request. Publisher, receiver and nodes (`weighthub serve node`) are
started from a warm standby process (chaos_child.py), so a restart does not pay torch's import
again. `Cluster.close` kills and reaps whatever is still running.

What a receiver holds is read from its safetensors file and sidecar as a `Holding`: the
sidecar's version, root and state, and a fingerprint (SHA-256 over names, dtypes, shapes and
the integer words) of the file's bits, which the test compares with the fingerprint of the
state it asked the publisher to commit as that version.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from deadlines import PROCESS_S
from hub_helpers import HubProcess
from node_helpers import child_env

from weighthub.net.server import ChunkServer
from weighthub.store import LocalStore
from weighthub.targets import load_checkpoint
from weighthub.targets.safetensors_file import SIDECAR_FILE_SUFFIX
from weighthub.tensors import bits

CHILD = str(Path(__file__).with_name("chaos_child.py"))
SPARES = 2  # standbys kept warming: two restarts in a row (a round's kill, then the next) wait for none
Event = dict[str, Any]


def fingerprint(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 of a state's names, dtypes, shapes and bits (integer words, never floats)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(bits(t.contiguous()).tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class Holding:
    """What a safetensors target holds: the sidecar's claim and the file's fingerprint."""

    version: int | None  # None: no sidecar (nothing pulled yet)
    root: str | None
    state: str | None  # "committed", or anything else: flagged mid-apply (a crash)
    print: str | None  # fingerprint of the file's bits (None when not committed)

    @property
    def committed(self) -> bool:
        return self.state == "committed"


def _sidecar(out: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(out.with_name(out.name + SIDECAR_FILE_SUFFIX).read_bytes())
    except (FileNotFoundError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def holding(out: Path, timeout: float = 30.0) -> Holding:
    """A consistent reading of `out`: the sidecar, the bits, and the sidecar again unchanged (a
    live node may be applying the next version meanwhile: then read again, bounded)."""
    end = time.monotonic() + timeout
    while True:
        before = _sidecar(out)
        if before is None or before.get("state") != "committed":
            return Holding(None if before is None else before.get("version"),
                           None if before is None else before.get("root"),
                           None if before is None else before.get("state"), None)
        try:
            fp: str | None = fingerprint(load_checkpoint(out))
        except Exception:  # replaced or rewritten under us: read again
            fp = None
        if fp is not None and _sidecar(out) == before:
            return Holding(before["version"], before["root"], "committed", fp)
        if time.monotonic() > end:
            raise TimeoutError(f"{out} kept changing for {timeout:g}s")
        time.sleep(0.05)


class ChildProcess:
    """A chaos_child.py process: JSON commands in, JSON events out (see chaos_child)."""

    def __init__(self, args: list[str], name: str = "standby") -> None:
        self.name = name
        self.proc = subprocess.Popen([sys.executable, CHILD, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=child_env(), start_new_session=True)
        self.events: list[Event] = []
        self.stderr: list[str] = []
        self._new = threading.Condition()
        self._eof = False
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr or ()), daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout or ():
            try:
                event = json.loads(line)
            except ValueError:  # not an event: kept for the timeout's message
                self.stderr.append(f"[stdout, not an event] {line}")
                continue
            with self._new:
                self.events.append(event)
                self._new.notify_all()
        with self._new:
            self._eof = True
            self._new.notify_all()

    def send(self, cmd: dict[str, Any]) -> int:
        """Send a command; returns the index of the first event that can answer it."""
        with self._new:
            mark = len(self.events)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return mark

    def wait_for(self, pred: Callable[[Event], bool], timeout: float, *, since: int = 0,
                 what: str = "event") -> Event:
        """The first event from index `since` on matching `pred`; TimeoutError after `timeout`
        (or when the process has exited without one)."""
        end = time.monotonic() + timeout
        with self._new:
            while True:
                for e in self.events[since:]:
                    if pred(e):
                        return e
                left = end - time.monotonic()
                if left <= 0 or self._eof:
                    raise TimeoutError(f"{self.name}: no {what} within {timeout:g}s (exit "
                                       f"{self.proc.poll()}); events {self.events[-4:]}; stderr:\n"
                                       + self._stacks())
                self._new.wait(min(left, 0.5))

    def _stacks(self) -> str:
        """The end of stderr, with every thread's stack if the process still runs (the child
        dumps them on SIGUSR1): where an overdue answer is stuck."""
        lines = len(self.stderr)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGUSR1)
            time.sleep(2.0)  # the stderr reader collects the dump
            return "".join(self.stderr[max(0, lines - 20):])
        return "".join(self.stderr[-20:])

    @property
    def address(self) -> str:
        """The chunk server's address (a node's "listening" event, the publisher's "ready")."""
        for e in self.events:
            if e.get("event") in ("listening", "ready") and "address" in e:
                return str(e["address"])
        return ""

    def listening(self, timeout: float = PROCESS_S) -> ChildProcess:
        self.wait_for(lambda e: e.get("event") == "listening", timeout, what="listening event")
        return self

    def synced(self, version: int, timeout: float) -> Event:
        return self.wait_for(lambda e: e.get("event") == "synced" and e["version"] == version,
                             timeout, what=f"sync to version {version}")

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):  # a broken stdin (the child is gone) cannot flush
                    pipe.close()


class FlippingStore:
    """A store view that flips one bit in the middle of every chunk it hands out: a holder that
    lies (its chunk server is ranked first, so receivers meet its bytes before the store's)."""

    def __init__(self, inner: LocalStore) -> None:
        self.inner, self.url = inner, inner.url

    def get(self, key: str, **options: Any) -> bytes:  # timeout, and any bound the store takes
        data = bytearray(self.inner.get(key, **options))
        if key.endswith(".whc") and data:
            data[len(data) // 2] ^= 0x01
        return bytes(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Cluster:
    """Every process of the chaos suite (see the module docstring)."""

    def __init__(self, root: Path, secret_file: Path, nodes: int, *, timeout: float) -> None:
        self.root, self.secret_file, self.timeout = root, secret_file, timeout
        self.store = root / "store"
        LocalStore(self.store)
        self.db = root / "hub.db"
        self.ids = [f"n{i}" for i in range(nodes)]
        self.hub: HubProcess | None = None
        self.hub_port = 0
        self.publisher: ChildProcess | None = None
        self.receiver: ChildProcess | None = None
        self.nodes: dict[str, ChildProcess] = {}
        self.liar: ChunkServer | None = None
        self.started = 0  # processes started, restarts included
        self._spares: list[ChildProcess] = []

    # -- processes ----------------------------------------------------------------------------
    def warm(self, count: int) -> None:
        """Start `count` standbys at once (they import in parallel)."""
        self._spares += [ChildProcess(["standby"]) for _ in range(count)]

    def _become(self, argv: list[str], name: str) -> ChildProcess:
        """A warm standby, turned into `argv`; one standby is always warming for the next."""
        spare = self._spares.pop(0) if self._spares else ChildProcess(["standby"])
        self.warm(max(0, SPARES - len(self._spares)))
        spare.wait_for(lambda e: e["event"] == "standby", PROCESS_S, what="standby")
        spare.name = name
        spare.send({"argv": argv})
        self.started += 1
        return spare

    def start_hub(self) -> HubProcess:
        # fanout 1: a chain below the publisher, so every node but the last relays for others
        self.hub = HubProcess.start(self.db, self.secret_file, lease_ttl=5.0, fanout=1,
                                    port=self.hub_port)
        self.hub_port = int(self.hub.address.rsplit(":", 1)[1])
        self.started += 1
        return self.hub

    @property
    def hub_address(self) -> str:
        return f"127.0.0.1:{self.hub_port}"

    def out(self, node_id: str) -> Path:
        return self.root / node_id / "model.safetensors"

    def start_node(self, node_id: str) -> ChildProcess:
        """`weighthub serve node` (its events as JSON lines); call `listening()` on it."""
        i = self.ids.index(node_id)
        argv = ["serve", "node", str(self.store), str(self.out(node_id)), "--secret-file",
                str(self.secret_file), "--id", node_id, "--labels", f"region=a,zone=z1,host=h{i + 1}",
                "--timeout", str(self.timeout), "--poll", "0.5", "--hub", self.hub_address, "--json"]
        self.nodes[node_id] = node = self._become(argv, node_id)
        return node

    def start_publisher(self) -> ChildProcess:
        self.publisher = self._become(["publisher", "--store", str(self.store), "--hub", self.hub_address,
                                       "--secret-file", str(self.secret_file),
                                       "--timeout", str(self.timeout)], "publisher")
        self.publisher.wait_for(lambda e: e["event"] == "ready", PROCESS_S, what="ready")
        return self.publisher

    @property
    def receiver_out(self) -> Path:
        return self.root / "receiver" / "model.safetensors"

    def start_receiver(self) -> ChildProcess:
        self.receiver = self._become(["receiver", "--store", str(self.store), "--out",
                                      str(self.receiver_out), "--secret-file", str(self.secret_file),
                                      "--timeout", str(self.timeout)], "receiver")
        self.receiver.wait_for(lambda e: e["event"] == "ready", PROCESS_S, what="ready")
        return self.receiver

    def start_liar(self) -> ChunkServer:
        """An in-process holder that serves every chunk of the store with one bit flipped."""
        self.liar = ChunkServer(FlippingStore(LocalStore(self.store)),  # type: ignore[arg-type]
                                self.secret_file.read_bytes().strip(), io_timeout=self.timeout).start()
        return self.liar

    def running(self) -> list[str]:
        """Names of the processes still running."""
        procs: dict[str, subprocess.Popen[str] | None] = {
            "hub": self.hub.proc if self.hub else None,
            "publisher": self.publisher.proc if self.publisher else None,
            "receiver": self.receiver.proc if self.receiver else None,
            **{i: n.proc for i, n in self.nodes.items()}}
        return [name for name, p in procs.items() if p is not None and p.poll() is None]

    def close(self) -> None:
        """Kill and reap every process; stop the in-process holder."""
        for child in [*self.nodes.values(), self.publisher, self.receiver, *self._spares]:
            if child is not None:
                child.kill9()
        if self.hub is not None:
            self.hub.kill()
        if self.liar is not None:
            self.liar.stop()
