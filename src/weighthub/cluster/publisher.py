"""NetPublisher: a Publisher whose chunks go down the hub's relay tree while it is still encoding.

Per version v:
    plan      `hub.plan(v, publisher=id)`: the refit's relay tree over the subscribed nodes
              (each region boundary crossed once); turned into `wire.Hop`s for a `RelayTee`
    stream    the Publisher encodes chunk after chunk; each `put` writes the chunk to the store
              and pushes it to the tree's roots, which forward it cut-through to their subtrees
    repair    before each chunk, nodes the last pushes could not reach are probed; the dead
              ones are reported (`hub.report_failed`) and the hub's replan (or, when the hub
              does not answer, the same `plan.replan` computed here) re-attaches their children,
              so later chunks reach them; the chunks they missed they fetch after the commit
              from holders or the store (the node's sources)
    commit    the manifest's create-only write (to the store only) ends the relay; then
              `hub.announce(v, ..., manifest_sha256)`. A hub that does not answer never fails a
              publish: the version is committed in the store, and nodes poll (hub, else store);
              the announcement is retried after each heartbeat the hub answers (a restarted hub
              would name the version before to its nodes) until one lands or a newer one does
    notify    once the hub has the manifest's digest, the manifest itself is pushed down the
              tree as it stood at the commit: each node learns of v from that push (no fast
              polling across a region boundary) and trusts the manifest only if it hashes to
              the digest the hub recorded; nodes the push misses find v by their slow poll

The publisher is a holder too: its ChunkServer serves every version it committed from the
store it wrote (it stops when the hub releases one).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

import torch

from .. import catalog
from ..errors import NetError, WeighthubError
from ..net import wire
from ..net.client import DEFAULT_TIMEOUTS, PeerClient, Timeouts
from ..net.server import ChunkServer
from ..publish import Publisher, PublishResult
from ..store.base import Store
from .hubclient import HubClient, Plan
from .plan import RelayTree, replan
from .relay import RelayTee

log = logging.getLogger(__name__)
PROBE = Timeouts(connect=1.0, io=2.0, deadline=3.0)


@dataclass(frozen=True, slots=True)
class NetPublishResult(PublishResult):
    """A PublishResult (every field of it: version, base, payload_bytes, changed_fraction, ...)
    plus what the relay did: nodes planned, pushes, nodes declared dead, the announcement."""

    planned: int = 0  # nodes in the relay tree at the start
    pushed: int = 0  # chunk pushes to roots (each reaches a whole subtree)
    dead: tuple[str, ...] = ()  # node ids reported failed during this refit
    announced: bool = False  # the hub acknowledged the commit
    # around the Publisher's `seconds`: asking the hub for the relay plan before it, and after
    # the commit serving the version, announcing it and pushing the manifest down the tree
    plan_seconds: float = 0.0
    announce_seconds: float = 0.0

    @classmethod
    def of(cls, result: PublishResult, *, planned: int, pushed: int, dead: tuple[str, ...],
           announced: bool, plan_seconds: float, announce_seconds: float) -> NetPublishResult:
        return cls(**{f.name: getattr(result, f.name) for f in fields(PublishResult)},
                   planned=planned, pushed=pushed, dead=dead, announced=announced,
                   plan_seconds=plan_seconds, announce_seconds=announce_seconds)


class _CommitHook:
    """The Publisher's store. Chunk writes go through the RelayTee (stored, and pushed down the
    tree); the manifest's create-only write (the commit) ends the relay first. Reads, listings
    and deletes (a restarted publisher adopting the store's head, retention, a failed publish's
    clean-up) go straight to the backing store, with their per-call timeouts."""

    def __init__(self, tee: RelayTee, on_commit: Callable[[bytes], None]) -> None:
        self.tee = tee
        self.backing: Store = tee.backing
        self.url = tee.url
        self.on_commit = on_commit

    def put(self, key: str, data: bytes | memoryview, *, create_only: bool = False) -> None:
        if create_only and key.endswith(catalog.PRIMARY):
            self.on_commit(bytes(data))  # every chunk is stored; anchors written after it stay local
        self.tee.put(key, data, create_only=create_only)

    def get(self, key: str, *, timeout: float | None = None,
            max_bytes: int | None = None) -> bytes:
        return self.backing.get(key, timeout=timeout, max_bytes=max_bytes)

    def get_range(self, key: str, start: int, stop: int, *, timeout: float | None = None) -> bytes:
        return self.backing.get_range(key, start, stop, timeout=timeout)

    def size(self, key: str, *, timeout: float | None = None) -> int:
        return self.backing.size(key, timeout=timeout)

    def delete(self, key: str, *, timeout: float | None = None) -> None:
        self.backing.delete(key, timeout=timeout)

    def children(self, prefix: str, *, timeout: float | None = None) -> list[str]:
        return self.backing.children(prefix, timeout=timeout)


class NetPublisher:
    """See the module docstring. `start()` before publishing, `close()` after.

    Args:
        store: the object store versions are committed to.
        secret: the shared secret.
        hub: the hub (None: publish to the store only, no relay).
        publisher_id: holder id (default: the Publisher's id).
        degree: relay fan-out (default: the hub's).
        host, port: where its chunk server listens.
        timeouts: per push (PeerClient).
        publisher_options: passed to `Publisher` (anchor_every, retain, workers, ...).
    """

    def __init__(self, store: Store, secret: bytes, *, hub: HubClient | None,
                 publisher_id: str | None = None, degree: int | None = None,
                 host: str = "127.0.0.1", port: int = 0, timeouts: Timeouts = DEFAULT_TIMEOUTS,
                 **publisher_options: object) -> None:
        self.store = store
        self.secret = secret
        self.hub = hub
        self.degree = degree
        self.tee = RelayTee(store, self._tree, secret, timeouts=timeouts)
        self.publisher = Publisher(_CommitHook(self.tee, self._end_relay), **publisher_options)  # type: ignore[arg-type]
        self.id = publisher_id or self.publisher.id
        self.server = ChunkServer(store, secret, host=host, port=port)
        self._lock = threading.Lock()
        self._version = -1
        self._plan: RelayTree | None = None
        self._addresses: dict[str, str] = {}
        self._hops: list[wire.Hop] = []
        self._seen_failed: set[str] = set()
        self._dead: list[str] = []
        self._committed: tuple[bytes, list[wire.Hop]] | None = None  # manifest, tree at the commit
        self._unannounced: tuple[int, bytes | None] | None = None  # committed, the hub not told
        self._announcing = threading.Lock()  # one announcement at a time, in version order

    @property
    def address(self) -> str:
        return self.server.address

    def relay_roots(self) -> list[str]:
        """Addresses the current refit's chunks are pushed to (empty outside a publish)."""
        with self._lock:
            return [h.addr for h in self._hops]

    def start(self) -> NetPublisher:
        self.server.start()
        for v in catalog.list_versions(self.store)[-1:]:
            self.server.serve(v)
        if self.hub is not None:
            self.hub.on_release = self._released
            self.hub.on_beat = self._retry_announce
            try:
                # dense=False: its server has no target to read dense bits from (joins skip it)
                self.hub.register(self.id, self.server.address, versions=self.server.versions(),
                                  dense=False)
            except WeighthubError as exc:
                log.warning("publisher %s: hub %s: %s; publishing without a relay until it answers",
                            self.id, self.hub.address, exc)
            self.hub.start_heartbeat()
        return self

    def close(self) -> None:
        if self.hub is not None:
            self.hub.stop(leave=True)
        self.tee.close()
        self.server.stop()

    # -- publishing -----------------------------------------------------------------------------
    def publish(self, state: Mapping[str, torch.Tensor], *, donate: bool = False) -> NetPublishResult:
        """Commit `state` as the next version, relayed while encoding; announce it to the hub.
        `donate`: as `Publisher.publish`.

        Returns a NetPublishResult: the Publisher's PublishResult fields plus the relay's.
        Raises what `Publisher.publish` raises (the store's errors, ModelMismatch, ObjectExists);
        never a hub or relay failure.
        """
        t0 = time.perf_counter()
        current = self.publisher.version
        version = 0 if current is None else current + 1
        planned = self._start_relay(version)
        pushed0 = self.tee.pushed
        t1 = time.perf_counter()
        try:
            result = self.publisher.publish(state, donate=donate)
        finally:
            self._end_relay()
        t2 = time.perf_counter()
        self.server.serve(result.version)
        announced = self._announce(result.version)
        with self._lock:
            dead, committed, self._committed = tuple(self._dead), self._committed, None
        if announced and committed is not None and committed[1]:
            self.tee.push_object(catalog.rep_key(result.version, None, primary=True), *committed)
        return NetPublishResult.of(result, planned=planned, pushed=self.tee.pushed - pushed0,
                                   dead=dead, announced=announced, plan_seconds=t1 - t0,
                                   announce_seconds=time.perf_counter() - t2)

    def _start_relay(self, version: int) -> int:
        plan: Plan | None = None
        if self.hub is not None:
            try:
                plan = self.hub.plan(version, publisher=self.id, degree=self.degree)
            except WeighthubError as exc:
                log.warning("publisher %s: no relay plan for version %d (%s); store only",
                            self.id, version, exc)
        with self._lock:
            self._version = version
            self._seen_failed = set(self.tee.failed)
            self._dead = []
            self._committed = None
            self._plan = plan.tree if plan else None
            self._addresses = dict(plan.addresses) if plan else {}
            self._hops = self._to_hops()
            return 0 if self._plan is None else len(self._plan.labels) - 1

    def _end_relay(self, manifest: bytes | None = None) -> None:
        """The relay ends (at the commit: `manifest` is what was committed, kept to notify)."""
        with self._lock:
            if manifest is not None and self._plan is not None:
                self._committed = (manifest, self._hops)
            self._plan, self._hops = None, []

    def _tree(self) -> list[wire.Hop]:
        """The roots to push the next chunk to (RelayTee asks before every chunk)."""
        with self._lock:
            if self._plan is None:
                return []
            new = set(self.tee.failed) - self._seen_failed
            if new:
                self._seen_failed |= new
                self._repair(new)
            return self._hops

    def _repair(self, unreached: set[str]) -> None:
        """Probe nodes a push did not reach; replan around the dead ones (under the lock).

        A push that fails at one node is reported for its whole subtree; only the nodes that
        do not answer a probe are dead, the others just lost their parent.
        """
        if self._plan is None:
            return
        ids = {addr: nid for nid, addr in self._addresses.items()}
        dead = [ids[a] for a in sorted(unreached) if a in ids and not _alive(a, self.secret)]
        if not dead:
            return
        log.warning("publisher %s: relay nodes %s are dead; replanning version %d", self.id, dead,
                    self._version)
        self._dead.extend(dead)
        tree: RelayTree | None = None
        if self.hub is not None:
            try:
                plan = self.hub.report_failed(self._version, dead)
                tree, self._addresses = plan.tree, dict(plan.addresses)
            except WeighthubError as exc:
                log.warning("publisher %s: hub replan failed (%s); replanning locally", self.id, exc)
        self._plan = tree or replan(self._plan, dead)
        self._hops = self._to_hops()

    def _to_hops(self) -> list[wire.Hop]:
        """The plan as Hops below the publisher; a node without a known address is skipped
        (its children hang from its parent)."""
        tree = self._plan
        if tree is None:
            return []

        def below(node: str) -> list[wire.Hop]:
            out: list[wire.Hop] = []
            for child in tree.children.get(node, ()):
                addr = self._addresses.get(child)
                if addr is None:
                    out.extend(below(child))
                else:
                    out.append(wire.Hop(addr, below(child)))
            return out

        return below(tree.root)

    def _announce(self, version: int) -> bool:
        if self.hub is None:
            return False
        with self._announcing:
            with self._lock:
                raw = self._committed[0] if self._committed is not None else None
                pending = self._unannounced = (version, raw)  # supersedes an older one
            return self._tell_hub(pending, first=True)

    def _retry_announce(self) -> None:
        """`hub.on_beat` (the hub answered a heartbeat): announce the committed version it did
        not take, if any."""
        with self._announcing:
            with self._lock:
                pending = self._unannounced
            if pending is not None:
                self._tell_hub(pending, first=False)

    def _tell_hub(self, pending: tuple[int, bytes | None], *, first: bool) -> bool:
        version, raw = pending
        try:
            self.hub.announce_committed(self.store, version, publisher=self.id, manifest=raw)  # type: ignore[union-attr]
            self.hub.set_versions(self.server.versions())  # type: ignore[union-attr]
        except NetError as exc:
            log.warning("publisher %s: version %d is committed in %s but the hub did not take the "
                        "announcement (%s); retried after each heartbeat the hub answers, nodes "
                        "read the store meanwhile", self.id, version, self.store.url, exc)
            return False
        except WeighthubError as exc:  # the hub answered and refused (a newer version, ...)
            log.warning("publisher %s: the hub refused version %d (%s); not retried", self.id,
                        version, exc)
            self._settled(pending)
            return False
        if not first:
            log.info("publisher %s: the hub took version %d's announcement on a retry", self.id, version)
        self._settled(pending)
        return True

    def _settled(self, pending: tuple[int, bytes | None]) -> None:
        with self._lock:  # unless a newer version superseded it meanwhile
            if self._unannounced == pending:
                self._unannounced = None

    def _released(self, versions: list[int]) -> None:
        for v in versions:
            self.server.release(v)
        if self.hub is not None:
            self.hub.set_versions(self.server.versions())


def _alive(addr: str, secret: bytes) -> bool:
    try:
        PeerClient(addr, secret, timeouts=PROBE).versions()
        return True
    except WeighthubError:
        return False
