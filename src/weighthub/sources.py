"""Chunk sources: whatever can hand over a chunk of a version, and the ordered list that checks it.

A receiver needs chunks; many places may have them. In the order a receiver asks them:

    host staging cache   chunks another process on this host already fetched (store/staging)
    pushed/relay cache   chunks a relay parent pushed to this node before it asked (cluster)
    holders              peers that hold the version, nearest first (cluster/peers)
    store                the object store: the authority, last

Each is a `ChunkSource`: `get_chunk(ref, timeout=...) -> bytes`, unchecked. `SourceList` asks
them in order and checks every chunk's size and SHA-256 against its manifest exactly once, here;
a source that misses, times out, refuses or returns other bytes is logged and the next one is
asked, so a slow or malicious holder costs one timeout and can never inject bits. Verified
chunks are offered to every source that `keep`s (caches), so this host can serve them in turn.

Only the store (or a manifest whose hash the hub recorded) is trusted for manifests: sources hand
over chunks, never manifests, and nothing here parses store keys to learn a version: the
`ChunkId` says which version, representation and chunk it is.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .errors import ChecksumError, NetError, ObjectNotFound, StoreError, UsageError
from .format import Manifest, chunk_checksum
from .format.manifest import CHUNK_CHECKSUM
from .store.base import Store

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class ChunkId:
    """One chunk of one representation of one version, as its manifest lists it."""

    version: int  # the version the representation brings a target to
    rep: str  # the representation's manifest key (e.g. 'v000000000042/delta-41.json')
    index: int  # position in the manifest's chunk table
    key: str  # the chunk object's store key
    size: int  # bytes of the chunk frame
    checksum: str  # SHA-256 hex of the frame

    @classmethod
    def of(cls, manifest: Manifest, rep: str, index: int) -> ChunkId:
        c = manifest.chunks[index]
        return cls(manifest.version, rep, index, c.key, c.size, c.checksum)


@runtime_checkable
class ChunkSource(Protocol):
    """Hands over the bytes of a chunk; `SourceList` checks them. Safe to share between threads.

    `get_chunk` raises ObjectNotFound when this source does not have the chunk, a StoreError or
    NetError (PeerTimeout / PeerRefused, StoreTimeout / StoreRefused) when it cannot answer; it
    waits at most `timeout` seconds.
    """

    name: str  # where the bytes came from, for messages ('store s3://b/p', 'peer 10.0.0.7:7001')

    def get_chunk(self, ref: ChunkId, *, timeout: float) -> bytes: ...


@runtime_checkable
class ChunkCache(ChunkSource, Protocol):
    """A source that also keeps verified chunks (staging cache, pushed cache)."""

    def keep(self, ref: ChunkId, data: bytes) -> None:
        """Store a chunk that passed its checksum. Best effort: never raises."""
        ...


class StoreSource:
    """The object store as the last (authoritative) source of chunks."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.name = f"store {store.url}"

    def get_chunk(self, ref: ChunkId, *, timeout: float) -> bytes:
        return self.store.get(ref.key)


def check_chunk(ref: ChunkId, data: bytes, where: str) -> None:
    """Raise ChecksumError unless `data` is the chunk `ref` names (size, then SHA-256)."""
    if len(data) != ref.size:
        raise ChecksumError(f"{where}: {len(data)} bytes, manifest says {ref.size}")
    digest = chunk_checksum(data)
    if digest != ref.checksum:
        raise ChecksumError(f"{where}: manifest {CHUNK_CHECKSUM}={ref.checksum[:12]}… computed "
                            f"{digest[:12]}…: the chunk is corrupt or not the one the manifest "
                            "names")


class SourceList:
    """Sources in order of preference; the last is normally the store (the authority).

    `fetch` returns the first copy that matches the manifest. If every source failed, it raises
    the error of the last one asked (the store's, when it is last: ObjectNotFound for a chunk
    retention deleted, ChecksumError for a corrupt stored chunk).
    """

    def __init__(self, sources: Sequence[ChunkSource]) -> None:
        if not sources:
            raise UsageError("a SourceList needs at least one source (e.g. the store)")
        self.sources = tuple(sources)

    @classmethod
    def of(cls, store_or_sources: Store | Sequence[ChunkSource] | SourceList) -> SourceList:
        if isinstance(store_or_sources, SourceList):
            return store_or_sources
        if isinstance(store_or_sources, Sequence):
            return cls(store_or_sources)
        return cls([StoreSource(store_or_sources)])

    def fetch(self, ref: ChunkId, *, timeout: float = DEFAULT_TIMEOUT_S) -> bytes:
        last: Exception | None = None
        for i, source in enumerate(self.sources):
            where = f"chunk {ref.key} from {source.name}"
            final = i == len(self.sources) - 1
            try:
                data = source.get_chunk(ref, timeout=timeout)
                check_chunk(ref, data, where)
            except (ObjectNotFound, ChecksumError, StoreError, NetError) as exc:
                if not isinstance(exc, ObjectNotFound) and not final:
                    log.warning("%s failed (%s); trying the next source", where, exc)
                last = exc
                continue
            self._keep(ref, data, served_by=source)
            return data
        assert last is not None
        raise last

    def _keep(self, ref: ChunkId, data: bytes, *, served_by: ChunkSource) -> None:
        for source in self.sources:
            if source is not served_by and isinstance(source, ChunkCache):
                source.keep(ref, data)
