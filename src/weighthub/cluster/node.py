"""`weighthub serve node`: a rollout worker's daemon that follows versions and serves what it holds.

One node = one target (a safetensors file/directory, or an in-memory state dict) kept at the
latest committed version, and one ChunkServer that makes it a source for others:

    register   with the hub as a subscribed holder (its chunk server's address and topology
               labels); a heartbeat thread renews the lease and reports the versions whose
               chunks it serves and, apart, the one whose dense bits it serves now (none while
               applying, before its first check, or distrusted): joiners are sent only there
    follow     a relayed manifest (pushed down the relay tree after the commit) wakes the node
               at once; else it polls the hub's latest version every `poll_s`, or the store's
               listing when the hub does not answer or knows no version yet (a normal state:
               publish every version with `--hub`), or has named the same version for
               `store_check_s` (it may have missed an announcement: `latest`). A relayed
               manifest is used only if it hashes to the SHA-256 the hub recorded: then a
               one-step refit reads nothing from the store (`RelayedManifests.trusted_route`)
    guard      before every apply and poll the target's files are stat'ed against the node's
               last commit; every `full_check_versions` versions / `full_check_s` seconds (and
               first after a start) all its bits are digested against the held root
               (`baseguard`). Bits modified outside weighthub are reported ("base_modified"),
               no longer served, and re-materialized like a join (holders, else the store)
               before any delta is applied on top
    sync       no weights yet: elastic join, the version's dense bits striped over the nearest
               holders (`join`), else from the store; then each new version through a Receiver
               whose sources are: the node's cache (chunks a relay parent pushed) -> holders
               ranked by the hub (`peers`) -> the store. All or nothing: a failed sync leaves
               the previous version in place, is reported (event "error") and retried
    relay      pushed chunks are forwarded cut-through to the children the publisher's push
               names (the hub's relay tree) and staged in the cache by the ChunkServer
    serve      chunks of every version it fetched or was pushed, until the hub releases it;
               dense ranges of the version it holds, under read leases: its next apply waits
               (bounded) until readers finish, so it never changes bits being read (`leases`)

Events (`on_event`; the CLI prints them, one JSON object per line with --json): "listening",
"synced" {version, root, how: join|delta|store, seconds, bytes, stats, rematerialized},
"base_modified" {version, check: stat|full, detail}, "error" {version, held, error},
"released" {versions}.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import catalog
from ..errors import BaseMismatch, NoSyncPath, UsageError, VersionNotFound, WeighthubError
from ..net.client import Timeouts
from ..net.server import ChunkServer, key_version
from ..receive import Receiver, SyncResult
from ..sources import ChunkId, SourceList, StoreCache, StoreSource
from ..store import Store
from ..targets.base import Target
from .baseguard import BaseGuard, rematerializing
from .hubclient import HubClient
from .join import join_from_holders
from .latest import LatestVersion
from .leases import LeasedTarget, ReadLeases
from .peers import HolderSource
from .relayed import RelayedManifests, relayed_manifest
from .topology import Labels

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """How a node runs. `timeout` bounds every hub call and every peer request's socket wait
    (a whole peer request: 2 × timeout)."""

    node_id: str
    labels: Labels = field(default_factory=Labels)
    timeout: float = 10.0
    poll_s: float = 2.0  # fallback: a relayed manifest wakes the node at once
    # the store's listing is read too when the hub repeats one latest version this long (0: never)
    store_check_s: float = 30.0
    stripes: int = 4  # holders (and parallel reads) an elastic join stripes across
    host: str = "127.0.0.1"
    port: int = 0
    lease_wait_s: float = 30.0  # longest an apply waits for dense readers
    # a full digest check of the held bits every N versions / S seconds (0: not by that rule)
    full_check_versions: int = 16
    full_check_s: float = 1800.0
    # the follow thread's (syncs, guard checks) least nice: above 0 where engines share the
    # host's cores and do not wait for this node's copy (relaying, serving: the process's nice)
    nice: int = 0

    def __post_init__(self) -> None:
        if not self.node_id:
            raise UsageError("node id must not be empty")
        if not 0 < self.timeout <= 3600 or not 0 < self.poll_s <= 3600:
            raise UsageError(f"--timeout and --poll must be in (0, 3600] seconds, got "
                             f"{self.timeout}, {self.poll_s}")
        if not 0 <= self.store_check_s <= 86400:
            raise UsageError(f"--store-check must be in [0, 86400] seconds (0: never while the hub "
                             f"answers), got {self.store_check_s}")
        if not 1 <= self.stripes <= 64:
            raise UsageError(f"--fanout (join stripes) must be in 1..64, got {self.stripes}")
        if not 0 <= self.full_check_versions <= 1_000_000 or not 0 <= self.full_check_s <= 1e7:
            raise UsageError(f"--full-check-versions and --full-check-s must be ≥ 0 (0: never by "
                             f"that rule), got {self.full_check_versions}, {self.full_check_s}")
        if not 0 <= self.nice <= 19:
            raise UsageError(f"--nice must be in 0..19 (0: the process's priority), got {self.nice}")

    @property
    def peer_timeouts(self) -> Timeouts:
        return Timeouts(connect=min(2.0, self.timeout), io=self.timeout, deadline=2 * self.timeout)


class Node:
    """See the module docstring. `start()`, then it runs until `stop()`.

    Args:
        backing: the object store versions are committed to.
        target: where the weights live (empty or holding a committed version).
        secret: the shared secret (hub and chunk servers).
        config: see NodeConfig.
        hub: the hub client (None: follow the store alone, serve without being ranked).
        cache: where pushed and fetched chunks are kept and served from.
        on_event: called with each event dict (from the node's threads).
    """

    def __init__(self, backing: Store, target: Target, secret: bytes, config: NodeConfig, *,
                 hub: HubClient | None, cache: Store,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.backing = backing
        self.config = config
        self.hub = hub
        self.cache = cache
        self.secret = secret
        self.on_event = on_event or (lambda _e: None)
        self.leases = ReadLeases(target, wait_s=config.lease_wait_s, on_change=self._tell_hub)
        self.target = LeasedTarget(target, self.leases)
        self.guard = BaseGuard(target, every_versions=config.full_check_versions,
                               every_s=config.full_check_s)
        self.server = ChunkServer(cache, secret, leases=self.leases, host=config.host,
                                  port=config.port, io_timeout=config.timeout,
                                  request_timeout=max(60.0, 4 * config.timeout),
                                  on_push=self._pushed)
        # manifests from the store (or relayed ones the hub vouched for); chunks from the
        # cache relay parents push into, then the ranked holders, then the store
        self.manifests = RelayedManifests(backing)
        self.holders = HolderSource(self._rank, secret, timeouts=config.peer_timeouts,
                                    cooldown_s=max(10.0, 3 * config.timeout))
        self.sources = SourceList([StoreCache(cache, name=f"pushed cache {cache.url}"),
                                   self.holders, StoreSource(backing)])
        self.receiver = Receiver(self.manifests, self.target, sources=self.sources)
        self.last_error: str | None = None
        self.pushed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()  # set by a relayed manifest
        self.latest = LatestVersion(hub, backing, timeout=config.timeout,
                                    store_check_s=config.store_check_s, where=f"node {config.node_id}")
        self._told: tuple[list[int], list[int]] | None = None  # (versions, serving) last told

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> Node:
        self.server.start()
        try:
            held = self.target.held()
        except BaseMismatch:  # modified while the node was down: the first check reports it
            held = None
        if held is not None:
            self.server.serve(held.version)
        if self.hub is not None:
            self.hub.on_release = self._released
            try:  # a hub that is down now is retried by the heartbeat; dense: after a check
                self.hub.register(self.config.node_id, self.server.address,
                                  versions=self.server.versions(), subscribe=True, dense=True,
                                  serving=())
            except WeighthubError as exc:
                log.warning("node %s: hub %s: %s; following the store until it answers",
                            self.config.node_id, self.hub.address, exc)
            self.hub.start_heartbeat()
        self.on_event({"event": "listening", "id": self.config.node_id, "address": self.server.address,
                       "held": held.version if held else None})
        self._thread = threading.Thread(target=self._follow, name="node-follow", daemon=True)
        self._thread.start()
        return self

    def request_stop(self) -> None:
        """Ask `wait()` to return (safe from a signal handler)."""
        self._stop.set()
        self._wake.set()

    def stop(self) -> None:
        """Stop following, leave the hub, stop serving. A sync in progress finishes first."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join()
        if self.hub is not None:
            self.hub.stop(leave=True)
        self.server.stop()

    def wait(self) -> None:
        """Block until `stop()` (from another thread or a signal handler)."""
        self._stop.wait()

    # -- following ------------------------------------------------------------------------------
    def _follow(self) -> None:
        if self.config.nice:  # this thread and the pools it starts (Linux: nice is per thread)
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid,
                           max(self.config.nice, os.getpriority(os.PRIO_PROCESS, tid)))
        delay = 0.0
        while True:
            self._wake.wait(delay)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                delay = self.config.poll_s if self._step() else min(5.0, 4 * self.config.poll_s)
            except Exception as exc:  # a bug or an odd target must not end following silently
                log.exception("node %s: following failed; retrying", self.config.node_id)
                self.last_error = f"{type(exc).__name__}: {exc}"
                self.on_event({"event": "error", "version": None, "held": None, "error": self.last_error})
                delay = min(5.0, 4 * self.config.poll_s)

    def _step(self) -> bool:
        """Check the held bits, learn the latest version, sync to it. False: retry soon."""
        try:
            latest = self.latest.latest()
            self._check_base()
            held = self.target.held()
        except WeighthubError as exc:
            log.warning("node %s: cannot learn the latest version or check the held one: %s",
                        self.config.node_id, exc)
            return False
        if latest is None or (held is not None and held.version >= latest):
            return True
        return self.sync_to(latest)  # False: retried at the next poll

    @property
    def digests(self) -> dict[int, str]:
        """version -> the manifest SHA-256 the hub recorded (the hub's latest only)."""
        return self.latest.digests

    def _delta(self, version: int, held: int) -> SyncResult:
        """A Receiver sync: from the relayed manifest when it is one step from `held`, else the store."""
        raw = relayed_manifest(self.cache, version, self.digests.get(version),
                               where=f"node {self.config.node_id}")
        if raw is not None:
            try:
                with self.manifests.trusted_route({version: raw}):
                    return self.receiver.sync(version)
            except (NoSyncPath, VersionNotFound) as exc:  # not a delta from `held`: the store's route
                log.info("node %s: relayed manifest of %d is no step from %d (%s); using the store",
                         self.config.node_id, version, held, exc)
        return self.receiver.sync(version)

    def _check_base(self) -> None:
        """The guard's check (module doc): on a finding, report, stop serving, re-materialize."""
        if self.leases.distrusted is not None:
            return  # found already: re-materializing
        finding = self.guard.check()
        if finding is None:
            self._tell_hub()  # a no-op unless what it serves changed (the first check proved it)
            return
        log.error("node %s: re-materializing: %s", self.config.node_id, finding.detail)
        self.target.rematerialize(finding.detail, via=rematerializing(self.guard.target))
        self.on_event({"event": "base_modified", "version": finding.version,
                       "check": finding.check, "detail": finding.detail})

    def sync_to(self, version: int) -> bool:
        """Bring the target to `version` (see module docstring). False (and an event) on failure."""
        t0 = time.perf_counter()
        before = self.stats()
        try:
            self._check_base()
            held = self.target.held()
            rematerialized = self.leases.distrusted is not None
            if held is None:
                how, nbytes, served, extra = self._join(version)
            else:
                result = self._delta(version, held.version)
                how, nbytes, extra = "delta", result.bytes_fetched, {"pause_s": result.pause_seconds}
                served = {key_version(k) for k in result.route}
        except WeighthubError as exc:
            still = self.leases.held_versions()  # nothing while distrusted
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.error("node %s: sync to version %d failed, still at %s: %s", self.config.node_id,
                      version, still[0] if still else "nothing", self.last_error)
            self.on_event({"event": "error", "version": version,
                           "held": still[0] if still else None, "error": self.last_error})
            return False
        self.last_error = None
        now = self.target.held()
        if now is not None:
            self.guard.committed(now)
        for v in served | {version}:
            self.server.serve(v)
        self._tell_hub()
        stats = {k: v - before[k] for k, v in self.stats().items()}
        self.on_event({"event": "synced", "version": version, "root": now.root if now else None,
                       "from": held.version if held else None, "how": how, "bytes": nbytes,
                       "seconds": round(time.perf_counter() - t0, 4), "stats": stats,
                       "pushed": self.pushed, "rematerialized": rematerialized, **extra})
        return True

    def _join(self, version: int) -> tuple[str, int, set[int], dict[str, Any]]:
        """Elastic join from holders' dense bits; the store's route if that is not possible."""
        holders = self._holders(version)
        if holders:
            try:
                r = join_from_holders(self.target, self.manifests, version, holders, self.secret,
                                      stripes=self.config.stripes, timeouts=self.config.peer_timeouts)
                return "join", r.bytes, set(), {"by_holder": r.bytes_by_holder, "excluded": r.excluded}
            except WeighthubError as exc:
                log.warning("node %s: join of version %d from holders failed (%s); using the store "
                            "route", self.config.node_id, version, exc)
        result = self.receiver.sync(version)
        return "store", result.bytes_fetched, {key_version(k) for k in result.route}, {}

    def _holders(self, version: int) -> list[str]:
        if not self.latest.hub_up():
            return []
        try:
            found = self.hub.sources(f"{catalog.version_dir(version)}/dense", version,  # type: ignore[union-attr]
                                     dense=True)
        except VersionNotFound:
            return []  # the hub knows no such version (not announced): no holders, the store has it
        except WeighthubError as exc:
            self.latest.hub_failed(exc)
            return []
        return [a for a in found if a != self.server.address][: 2 * self.config.stripes]

    def _rank(self, ref: ChunkId) -> list[str]:
        if self.hub is None:
            return []
        return [a for a in self.hub.peer_sources(ref) if a != self.server.address]

    def stats(self) -> dict[str, int]:
        """Where this node's verified chunks came from, and failures, since it started."""
        served = dict(self.sources.served)
        cache, holders, store = (s.name for s in self.sources.sources)
        return {"from_cache": served.get(cache, 0), "from_peers": served.get(holders, 0),
                "from_backing": served.get(store, 0), "peer_failures": self.holders.stats.benched,
                "manifests_relayed": self.manifests.relayed}

    # -- holder bookkeeping ---------------------------------------------------------------------
    def _pushed(self, key: str, failed: list[str]) -> None:
        self.pushed += 1  # on the server's event loop: counting only; the heartbeat says the rest
        if self.hub is not None:
            self.hub.set_versions(self.server.versions())
        if key.endswith(f"/{catalog.PRIMARY}"):
            self._wake.set()  # a relayed manifest: the version is committed, sync now

    def _tell_hub(self) -> None:
        """Tell the hub what it serves now if that changed (also from ReadLeases.on_change)."""
        if self.hub is None:
            return
        hub = self.hub
        told = (self.server.versions(), self.leases.held_versions())
        if told == self._told:
            return
        self._told = told
        hub.set_versions(told[0])
        hub.set_serving(told[1])
        if not self.latest.hub_up():
            return  # the heartbeat thread tells it when it is back

        def beat() -> None:  # now rather than at the next beat, so newcomers find this holder
            try:
                hub.heartbeat()
            except WeighthubError as exc:
                self.latest.hub_failed(exc)
        threading.Thread(target=beat, name="node-beat", daemon=True).start()

    def _released(self, versions: list[int]) -> None:
        """The hub released these versions: stop serving them and drop their cached chunks."""
        held = self.target.held()
        drop = [v for v in versions if held is None or v != held.version]
        for v in drop:
            self.server.release(v)
            try:
                catalog.delete_version(self.cache, v)
            except WeighthubError as exc:  # a cache we cannot clean only costs space
                log.warning("could not drop version %d from the node cache: %s", v, exc)
        if drop and self.hub is not None:
            self.hub.set_versions(self.server.versions())
            self.on_event({"event": "released", "versions": drop})
