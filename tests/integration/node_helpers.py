"""Processes and fixtures for the node tests: `weighthub serve node` daemons, bad holders, states.

`NodeProcess.start(...)` runs the real console command (`python -m weighthub.cli serve node
... --json`) in its own process group and collects its JSON events; `wait_for` waits for an
event with a timeout. `kill9()` is kill -9.

`python node_helpers.py bad-holder ...` is a holder that lies or stalls: it syncs a version from
the store, then serves it (dense ranges and chunks) with one bit flipped (`--corrupt`) or after
a delay per request (`--delay S`), registered with the hub as a holder of that version. It prints
{"addr": ...} when it is registered.

States: `make_state` builds a bf16 model; `step` changes ~2% of its words (RL-like);
`read_bits` reads a node's safetensors output as integer views for bit-exact comparison.
"""

from __future__ import annotations

import argparse
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

import numpy as np
import torch
from deadlines import PROCESS_S

import weighthub
from weighthub.tensors import bits

START_TIMEOUT_S = PROCESS_S
_SRC = str(Path(weighthub.__file__).resolve().parents[1])
Event = dict[str, Any]


def child_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([_SRC, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


class NodeProcess:
    """A `weighthub serve node` process (see module docstring)."""

    def __init__(self, proc: subprocess.Popen[str], node_id: str, out: Path):
        self.proc = proc
        self.id = node_id
        self.out = out
        self.events: list[Event] = []
        self._new = threading.Condition()
        self.address = ""
        self.stderr: list[str] = []
        self._eof = False
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()

    @classmethod
    def start(cls, store: Path, out: Path, secret_file: Path, *, hub: str | None, node_id: str,
              labels: str = "", timeout: float = 5.0, fanout: int = 4, poll: float = 0.2,
              extra: tuple[str, ...] = ()) -> NodeProcess:
        cmd = [sys.executable, "-m", "weighthub.cli", "serve", "node", str(store), str(out),
               "--secret-file", str(secret_file), "--id", node_id, "--labels", labels,
               "--timeout", str(timeout), "--fanout", str(fanout), "--poll", str(poll), "--json", *extra]
        if hub is not None:
            cmd += ["--hub", hub]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=child_env(), start_new_session=True)
        return cls(proc, node_id, out)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self._new:
                if event.get("event") == "listening":
                    self.address = event["address"]
                self.events.append(event)
                self._new.notify_all()
        with self._new:
            self._eof = True
            self._new.notify_all()

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def wait_for(self, pred: Callable[[Event], bool], timeout: float, what: str = "event") -> Event:
        """The first event (past or future) matching `pred`; TimeoutError after `timeout`."""
        end = time.monotonic() + timeout
        with self._new:
            while True:
                for e in self.events:
                    if pred(e):
                        return e
                left = end - time.monotonic()
                if left <= 0 or self._eof:
                    tail = "".join(self.stderr[-15:])
                    raise TimeoutError(f"node {self.id}: no {what} within {timeout:g}s "
                                       f"(exit {self.proc.poll()}); events {self.events[-5:]}; "
                                       f"stderr:\n{tail}")
                self._new.wait(min(left, 0.5))

    def listening(self, timeout: float = START_TIMEOUT_S) -> NodeProcess:
        self.wait_for(lambda e: e.get("event") == "listening", timeout, "listening event")
        return self

    def synced(self, version: int, timeout: float) -> Event:
        return self.wait_for(lambda e: e.get("event") == "synced" and e["version"] == version,
                             timeout, f"sync to version {version}")

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


class BadHolder:
    """A bad-holder process (see module docstring)."""

    def __init__(self, store: Path, secret_file: Path, hub: str, version: int, node_id: str, *,
                 labels: str, corrupt: bool = False, delay: float = 0.0):
        cmd = [sys.executable, __file__, "bad-holder", "--store", str(store), "--secret-file",
               str(secret_file), "--hub", hub, "--version", str(version), "--id", node_id,
               "--labels", labels, "--delay", str(delay)] + (["--corrupt"] if corrupt else [])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=child_env(),
                                     start_new_session=True)
        self.id = node_id
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout or ()], daemon=True).start()
        try:
            self.address = json.loads(lines.get(timeout=START_TIMEOUT_S))["addr"]
        except queue.Empty:
            self.kill9()
            raise TimeoutError("bad holder did not start") from None

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


# ------------------------------------------------------------------------------------- states

def make_state(seed: int, tensors: int = 6, numel: int = 1 << 18) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {f"layer{i}.weight": (torch.randn(numel // 512, 512, generator=g) * 0.02).to(torch.bfloat16)
             for i in range(tensors)}
    state["norm.weight"] = torch.ones(512, dtype=torch.bfloat16)
    return state


def step(state: dict[str, torch.Tensor], seed: int, rate: float = 0.02) -> dict[str, torch.Tensor]:
    """The next version: ~rate of the words moved by ±1 ulp (what RL steps mostly do)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        b = bits(t.clone()).view(np.int16).copy()
        mask = torch.rand(b.size, generator=g).numpy() < rate
        sign = np.where(torch.rand(b.size, generator=g).numpy() < 0.5, -1, 1).astype(np.int16)
        b[mask] = b[mask] + sign[mask]
        out[name] = torch.from_numpy(b).view(torch.bfloat16).reshape(t.shape)
    return out


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(bits(a[n]), bits(b[n])) for n in a)


def read_bits(out: Path) -> dict[str, torch.Tensor]:
    from weighthub.targets import load_checkpoint
    return load_checkpoint(out)


# ---------------------------------------------------------------------------- bad holder (child)

def _bad_holder_main(argv: list[str]) -> None:
    from weighthub.cluster.hubclient import HubClient
    from weighthub.cluster.leases import ReadLeases
    from weighthub.cluster.topology import parse_labels
    from weighthub.net.auth import load_secret
    from weighthub.net.server import ChunkServer
    from weighthub.receive import Receiver
    from weighthub.store import LocalStore, MemoryStore
    from weighthub.targets import StateDictTarget

    ap = argparse.ArgumentParser()
    for name in ("--store", "--secret-file", "--hub", "--id", "--labels"):
        ap.add_argument(name, required=True)
    ap.add_argument("--version", type=int, required=True)
    ap.add_argument("--corrupt", action="store_true")
    ap.add_argument("--delay", type=float, default=0.0)
    args = ap.parse_args(argv)
    secret = load_secret(args.secret_file)
    store = LocalStore(args.store, create=False)
    target = StateDictTarget({})
    Receiver(store, target).sync(args.version)
    cache = MemoryStore()
    for key in _keys(store, f"v{args.version:012d}"):
        cache.put(key, store.get(key))
    served = _Bad(cache, corrupt=args.corrupt, delay=args.delay)
    lying = _BadTarget(target, corrupt=args.corrupt, delay=args.delay)
    server = ChunkServer(served, secret, leases=ReadLeases(lying)).start()  # type: ignore[arg-type]
    server.serve(args.version)
    hub = HubClient(args.hub, secret, timeout=5.0, labels=parse_labels(args.labels))
    hub.register(args.id, server.address, versions=[args.version], dense=True, serving=[args.version])
    hub.start_heartbeat()
    print(json.dumps({"addr": server.address}), flush=True)
    threading.Event().wait()


def _keys(store: Any, prefix: str) -> list[str]:
    out = []
    for name in store.children(prefix):
        sub = store.children(f"{prefix}/{name}")
        out += _keys(store, f"{prefix}/{name}") if sub else [f"{prefix}/{name}"]
    return out


class _Bad:
    """Chunks with one bit flipped and/or after a delay."""

    def __init__(self, inner: Any, *, corrupt: bool, delay: float) -> None:
        self.inner, self.url, self.corrupt, self.delay = inner, inner.url, corrupt, delay

    def get(self, key: str) -> bytes:
        time.sleep(self.delay)
        data = bytearray(self.inner.get(key))
        if self.corrupt and key.endswith(".whc"):
            data[len(data) // 2] ^= 0x01
        return bytes(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _BadTarget:
    """A held target whose dense bits have one bit flipped per tensor and/or come late."""

    def __init__(self, inner: Any, *, corrupt: bool, delay: float) -> None:
        self.inner, self.corrupt, self.delay = inner, corrupt, delay
        self._lied: dict[str, np.ndarray] | None = None

    def peek(self) -> dict[str, np.ndarray]:
        time.sleep(self.delay)
        if not self.corrupt:
            return self.inner.peek()  # type: ignore[no-any-return]
        if self._lied is None:
            self._lied = {n: a.copy() for n, a in self.inner.peek().items()}
            for a in self._lied.values():
                a.reshape(-1)[a.size // 2] ^= 1
        return self._lied

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


if __name__ == "__main__":
    if sys.argv[1:2] == ["bad-holder"]:
        _bad_holder_main(sys.argv[2:])
