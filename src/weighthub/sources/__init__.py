"""Chunk sources: whatever can hand over a chunk of a version, and the ordered list that checks it.

A receiver needs chunks; many places may have them. In the order a receiver asks them:

    node cache           chunks the relay tree pushed to this host's node daemon, read in
                         place by the engines beside it (NodeCacheReader)
    host staging cache   chunks another process on this host already fetched (sources.staging)
    pushed/relay cache   chunks a relay parent pushed to this node before it asked (StoreCache)
    holders              peers that hold the version, nearest first (cluster.peers)
    store                the object store: the authority, last (StoreSource)

Each is a `ChunkSource`: `get_chunk(ref, timeout=...) -> bytes`, unchecked. `SourceList` asks
them in order and checks every chunk's size and SHA-256 against its manifest exactly once, here;
a source that misses, times out, refuses or returns other bytes is logged and the next one is
asked, so a slow or malicious holder costs one timeout and can never inject bits. Verified
chunks are offered to every source that `keep`s (caches), so this host can serve them in turn,
except those a `host_local` source served: they are on this host already, for every process.

Two optional abilities let a source take part in that loop without checking anything itself:

    SourceGroup   interchangeable members (ranked holders): the list asks and checks them one by
                  one, and tells the group which member failed (so it can bench that peer)
    SharedCache   a cache shared between processes (host staging): `claim` either hands over
                  the cached bytes or makes this caller the one that fetches the chunk, holding
                  others off (bounded) until the verified copy is kept

Only the store (or a manifest whose hash the hub recorded) is trusted for manifests: sources hand
over chunks, never manifests, and nothing here parses store keys to learn a version: the
`ChunkId` says which version, representation and chunk it is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..errors import ChecksumError, LimitError, NetError, ObjectNotFound, StoreError, UsageError
from ..format import Manifest, chunk_checksum
from ..format.manifest import CHUNK_CHECKSUM
from ..store.base import Store
from ..store.local import LocalStore

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class ChunkId:
    """One chunk of one representation of one version, as its manifest lists it."""

    version: int  # the manifest's version (the directory the representation is stored under)
    rep: str  # the representation's manifest key (e.g. 'v000000000042/from-000000000041.json')
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
    waits at most `timeout` seconds. It reads no more than `ref.size` bytes (the manifest's size
    of the chunk) plus a bounded margin, refusing a larger object (LimitError, or the source's
    own refusal) before reading it, so a hostile source costs memory for one chunk at most.
    """

    name: str  # where the bytes came from, for messages ('store s3://b/p', 'peer 10.0.0.7:7001')

    def get_chunk(self, ref: ChunkId, *, timeout: float) -> bytes: ...


@runtime_checkable
class ChunkCache(ChunkSource, Protocol):
    """A source that also keeps verified chunks (staging cache, pushed cache)."""

    def keep(self, ref: ChunkId, data: bytes) -> None:
        """Store a chunk that passed its checksum. Best effort: never raises."""
        ...


@runtime_checkable
class SharedCache(ChunkCache, Protocol):
    """A cache several processes fill together, each chunk fetched by one of them.

    Lifecycle, per chunk, inside `SourceList.fetch`: `claim(ref)` is entered in place of
    `get_chunk`. It yields the cached bytes, or None on a miss, after which this caller is the
    one fetching: others claiming the same chunk wait (at most `timeout`) until the claim is
    left, which the list does only after it checked the chunk and `keep`-ed it (or gave up).
    """

    def claim(self, ref: ChunkId, *, timeout: float) -> AbstractContextManager[bytes | None]: ...


@runtime_checkable
class SourceGroup(ChunkSource, Protocol):
    """Interchangeable sources (the holders of a version, ranked), asked one by one.

    `SourceList` asks each of `members(ref)` in turn and checks its bytes, and calls
    `failed(member, exc)` for each one that failed, so the group can skip it for a while (a
    holder that timed out or sent other bytes). `get_chunk` alone answers from the first member
    that answers, unchecked, like any source.
    """

    def members(self, ref: ChunkId) -> Sequence[ChunkSource]: ...

    def failed(self, member: ChunkSource, exc: Exception) -> None: ...


class NodeCacheReader:
    """The chunk cache of this host's node daemon (its relay cache, a `StoreCache` directory),
    read in place by the engines beside it: a file read per chunk, no request to the daemon, no
    lock, no second copy in the host staging cache. Read only: the daemon fills it (a pushed
    chunk appears whole or not at all: `LocalStore` writes by rename). Its chunks are checked
    like any source's, so a corrupt file costs a fetch from the next source, never wrong bits.
    """

    host_local = True  # its chunks are on this host already: SourceList copies them nowhere

    def __init__(self, cache_dir: str | os.PathLike[str]) -> None:
        self.store = LocalStore(cache_dir, create=False)
        self.name = f"node cache {self.store.root}"

    def get_chunk(self, ref: ChunkId, *, timeout: float) -> bytes:
        return self.store.get(ref.key, timeout=timeout, max_bytes=ref.size)


class StoreSource:
    """The object store as the last (authoritative) source of chunks. An object larger than
    the manifest says is refused (LimitError) before it is read."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.name = f"store {store.url}"

    def get_chunk(self, ref: ChunkId, *, timeout: float) -> bytes:
        return self.store.get(ref.key, timeout=timeout, max_bytes=ref.size)


class StoreCache:
    """A store used as a chunk cache, by chunk key: a node's cache directory, which its chunk
    server serves from and relay pushes land in (`net.server`). Entries are only ever verified
    copies (`keep`) or pushes, and a push is checked like any source's bytes when it is read."""

    def __init__(self, store: Store, *, name: str | None = None) -> None:
        self.store = store
        self.name = name or f"cache {store.url}"

    def get_chunk(self, ref: ChunkId, *, timeout: float) -> bytes:
        return self.store.get(ref.key, timeout=timeout, max_bytes=ref.size)

    def keep(self, ref: ChunkId, data: bytes) -> None:
        try:  # overwrites a corrupt copy: `data` passed its checksum
            self.store.put(ref.key, data)
        except StoreError as exc:  # a full cache costs only the chance to serve this chunk
            log.warning("chunk %s: not kept in %s (%s)", ref.key, self.name, exc)


def check_chunk(ref: ChunkId, data: bytes, where: str) -> None:
    """Raise ChecksumError unless `data` is the chunk `ref` names (size, then SHA-256)."""
    if len(data) != ref.size:
        raise ChecksumError(f"{where}: {len(data)} bytes, manifest says {ref.size}")
    digest = chunk_checksum(data)
    if digest != ref.checksum:
        raise ChecksumError(f"{where}: manifest {CHUNK_CHECKSUM}={ref.checksum[:12]}… computed "
                            f"{digest[:12]}…: the chunk is corrupt or not the one the manifest "
                            "names")


# LimitError: a source's object is larger than the manifest says (refused before it was read)
_FAILURES = (ObjectNotFound, ChecksumError, LimitError, StoreError, NetError)


class SourceList:
    """Sources in order of preference; the last is normally the store (the authority).

    `fetch` returns the first copy that matches the manifest. If every source failed, it raises
    the error of the last one asked (the store's, when it is last: ObjectNotFound for a chunk
    retention deleted, ChecksumError for a corrupt stored chunk).

    `served` counts the verified chunks each source (by name) handed over, for reports.
    """

    def __init__(self, sources: Sequence[ChunkSource]) -> None:
        if not sources:
            raise UsageError("a SourceList needs at least one source (e.g. the store)")
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise UsageError(f"SourceList: source names must differ (they key `served`): {names}")
        self.sources = tuple(sources)
        self.served: Counter[str] = Counter()
        self._lock = threading.Lock()

    @classmethod
    def of(cls, store_or_sources: Store | Sequence[ChunkSource] | SourceList) -> SourceList:
        if isinstance(store_or_sources, SourceList):
            return store_or_sources
        if isinstance(store_or_sources, Sequence):
            return cls(store_or_sources)
        return cls([StoreSource(store_or_sources)])

    def fetch(self, ref: ChunkId, *, timeout: float = DEFAULT_TIMEOUT_S) -> bytes:
        """The chunk `ref`, checked against its size and SHA-256. Each source waits ≤ `timeout`."""
        last: Exception | None = None
        # claims on shared caches are held until the chunk was fetched, checked and kept (or
        # every source failed), so other processes wait for this copy instead of fetching it too
        with contextlib.ExitStack() as claims:
            for i, source in enumerate(self.sources):
                final = i == len(self.sources) - 1
                members = source.members(ref) if isinstance(source, SourceGroup) else (source,)
                for member in members:
                    try:
                        data = self._ask(member, ref, timeout, claims)
                        check_chunk(ref, data, f"chunk {ref.key} from {member.name}")
                    except _FAILURES as exc:
                        if member is not source and isinstance(source, SourceGroup):
                            source.failed(member, exc)
                        if not isinstance(exc, ObjectNotFound) and not final:
                            # a ChecksumError's message already names the chunk and the source
                            what = exc if isinstance(exc, ChecksumError | LimitError) else \
                                f"chunk {ref.key} from {member.name} failed ({exc})"
                            log.warning("%s; trying the next source", what)
                        last = exc
                        continue
                    with self._lock:
                        self.served[source.name] += 1
                    self._keep(ref, data, served_by=source)
                    return data
            if last is None:  # only groups without members: nobody was asked
                last = ObjectNotFound(f"chunk {ref.key}: no source has it "
                                      f"({', '.join(s.name for s in self.sources)})")
            raise last

    @staticmethod
    def _ask(source: ChunkSource, ref: ChunkId, timeout: float,
             claims: contextlib.ExitStack) -> bytes:
        if isinstance(source, SharedCache):
            data = claims.enter_context(source.claim(ref, timeout=timeout))
            if data is None:
                raise ObjectNotFound(f"chunk {ref.key}: not in {source.name}")
            return data
        return source.get_chunk(ref, timeout=timeout)

    def _keep(self, ref: ChunkId, data: bytes, *, served_by: ChunkSource) -> None:
        if getattr(served_by, "host_local", False):
            return
        for source in self.sources:
            if source is not served_by and isinstance(source, ChunkCache):
                source.keep(ref, data)
