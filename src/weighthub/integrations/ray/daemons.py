"""The hub and the node daemons as Ray actors: today's `serve hub` / `serve node`, in a thread.

Both keep what a restart needs in a directory of their own on their Ray node (the hub's SQLite
state; each daemon's port), so an actor that Ray restarts after a crash comes back at the same
address with the same state: nodes and engines keep their clients, and a node daemon re-joins
its version from holders or the store as `serve node` does after a restart.

A daemon's methods run in the actor's thread; the services run in their own threads, so a slow
call (waiting for a version) never stops the hub answering or a node relaying.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...cluster import hub as hub_server
from ...cluster.hubclient import HubClient
from ...cluster.hubcore import HubConfig
from ...cluster.node import Node, NodeConfig
from ...cluster.relayed import all_relayed, manifest_chunks, relayed_chunks, relayed_manifest
from ...cluster.topology import Labels
from ...engines.warm import warm_kernels
from ...errors import PeerTimeout, UsageError
from ...format import ChunkRef
from ...store import LocalStore, open_store
from ...targets import StateDictTarget
from .heap import freeze_startup_heap

START_TIMEOUT_S = 30.0
# a node daemon's state directory: the host staging cache its engines share, and its relay cache
STAGE_SUBDIR, CACHE_SUBDIR = "stage", "cache"
APPLY_DELAY_S = 0.5  # a node daemon's own apply of a pushed version waits for engines' staging


def _saved_port(path: Path) -> int:
    """The port an earlier incarnation of this daemon listened on (0: none yet)."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


class HubDaemon:
    """`weighthub serve hub` in a thread of a Ray actor.

    Args:
        state_dir: the hub's database and port file (kept across restarts).
        secret: the sync group's shared secret.
        host: the address to listen on.
        lease_ttl, retain, degree: as `serve hub` (HubConfig).
    """

    def __init__(self, state_dir: str, secret: bytes, host: str, *, lease_ttl: float = 10.0,
                 retain: int = 8, degree: int = 4) -> None:
        root = Path(state_dir)
        root.mkdir(parents=True, exist_ok=True)
        config = HubConfig(db=root / "hub.sqlite", lease_ttl=lease_ttl, retain=retain, degree=degree)
        port_file = root / "hub.port"
        ready = threading.Event()
        self._address = ""
        self._error: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()

        def on_ready(address: str) -> None:
            self._address = address
            port_file.write_text(address.rpartition(":")[2])
            ready.set()

        def run() -> None:
            try:
                self._loop.run_until_complete(hub_server.serve(
                    config, secret, host, _saved_port(port_file), ready=on_ready, stop=self._stop))
            except BaseException as exc:  # reported to __init__ (if before ready) and stop
                self._error = exc
                ready.set()

        self._thread = threading.Thread(target=run, name="weighthub-hub", daemon=True)
        self._thread.start()
        if not ready.wait(START_TIMEOUT_S) or self._error is not None:
            raise UsageError(f"the weighthub hub did not start in {START_TIMEOUT_S:g} s on {host} "
                             f"({self._error!r}); is its port taken? (state in {root})")
        freeze_startup_heap()  # a publish waits for its plan and announcement (see heap)

    def address(self) -> str:
        return self._address

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)


class NodeDaemon:
    """`weighthub serve node` in a thread of a Ray actor: this Ray node's holder and relay.

    Its target is an in-memory state dict (one host copy of the model per Ray node), its cache a
    directory; engines on the node read chunks from it before the store.

    Args:
        store_url: the object store versions are committed to.
        hub: the hub's address.
        secret: the sync group's shared secret.
        node_id: holder id (the Ray node id).
        labels: region / zone / host.
        state_dir: cache and port file (kept across restarts).
        host: the address to listen on.
        timeout: every hub call and peer request (NodeConfig.timeout).
        nice: the daemon's own applies into its host copy (NodeConfig.nice): engines on the
            node stage from the chunks it was pushed, not from that copy, so its apply yields
            the cores to their staging and pauses.
        apply_delay_s: and it starts that apply only this long after the version's chunks
            were all pushed to it, while the engines stage from them. On 2 shared cores
            (SmolLM2-135M, ~2% changed) two engines staged in 0.09 s with it deferred against
            0.12-0.13 s beside it, in steps of equal publish time (one run each; across runs
            this machine varies more than that). A version it fetches itself applies at once.
    """

    def __init__(self, store_url: str, hub: str, secret: bytes, node_id: str, labels: Labels,
                 state_dir: str, host: str, *, timeout: float = 10.0, poll_s: float = 1.0,
                 nice: int = 10, apply_delay_s: float = APPLY_DELAY_S) -> None:
        warm_kernels()  # it applies every version too: no JIT beside the engines' first refit
        root = Path(state_dir)
        (root / CACHE_SUBDIR).mkdir(parents=True, exist_ok=True)
        port_file = root / "node.port"
        config = NodeConfig(node_id=node_id, labels=labels, timeout=timeout, poll_s=poll_s,
                            host=host, port=_saved_port(port_file), nice=nice)
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.node = _EnginesFirst(open_store(store_url), StateDictTarget({}), secret, config,
                                  hub=HubClient(hub, secret, timeout=timeout, labels=labels),
                                  cache=LocalStore(root / CACHE_SUBDIR), on_event=self._event,
                                  apply_delay_s=apply_delay_s)
        self.node.start()
        port_file.write_text(self.node.server.address.rpartition(":")[2])
        freeze_startup_heap()  # engines wait on it to stage (see heap)

    def _event(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._events = [*self._events[-63:], event]  # the last 64, for diagnosis

    def address(self) -> str:
        return self.node.server.address

    def held(self) -> dict[str, Any] | None:
        held = self.node.target.held()
        return None if held is None else {"version": held.version, "root": held.root}

    def wait_version(self, version: int, timeout: float) -> dict[str, Any]:
        """Block until the node holds `version` or a newer one; its held version and root.

        Raises:
            PeerTimeout: not within `timeout` seconds (the node's last events in the message).
        """
        def holds() -> dict[str, Any] | None:
            held = self.held()
            return held if held is not None and held["version"] >= version else None
        return self._wait(holds, timeout, f"does not hold version {version}")

    def wait_available(self, version: int, timeout: float) -> dict[str, Any]:
        """Block until engines on this node can stage `version` (or a newer one) from it: the
        node holds it, or its relay parent pushed the version whole (the manifest the hub
        vouched for, `relayed_manifest`, and every chunk it names, `all_relayed`). Engines then
        need not wait for the node's own apply into its host copy. {"held": its held version or None,
        "relayed": whether the pushed chunks answered, "manifest": the relayed manifest of
        `version` (bytes) or None, "manifest_sha256": the digest the hub recorded for it}: an
        engine plans and stages from that manifest instead of reading the store's (one listing
        and one manifest per refit, across the slow link when the store is far).

        Raises:
            PeerTimeout: neither within `timeout` seconds (the node's last events said).
        """
        where = f"node daemon {self.node.config.node_id}"
        found: dict[str, Any] = {"manifest": None, "manifest_sha256": None}
        chunks: list[ChunkRef] | None = None  # the relayed manifest's, found and decoded once

        def servable() -> dict[str, Any] | None:
            nonlocal chunks
            if chunks is None:
                digest = self.node.digests.get(version)
                raw = relayed_manifest(self.node.cache, version, digest, where=where)
                chunks = None if raw is None else manifest_chunks(raw, version, where=where)
                if chunks is not None:  # it parses: engines may plan from it
                    found.update(manifest=raw, manifest_sha256=digest)
            held = self.held()
            if held is not None and held["version"] >= version:
                return {"held": held, "relayed": False} | found
            if chunks is not None and all_relayed(self.node.cache, chunks):
                return {"held": held, "relayed": True} | found
            return None
        return self._wait(servable, timeout, f"can serve neither version {version} nor a newer one",
                          poll_s=0.005)

    def _wait(self, ready: Callable[[], dict[str, Any] | None], timeout: float, what: str, *,
              poll_s: float = 0.02) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (answer := ready()) is None:
            if time.monotonic() >= deadline:
                with self._lock:
                    last = self._events[-3:]
                raise PeerTimeout(f"node daemon {self.node.config.node_id} {what} after "
                                  f"{timeout:g} s (holds {self.held()}); last events {last}")
            time.sleep(poll_s)
        return answer

    def stats(self) -> dict[str, Any]:
        with self._lock:
            events = list(self._events)
        return {"held": self.held(), "stats": self.node.stats(), "pushed": self.node.pushed,
                "synced": [e for e in events if e.get("event") == "synced"][-8:]}

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.node.stop()


class _EnginesFirst(Node):
    """A node whose own apply of a version pushed to it whole waits `apply_delay_s` first (see
    NodeDaemon): the engines of its host stage from those chunks meanwhile."""

    def __init__(self, *args: Any, apply_delay_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.apply_delay_s = apply_delay_s
        self._stopping = threading.Event()

    def request_stop(self) -> None:
        self._stopping.set()
        super().request_stop()

    def sync_to(self, version: int) -> bool:
        if self.apply_delay_s and self.target.held() is not None:  # a delta, not a join
            chunks = relayed_chunks(self.cache, version, self.digests.get(version),
                                    where=f"node daemon {self.config.node_id}")
            if chunks is not None and all_relayed(self.cache, chunks) \
                    and self._stopping.wait(self.apply_delay_s):
                return True  # stopping: the version is left for the next start
        return super().sync_to(version)
