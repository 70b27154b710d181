"""Relayed manifests: a one-step refit that reads nothing from the store, trusting only the hub.

After a commit the publisher pushes the version's primary manifest down the relay tree (after
its chunks). A node uses that copy only if its SHA-256 is the one the hub recorded at the
commit (`relayed_manifest`); then, inside `RelayedManifests.trusted_route`, the manifest answers
the Receiver's manifest read and the listings it plans its route from name only that version,
so the refit's metadata comes from the relay and its chunks from the node's sources.

`RelayedManifests` is a read-only view of the store for manifests and listings, not a chunk
path: chunks come from the receiver's `SourceList` and are checked against these manifests.
Outside `trusted_route` (and for every other key) it reads the store.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping

from .. import catalog
from ..errors import FormatError, LimitError, StoreError, UsageError
from ..format import ChunkRef, chunk_checksum
from ..format.manifest import MAX_MANIFEST_BYTES, decode_manifest
from ..store.base import Readable, Store, check_max_bytes, too_large

log = logging.getLogger(__name__)


class RelayedManifests:
    """The store, read-only, whose manifests and listings relayed (hub-verified) ones may answer.

    `relayed` counts the manifest reads a relayed manifest answered (for the node's stats).
    """

    def __init__(self, backing: Store) -> None:
        self.backing = backing
        self.url = backing.url  # what the receiver records as the version's origin
        self.relayed = 0
        self._lock = threading.Lock()
        self._trusted: dict[str, bytes] = {}  # primary manifest key -> bytes (see trusted_route)
        self._listing: dict[str, list[str]] | None = None

    @contextlib.contextmanager
    def trusted_route(self, manifests: Mapping[int, bytes]) -> Iterator[None]:
        """Plan and stage from these verified primary manifests (version -> bytes).

        The caller must have checked every one against the hub's digest for its version. The
        store's root lists only their versions and their directories only the primary
        manifest, so a one-step refit reads nothing from the store; a route that also crosses
        other versions (a receiver more than one version behind) reads those from the store
        (NoSyncPath when there is no route: then sync without this).
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

    # -- reads -----------------------------------------------------------------------------------
    def get(self, key: str, *, timeout: float | None = None,
            max_bytes: int | None = None) -> bytes:
        check_max_bytes(max_bytes, f"get {key!r} in {self.url}")
        with self._lock:
            trusted = self._trusted.get(key)
            if trusted is not None:
                self.relayed += 1
        if trusted is None:
            return self.backing.get(key, timeout=timeout, max_bytes=max_bytes)
        if max_bytes is not None and len(trusted) > max_bytes:
            raise too_large(len(trusted), max_bytes, f"get {key!r} (relayed) in {self.url}")
        return trusted

    def get_range(self, key: str, start: int, stop: int, *, timeout: float | None = None) -> bytes:
        with self._lock:
            trusted = self._trusted.get(key)
        if trusted is not None:
            return trusted[max(0, start):max(0, stop)]
        return self.backing.get_range(key, start, stop, timeout=timeout)

    def size(self, key: str, *, timeout: float | None = None) -> int:
        with self._lock:
            trusted = self._trusted.get(key)
        return len(trusted) if trusted is not None else self.backing.size(key, timeout=timeout)

    def children(self, prefix: str, *, timeout: float | None = None) -> list[str]:
        with self._lock:
            listed = None if self._listing is None else self._listing.get(prefix)
        return list(listed) if listed is not None else self.backing.children(prefix, timeout=timeout)

    # -- writes: refused ---------------------------------------------------------------------------
    def put(self, key: str, data: bytes | memoryview, *, create_only: bool = False,
            timeout: float | None = None) -> None:
        raise UsageError(f"RelayedManifests over {self.url} is read-only (put {key!r}): "
                         "publishers write to the backing store, or through a RelayTee")

    def delete(self, key: str, *, timeout: float | None = None) -> None:
        raise UsageError(f"RelayedManifests over {self.url} is read-only (delete {key!r}): "
                         "delete from the backing store")


def relayed_manifest(cache: Readable, version: int, digest: str | None, *,
                     where: str) -> bytes | None:
    """The primary manifest of `version` a peer relayed into `cache`, if it hashes to `digest`
    (the SHA-256 the hub recorded at the commit); None when absent, unknown or different."""
    if digest is None:
        return None
    try:
        raw = cache.get(catalog.rep_key(version, None, primary=True), max_bytes=MAX_MANIFEST_BYTES)
    except (StoreError, LimitError):  # oversized counts as not relayed: the store has it
        return None  # not relayed (or not yet): the store has it
    return vouched(raw, version, digest, where=where)


def vouched(raw: bytes, version: int, digest: str | None, *, where: str) -> bytes | None:
    """`raw` if it hashes to `digest`, the SHA-256 the hub recorded for `version`'s primary
    manifest at the commit; None (logged when it differs) otherwise: read the store's."""
    if digest is None or len(raw) > MAX_MANIFEST_BYTES:
        return None
    got = chunk_checksum(raw)
    if got != digest:
        log.warning("%s: relayed manifest of version %d has SHA-256 %s…, the hub recorded %s…; "
                    "ignoring it, reading the store's", where, version, got[:12], digest[:12])
        return None
    return raw


def relayed_chunks(cache: Readable, version: int, digest: str | None, *,
                   where: str) -> list[ChunkRef] | None:
    """The chunks `version`'s relayed manifest names (None: no manifest relayed that hashes to
    the hub's `digest`, or one that does not parse)."""
    raw = relayed_manifest(cache, version, digest, where=where)
    return None if raw is None else manifest_chunks(raw, version, where=where)


def manifest_chunks(raw: bytes, version: int, *, where: str) -> list[ChunkRef] | None:
    """The chunks a relayed manifest of `version` names (None: it does not parse)."""
    try:
        return list(decode_manifest(raw, where=f"{where}: relayed manifest of version {version}")
                    .chunks)
    except FormatError:
        return None


def all_relayed(cache: Readable, chunks: list[ChunkRef]) -> bool:
    """Are all of `chunks` in `cache` at their manifest's sizes? (Their checksums are checked
    by whoever fetches them.) With the manifest relayed too, the node can serve the version
    before its own apply."""
    try:
        return all(cache.size(c.key) == c.size for c in chunks)
    except StoreError:  # one not (yet) pushed
        return False
