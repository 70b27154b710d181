"""The shipped `SourceTests` kit on every built-in chunk source.

Sources: the store (StoreSource), a store used as a cache (StoreCache), a node daemon's cache
read in place (NodeCacheReader), the host staging cache (StagingSource), one holder's chunk
server (PeerSource) and the ranked holders (HolderSource),
the last two against a real ChunkServer on loopback. Stalled: a memory store whose lock another
call holds, and a TCP server that accepts and never answers.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from silent_server import silent_server
from weighthub.cluster.peers import HolderSource, PeerSource
from weighthub.net.server import ChunkServer
from weighthub.sources import ChunkId, ChunkSource, NodeCacheReader, StoreCache, StoreSource
from weighthub.sources.staging import StagingSource
from weighthub.store import LocalStore, MemoryStore
from weighthub.testing import CacheTests, SourceTests, SourceTimeoutTests
from weighthub.testing.sources import VERSION, chunk_id

SECRET = os.urandom(32)


def _memory_with(chunks: dict[ChunkId, bytes]) -> MemoryStore:
    store = MemoryStore("source-kit")
    for ref, data in chunks.items():
        store.put(ref.key, data)
    return store


def _stalled_memory() -> tuple[MemoryStore, ChunkId]:
    ref = chunk_id(b"stalled", 0)
    store = _memory_with({ref: b"stalled"})
    store._lock.acquire()  # another call that never returns holds the store
    return store, ref


class TestStoreSource(SourceTimeoutTests):
    def make_source(self, chunks: dict[ChunkId, bytes]) -> ChunkSource:
        return StoreSource(_memory_with(chunks))

    def stalled_source(self) -> tuple[ChunkSource, ChunkId]:
        store, ref = _stalled_memory()
        return StoreSource(store), ref


class TestStoreCache(SourceTimeoutTests, CacheTests):
    def make_source(self, chunks: dict[ChunkId, bytes]) -> ChunkSource:
        return StoreCache(_memory_with(chunks))

    def stalled_source(self) -> tuple[ChunkSource, ChunkId]:
        store, ref = _stalled_memory()
        return StoreCache(store), ref


class TestNodeCacheReader(SourceTests):
    """A node daemon's relay cache (a LocalStore directory it fills), read in place."""

    @pytest.fixture(autouse=True)
    def _tmp(self, tmp_path: Path) -> None:
        self.tmp = tmp_path

    def make_source(self, chunks: dict[ChunkId, bytes]) -> ChunkSource:
        cache = LocalStore(tempfile.mkdtemp(dir=self.tmp, prefix="node-cache-"))
        for ref, data in chunks.items():  # as the daemon's chunk server stages pushes
            cache.put(ref.key, data)
        return NodeCacheReader(cache.root)


class TestStagingSource(CacheTests):
    @pytest.fixture(autouse=True)
    def _tmp(self, tmp_path: Path) -> None:
        self.tmp = tmp_path

    def make_source(self, chunks: dict[ChunkId, bytes]) -> ChunkSource:
        source = StagingSource(tempfile.mkdtemp(dir=self.tmp, prefix="stage-"))
        for ref, data in chunks.items():
            source.keep(ref, data)
        return source


@pytest.fixture
def silent_addr() -> Iterator[str]:
    """host:port of a TCP server that accepts connections and never answers."""
    with silent_server() as addr:
        yield addr


class _PeerKit(SourceTimeoutTests):
    """A real ChunkServer per source, serving VERSION from a memory store."""

    @pytest.fixture(autouse=True)
    def _servers(self, silent_addr: str) -> Iterator[None]:
        self.silent = silent_addr
        self.servers: list[ChunkServer] = []
        yield
        for server in self.servers:
            server.stop()

    def _serve(self, chunks: dict[ChunkId, bytes]) -> str:
        server = ChunkServer(_memory_with(chunks), SECRET).start()
        server.serve(VERSION)
        self.servers.append(server)
        return server.address


class TestPeerSource(_PeerKit):
    def make_source(self, chunks: dict[ChunkId, bytes]) -> ChunkSource:
        return PeerSource(self._serve(chunks), SECRET)

    def stalled_source(self) -> tuple[ChunkSource, ChunkId]:
        return PeerSource(self.silent, SECRET), chunk_id(b"stalled", 0)


class TestHolderSource(_PeerKit):
    def make_source(self, chunks: dict[ChunkId, bytes]) -> ChunkSource:
        addr = self._serve(chunks)
        return HolderSource(lambda ref: [addr], SECRET)

    def stalled_source(self) -> tuple[ChunkSource, ChunkId]:
        return HolderSource(lambda ref: [self.silent], SECRET), chunk_id(b"stalled", 0)
