"""PeerStore: a read-only Store for receivers that gets chunks from peers, verified, with failover.

Where a chunk comes from, in order:
    1. the node's local cache (chunks a relay parent pushed, or fetched earlier);
    2. the peers `sources(key)` names, best first (the hub's ranking; any callable);
    3. the backing store (local directory or S3), the source of truth.
Everything else (manifests, listings) comes only from the backing store: a manifest's
create-only write is the commit, and it is the trust anchor. Every chunk from the cache or a
peer is checked against the size and checksum (SHA-256) in its manifest before it is
returned; a mismatch, timeout, refusal or dead peer is logged with the peer's address and the
next source is tried. So a malicious or slow holder can neither inject bits nor hang the
receiver: each peer is bounded by the client's deadline, and a peer that failed is skipped for
`cooldown_s`, so one bad holder costs one timeout, not one per chunk. Verified chunks are kept
in the cache, so this node can serve them in turn.

Relayed manifests: inside `trusted_route(manifests)` the given primary manifests (relayed by a
peer; the caller checked each against the SHA-256 the hub recorded at the commit) answer reads
of their keys, and the listings a Receiver plans its route from name only their versions, so
a one-step refit reads nothing from the backing store. Nothing else is ever taken from a peer
except chunks checked against a manifest.

The manifest that lists a chunk is found from the chunk's key: manifests read through this
store are indexed as they pass (the Receiver reads them before their chunks); otherwise the
version's manifests are read from the backing store on demand. A chunk no manifest lists is
read from the backing store only.

Writes are refused (UsageError): a receiver never writes; a publisher writes through the
backing store (or a `RelayTee`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from .. import catalog
from ..errors import FormatError, NetError, ObjectNotFound, StoreError, UsageError
from ..format import chunk_checksum, decode_manifest
from ..net.client import PeerClient, Timeouts
from ..net.server import key_version
from ..store.base import Store
from ..store.staging import CHUNK_SUFFIX

log = logging.getLogger(__name__)
FETCH_TIMEOUTS = Timeouts(connect=2.0, io=5.0, deadline=30.0)


@dataclass(slots=True)
class PeerStoreStats:
    from_cache: int = 0
    from_peers: int = 0
    from_backing: int = 0
    peer_failures: int = 0
    manifests_relayed: int = 0  # manifest reads answered by a relayed (hub-verified) manifest


class PeerStore:
    """See the module docstring.

    Args:
        backing: the object store (source of truth for manifests; last resort for chunks).
        sources: key -> ranked peer addresses ("host:port") that may hold it.
        secret: the shared secret for the peers.
        cache: the node's local chunk cache (shared with its ChunkServer), or None.
        timeouts: per peer request (see PeerClient).
        cooldown_s: how long a peer that failed is skipped.
    """

    def __init__(self, backing: Store, sources: Callable[[str], Sequence[str]], secret: bytes, *,
                 cache: Store | None = None, timeouts: Timeouts = FETCH_TIMEOUTS,
                 cooldown_s: float = 30.0) -> None:
        self.backing = backing
        self.url = backing.url  # what the receiver records as the version's origin
        self.sources = sources
        self.secret = secret
        self.cache = cache
        self._timeouts = timeouts
        self._refs: dict[str, tuple[int, str]] = {}  # chunk key -> (size, checksum)
        self._indexed: set[int] = set()  # versions whose manifests were all read
        self._cooldown_s = cooldown_s
        self._benched: dict[str, float] = {}  # peer -> monotonic time until which it is skipped
        self._lock = threading.Lock()
        self._trusted: dict[str, bytes] = {}  # primary manifest key -> bytes (see trusted_route)
        self._listing: dict[str, list[str]] | None = None
        self.stats = PeerStoreStats()

    @contextlib.contextmanager
    def trusted_route(self, manifests: Mapping[int, bytes]) -> Iterator[None]:
        """Plan and stage from these verified primary manifests (version -> bytes); see module doc.

        The caller must have checked every one against the hub's digest for its version. Only
        their versions are listed, so the Receiver's route is their chain of primary deltas
        (NoSyncPath when they do not chain from what it holds: then sync without this).
        """
        trusted = {catalog.rep_key(v, None, primary=True): bytes(raw) for v, raw in manifests.items()}
        listing = {"": [catalog.version_dir(v) for v in sorted(manifests)],
                   **{catalog.version_dir(v): [catalog.PRIMARY] for v in manifests}}
        with self._lock:
            self._trusted, self._listing = trusted, listing
        try:
            yield
        finally:
            with self._lock:
                self._trusted, self._listing = {}, None

    # -- reads ------------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        if not key.endswith(CHUNK_SUFFIX):
            with self._lock:
                trusted = self._trusted.get(key)
            if trusted is not None:
                self._count("manifests_relayed")
            data = trusted if trusted is not None else self.backing.get(key)
            if key.endswith(".json"):
                self._index(key, data)
            return data
        ref = self._expected(key)
        if ref is None:
            return self._from_backing(key)
        if self.cache is not None:
            try:
                data = self.cache.get(key)
            except StoreError:
                pass
            else:
                if self._check(key, data, ref, "the local cache"):
                    self._count("from_cache")
                    return data
        for addr in self._sources(key):
            if self._benched.get(addr, 0.0) > time.monotonic():
                continue
            try:
                data = PeerClient(addr, self.secret, timeouts=self._timeouts).get(key)
            except ObjectNotFound:
                continue  # a holder that lacks one chunk may have the next: no penalty
            except NetError as exc:
                log.warning("chunk %s: peer %s failed (%s); trying the next source", key, addr, exc)
                self._bench(addr)
                continue
            if self._check(key, data, ref, f"peer {addr}"):
                self._count("from_peers")
                self._keep(key, data)
                return data
            self._bench(addr)
        data = self._from_backing(key)
        if self._check(key, data, ref, f"store {self.backing.url}"):
            self._keep(key, data)
        return data  # a corrupt stored chunk is the Receiver's to report (ChecksumError)

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        if key.endswith(CHUNK_SUFFIX):
            return self.get(key)[start:stop]
        return self.backing.get_range(key, start, stop)

    def size(self, key: str) -> int:
        ref = self._expected(key) if key.endswith(CHUNK_SUFFIX) else None
        return ref[0] if ref is not None else self.backing.size(key)

    def children(self, prefix: str) -> list[str]:
        with self._lock:
            listed = None if self._listing is None else self._listing.get(prefix)
        return list(listed) if listed is not None else self.backing.children(prefix)

    # -- writes -----------------------------------------------------------------------------
    def put(self, key: str, data: bytes | memoryview, *, create_only: bool = False) -> None:
        raise UsageError(f"PeerStore over {self.url} is read-only (put {key!r}): publishers write "
                         "to the backing store, or through a RelayTee")

    def delete(self, key: str) -> None:
        raise UsageError(f"PeerStore over {self.url} is read-only (delete {key!r}): delete from "
                         "the backing store")

    # -- helpers ----------------------------------------------------------------------------
    def _count(self, field: str) -> None:
        with self._lock:
            setattr(self.stats, field, getattr(self.stats, field) + 1)

    def _sources(self, key: str) -> Sequence[str]:
        try:
            return self.sources(key)
        except NetError as exc:  # the hub is down or slow: the store still has every chunk
            log.warning("chunk %s: no peer list (%s); reading the store", key, exc)
            return ()

    def _bench(self, addr: str) -> None:
        with self._lock:
            self.stats.peer_failures += 1
            self._benched[addr] = time.monotonic() + self._cooldown_s

    def _from_backing(self, key: str) -> bytes:
        data = self.backing.get(key)
        self._count("from_backing")
        return data

    def _keep(self, key: str, data: bytes) -> None:
        if self.cache is None:
            return
        try:
            self.cache.put(key, data)
        except StoreError as exc:  # a full cache costs only the chance to serve this chunk
            log.warning("chunk %s: not cached (%s)", key, exc)

    @staticmethod
    def _check(key: str, data: bytes, ref: tuple[int, str], where: str) -> bool:
        size, checksum = ref
        if len(data) == size and chunk_checksum(data) == checksum:
            return True
        log.warning("chunk %s from %s does not match its manifest (%d bytes, expected %d, or a "
                    "different checksum); trying the next source", key, where, len(data), size)
        return False

    def _index(self, key: str, data: bytes) -> None:
        try:
            m = decode_manifest(data, where=f"{self.backing.url}/{key}")
        except FormatError:
            return  # the caller parses it too and reports the error properly
        with self._lock:
            for c in m.chunks:
                self._refs[c.key] = (c.size, c.checksum)

    def _expected(self, key: str) -> tuple[int, str] | None:
        with self._lock:
            ref = self._refs.get(key)
        if ref is not None:
            return ref
        try:
            version = key_version(key)
        except FormatError:
            return None
        if version in self._indexed:
            return None
        vdir = key.split("/", 1)[0]
        for name in self.backing.children(vdir):
            if name.endswith(".json"):
                try:
                    self._index(f"{vdir}/{name}", self.backing.get(f"{vdir}/{name}"))
                except ObjectNotFound:
                    continue
        with self._lock:
            self._indexed.add(version)
            return self._refs.get(key)


def relayed_manifest(cache: Store, version: int, digest: str | None, *, where: str) -> bytes | None:
    """The primary manifest of `version` a peer relayed into `cache`, if it hashes to `digest`
    (the SHA-256 the hub recorded at the commit); None when absent, unknown or different."""
    if digest is None:
        return None
    try:
        raw = cache.get(catalog.rep_key(version, None, primary=True))
    except StoreError:
        return None  # not relayed (or not yet): the store has it
    got = chunk_checksum(raw)
    if got != digest:
        log.warning("%s: relayed manifest of version %d has SHA-256 %s…, the hub recorded %s…; "
                    "ignoring it, reading the store's", where, version, got[:12], digest[:12])
        return None
    return raw
