"""The chaos suite's child processes: a publisher and a receiver that take commands on stdin.

    python chaos_child.py publisher --store S --hub H --secret-file F
    python chaos_child.py receiver --store S --out OUT --secret-file F
    python chaos_child.py standby

A standby has imported torch and weighthub (what costs a fresh process seconds, and tens of
seconds on a loaded machine) and waits for one line, {"argv": [...]}: then it becomes that
process, a publisher, a receiver, or `weighthub ARGV` (e.g. `serve node ...`). The test keeps
one standby warm, so that restarting a killed process costs what the process does, not its
imports.

Each reads one JSON command per line and answers with JSON events, one per line, on stdout
(the test kills it with SIGKILL whenever its schedule says, so every event is flushed at once):

publisher   a NetPublisher (relaying through the hub's tree, announcing to the hub) over the
            store, restarted after a kill as a trainer would be: it adopts the store's head.
            {"cmd": "publish", "ckpt": PATH, "delay": S} publishes the checkpoint. Each chunk
            write sleeps S first (so a kill lands mid-publish) and says {"event": "put", "n",
            "roots"}; the commit (the manifest's create-only write) is bracketed by "committing"
            and "committed"; then {"event": "published", "version", "announced"}.
receiver    `weighthub pull`'s receiver (verify_base, a safetensors file target) with holders
            the test names ahead of the store. {"cmd": "pull", "peers": [...], "pause": P}
            syncs to the latest version; P (None, "fetch", "open", "commit" or "fsync") stops
            it for good at that point, after saying {"event": "paused", "at": P}: the test
            kills it there. "fetch": staging, one chunk read from the store, the file
            untouched; "open": the target opened for the apply, nothing written yet; "commit":
            every word applied (and, with shared maps, flushed), the target's commit not
            called; "fsync": inside the target's commit, right after its Nth os.fsync
            ({"nth": N}; a commit with fewer fsyncs just completes). Then
            {"event": "pulled", "version", "root", "served"} or {"event": "error", "error"}.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

_emit_lock = threading.Lock()


def emit(event: dict[str, Any]) -> None:
    # one write under a lock: print() writes the line and its newline separately, so threads
    # pausing together (staging's fetches) interleaved their lines and the test lost both
    line = json.dumps(event, sort_keys=True) + "\n"
    with _emit_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


class _TimedStore:
    """The publisher's store: each chunk write sleeps first and is reported; so is the commit."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.url = inner, inner.url
        self.delay = 0.0
        self.puts = 0
        self.roots: Any = lambda: []
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes | memoryview, *, create_only: bool = False) -> None:
        from weighthub import catalog

        commit = create_only and key.endswith(catalog.PRIMARY)
        if key.endswith(catalog.CHUNK_SUFFIX):
            time.sleep(self.delay)
        elif commit:
            emit({"event": "committing", "key": key})
        self.inner.put(key, data, create_only=create_only)
        if key.endswith(catalog.CHUNK_SUFFIX):
            with self._lock:
                self.puts += 1
                n = self.puts
            emit({"event": "put", "n": n, "roots": self.roots()})
        elif commit:
            emit({"event": "committed", "key": key})

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def publisher_main(args: argparse.Namespace) -> None:
    from weighthub.cluster.hubclient import HubClient
    from weighthub.cluster.publisher import NetPublisher
    from weighthub.cluster.topology import Labels
    from weighthub.net.auth import load_secret
    from weighthub.store import LocalStore
    from weighthub.targets import load_checkpoint

    secret = load_secret(args.secret_file)
    store = _TimedStore(LocalStore(args.store))
    hub = HubClient(args.hub, secret, timeout=args.timeout, labels=Labels("a", "z1", "h0"))
    pub = NetPublisher(store, secret, hub=hub, publisher_id="trainer",  # type: ignore[arg-type]
                       delta_span_bytes=128 << 10).start()
    store.roots = pub.relay_roots
    emit({"event": "ready", "address": pub.address, "version": pub.publisher.version})
    for line in sys.stdin:
        cmd = json.loads(line)
        store.delay, store.puts = float(cmd.get("delay", 0.0)), 0
        r = pub.publish(load_checkpoint(cmd["ckpt"]))
        emit({"event": "published", "version": r.version, "announced": r.announced,
              "chunks": r.chunks, "dead": list(r.dead)})
    pub.close()


def _stop_here(pause: str | None, at: str) -> None:
    if pause == at:
        emit({"event": "paused", "at": at})
        time.sleep(3600)  # the test kills this process now


class _PausingSource:
    """The store as a chunk source that stops for good after handing over its first chunk."""

    def __init__(self, inner: Any, pause: str | None) -> None:
        self.inner, self.name, self.pause = inner, inner.name, pause

    def get_chunk(self, ref: Any, *, timeout: float) -> bytes:
        data: bytes = self.inner.get_chunk(ref, timeout=timeout)
        _stop_here(self.pause, "fetch")
        return data


@contextlib.contextmanager
def _pausing_fsync(pause: str | None, nth: int) -> Iterator[None]:
    """os.fsync that stops for good after its `nth` call (see the module docstring)."""
    real, calls = os.fsync, [0]

    def fsync(fd: Any) -> None:
        real(fd)
        calls[0] += 1
        if calls[0] == nth:
            _stop_here(pause, "fsync")
    os.fsync = fsync
    try:
        yield
    finally:
        os.fsync = real


class _PausingTarget:
    """A target that stops for good at one point of a transaction (see the module docstring)."""

    def __init__(self, inner: Any, pause: str | None, nth: int = 1) -> None:
        self.inner, self.pause, self.nth = inner, pause, nth

    def _stop_here(self, at: str) -> None:
        _stop_here(self.pause, at)

    def open(self, specs: Any) -> Any:
        views = self.inner.open(specs)
        self._stop_here("open")
        return views

    def commit(self, held: Any) -> None:
        for m in getattr(self.inner, "_maps", ()):  # every word on disk, the commit not written
            m.flush()
        self._stop_here("commit")
        with _pausing_fsync(self.pause, self.nth):
            self.inner.commit(held)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def receiver_main(args: argparse.Namespace) -> None:
    from weighthub.cluster.peers import HolderSource
    from weighthub.errors import WeighthubError
    from weighthub.net.auth import load_secret
    from weighthub.net.client import Timeouts
    from weighthub.receive import Receiver
    from weighthub.sources import SourceList, StoreSource
    from weighthub.store import LocalStore
    from weighthub.targets.safetensors_file import SafetensorsTarget

    secret = load_secret(args.secret_file)
    store = LocalStore(args.store, create=False)
    timeouts = Timeouts(connect=args.timeout, io=args.timeout, deadline=2 * args.timeout)
    emit({"event": "ready"})
    for line in sys.stdin:
        cmd = json.loads(line)
        peers = list(cmd.get("peers", []))
        pause = cmd.get("pause")
        sources = SourceList([HolderSource(lambda _ref, p=peers: p, secret, timeouts=timeouts),  # type: ignore[misc]
                              _PausingSource(StoreSource(store), pause)])
        target = _PausingTarget(SafetensorsTarget(args.out), pause, int(cmd.get("nth", 1)))
        t0 = time.monotonic()
        try:
            r = Receiver(store, target, verify_base=True, sources=sources).sync()
        except WeighthubError as exc:
            emit({"event": "error", "error": f"{type(exc).__name__}: {exc}",
                  "seconds": time.monotonic() - t0})
            continue
        held = target.held()
        emit({"event": "pulled", "version": r.version, "root": held.root if held else None,
              "served": dict(sources.served), "seconds": time.monotonic() - t0})


def standby_main() -> None:
    import torch  # noqa: F401  (the imports every role needs, ahead of knowing which)

    import weighthub.cli
    import weighthub.cluster.node_cli
    import weighthub.cluster.publisher
    import weighthub.receive
    import weighthub.targets

    emit({"event": "standby"})
    argv = json.loads(sys.stdin.readline())["argv"]
    if argv[0] in ("publisher", "receiver"):
        main(argv)
    else:
        sys.exit(weighthub.cli.main(argv))


def main(argv: list[str]) -> None:
    # the test asks for every thread's stack (on stderr) when an answer is overdue
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if argv == ["standby"]:
        standby_main()
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["publisher", "receiver"])
    ap.add_argument("--store", required=True)
    ap.add_argument("--secret-file", required=True)
    ap.add_argument("--hub")
    ap.add_argument("--out")
    ap.add_argument("--timeout", type=float, default=2.0)
    args = ap.parse_args(argv)
    (publisher_main if args.role == "publisher" else receiver_main)(args)


if __name__ == "__main__":
    main(sys.argv[1:])
