"""Process launchers for the peer-network tests: real nodes on 127.0.0.1.

`python net_helpers.py node ...` runs one node: a ChunkServer staging into / serving from its
cache directory, a StateDictTarget behind read leases, and a Receiver over the shared store
directory whose sources are the node's cache, the holders it was told, then the store. It prints
{"addr": ...} when it listens, then answers JSON-line commands on stdin (each with an "id"; each
runs in its own thread, so a sync can wait behind a read lease while other commands go on):

    {"cmd": "sync", "version": v}    -> version, digests (xxh3 of every tensor's bits), stats,
                                        store_chunk_gets (chunk GETs that reached the store)
    {"cmd": "sources", "addrs": [...]}  holders its HolderSource asks, best first
    {"cmd": "serve", "version": v}   serve the objects of v (from the cache directory)
    {"cmd": "quit"}

Bad holders for failover tests: `--corrupt` serves chunks with one bit flipped, `--delay S`
waits S seconds before serving each chunk.

`Node` (test side) starts one, talks to it with a timeout on every answer, and kills its
process group on `close()`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from deadlines import PROCESS_S

import weighthub

ANSWER_TIMEOUT_S = PROCESS_S  # an answer may wait for the node's cold start
_SRC = str(Path(weighthub.__file__).resolve().parents[1])


def child_env(secret: str) -> dict[str, str]:
    env = dict(os.environ, WEIGHTHUB_SECRET=secret, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([_SRC, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


class Node:
    """A node process (see module doc). `call` sends a command and waits for its answer."""

    def __init__(self, store: Path, cache: Path, secret: str, *args: str) -> None:
        cmd = [sys.executable, __file__, "node", "--store", str(store), "--cache", str(cache), *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=child_env(secret), text=True, start_new_session=True)
        self.cache = cache
        self._answers: dict[int, queue.Queue[dict[str, Any]]] = {}
        self._lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self._next = 0
        self._lock = threading.Lock()
        self._addr: str | None = None
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def addr(self) -> str:
        """The node's server address; waits for it to start (nodes spawned together start
        concurrently: their imports overlap)."""
        if self._addr is None:
            try:
                self._addr = self._lines.get(timeout=ANSWER_TIMEOUT_S)["addr"]
            except queue.Empty:
                raise TimeoutError("node did not start within 60 s") from None
        return self._addr

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            q = self._answers.get(msg["id"]) if "id" in msg else self._lines
            if q is not None:
                q.put(msg)

    def send(self, **cmd: Any) -> queue.Queue[dict[str, Any]]:
        """Send a command; the queue its answer will arrive on."""
        with self._lock:
            self._next += 1
            q: queue.Queue[dict[str, Any]] = queue.Queue()
            self._answers[self._next] = q
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"id": self._next, **cmd}) + "\n")
            self.proc.stdin.flush()
        return q

    def call(self, timeout: float = ANSWER_TIMEOUT_S, **cmd: Any) -> dict[str, Any]:
        return wait_answer(self.send(**cmd), timeout)

    def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def wait_answer(q: queue.Queue[dict[str, Any]], timeout: float = ANSWER_TIMEOUT_S) -> dict[str, Any]:
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"no answer from the node within {timeout:g} s") from None


# ------------------------------------------------------------------------------ node (child side)

def _node_main(argv: list[str]) -> None:
    import xxhash

    from weighthub.cluster.leases import LeasedTarget, ReadLeases
    from weighthub.cluster.peers import HolderSource
    from weighthub.net.auth import load_secret
    from weighthub.net.client import Timeouts
    from weighthub.net.server import ChunkServer, key_version
    from weighthub.receive import Receiver
    from weighthub.sources import SourceList, StoreCache, StoreSource
    from weighthub.store import LocalStore
    from weighthub.targets import StateDictTarget

    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--corrupt", action="store_true")
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--deadline", type=float, default=10.0)
    ap.add_argument("--lease-wait", type=float, default=20.0)
    args = ap.parse_args(argv)

    secret = load_secret()
    backing = CountingStore(LocalStore(args.store, create=False))
    cache = LocalStore(args.cache)
    served = BadStore(cache, corrupt=args.corrupt, delay=args.delay)
    target = StateDictTarget({})
    leases = ReadLeases(target, wait_s=args.lease_wait)
    server = ChunkServer(served, secret, leases=leases).start()
    sources: list[str] = []
    holders = HolderSource(lambda _ref: list(sources), secret,
                           timeouts=Timeouts(2.0, args.deadline, args.deadline))
    pushed, store = StoreCache(cache), StoreSource(backing)
    chain = SourceList([pushed, holders, store])
    receiver = Receiver(backing, LeasedTarget(target, leases), sources=chain)

    def stats() -> dict[str, int]:
        return {"from_cache": chain.served[pushed.name], "from_peers": chain.served[holders.name],
                "from_backing": chain.served[store.name], "peer_failures": holders.stats.benched}
    out_lock = threading.Lock()

    def answer(msg: dict[str, Any]) -> None:
        with out_lock:
            print(json.dumps(msg), flush=True)

    def run(cmd: dict[str, Any]) -> None:
        reply: dict[str, Any] = {"id": cmd["id"], "ok": True}
        try:
            if cmd["cmd"] == "sync":
                t0 = time.perf_counter()
                result = receiver.sync(cmd.get("version"))
                for key in result.route:
                    server.serve(key_version(key))
                reply.update(version=result.version, seconds=time.perf_counter() - t0,
                             digests={n: xxhash.xxh3_128_hexdigest(a.tobytes())
                                      for n, a in target.peek().items()},
                             stats=stats(),
                             store_chunk_gets=backing.chunk_gets,
                             lease_wait_s=leases.last_wait_s)
            elif cmd["cmd"] == "serve":
                server.serve(cmd["version"])
            elif cmd["cmd"] == "sources":
                sources[:] = cmd["addrs"]
            elif cmd["cmd"] == "quit":
                answer(reply)
                server.stop()
                os._exit(0)
        except Exception as exc:
            reply.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        answer(reply)

    answer({"addr": server.address})
    for line in sys.stdin:
        threading.Thread(target=run, args=(json.loads(line),), daemon=True).start()
    server.stop()


class CountingStore:
    """Counts the chunk GETs that reach the wrapped store."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.url = inner.url
        self.chunk_gets = 0

    def get(self, key: str, **kw: Any) -> bytes:
        if key.endswith(".whc"):
            self.chunk_gets += 1
        return self.inner.get(key, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class BadStore:
    """What a bad holder serves from: chunks with one bit flipped, or after a delay."""

    def __init__(self, inner: Any, *, corrupt: bool, delay: float) -> None:
        self.inner = inner
        self.url = inner.url
        self.corrupt = corrupt
        self.delay = delay

    def get(self, key: str, **kw: Any) -> bytes:
        data = self.inner.get(key, **kw)
        if key.endswith(".whc"):
            time.sleep(self.delay)
            if self.corrupt:
                data = bytearray(data)
                data[len(data) // 2] ^= 0x01
                return bytes(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


if __name__ == "__main__":
    if sys.argv[1:2] == ["node"]:
        _node_main(sys.argv[2:])
