"""SourceList: sources asked in order, each chunk checked exactly once, failover, groups, caches."""

from __future__ import annotations

import logging
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from weighthub import catalog
from weighthub.cluster.peers import HolderSource, PeerSource
from weighthub.errors import (
    ChecksumError,
    LimitError,
    ObjectNotFound,
    PeerTimeout,
    PeerUnavailable,
    StoreRefused,
    UsageError,
)
from weighthub.format import chunk_checksum
from weighthub.net.client import Timeouts
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.sources import (
    ChunkId,
    ChunkSource,
    NodeCacheReader,
    SourceList,
    StoreCache,
    StoreSource,
)
from weighthub.sources.staging import StagingSource
from weighthub.store import LocalStore, MemoryStore
from weighthub.targets import StateDictTarget
from weighthub.tensors import bits

DATA = b"the chunk's bytes"
REF = ChunkId(3, "v000000000003/manifest.json", 0, "v000000000003/full-x/c000000.whc",
              len(DATA), chunk_checksum(DATA))


class Fake:
    """A source that answers from a dict (or raises what it is given) and records the asks."""

    def __init__(self, name: str, answer: bytes | Exception | None = None) -> None:
        self.name = name
        self.answer = answer
        self.asked = 0
        self.kept: list[bytes] = []

    def get_chunk(self, ref: ChunkId, *, timeout: float) -> bytes:
        self.asked += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        if self.answer is None:
            raise ObjectNotFound(f"{ref.key} not in {self.name}")
        return self.answer


class FakeCache(Fake):
    def keep(self, ref: ChunkId, data: bytes) -> None:
        self.kept.append(data)


class FakeGroup(Fake):
    """A SourceGroup over fixed members, recording which ones failed."""

    def __init__(self, name: str, members: Sequence[Fake]) -> None:
        super().__init__(name)
        self._members = list(members)
        self.failures: list[tuple[str, type[Exception]]] = []

    def members(self, ref: ChunkId) -> list[Fake]:
        return self._members

    def failed(self, member: ChunkSource, exc: Exception) -> None:
        self.failures.append((member.name, type(exc)))


def corrupt(data: bytes) -> bytes:
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 1
    return bytes(flipped)


@pytest.fixture
def checksum_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts every chunk_checksum call made through any weighthub module, wherever imported."""
    calls: list[int] = []

    def counted(frame: bytes | memoryview) -> str:
        calls.append(len(frame))
        return chunk_checksum(frame)

    for name, module in list(sys.modules.items()):
        if name.startswith("weighthub") and getattr(module, "chunk_checksum", None) is chunk_checksum:
            monkeypatch.setattr(module, "chunk_checksum", counted)
    yield calls


def test_the_first_good_copy_wins_and_later_sources_are_not_asked() -> None:
    cache, store = FakeCache("cache", DATA), Fake("store", DATA)
    sources = SourceList([cache, store])
    assert sources.fetch(REF, timeout=1) == DATA
    assert (cache.asked, store.asked) == (1, 0) and sources.served == {"cache": 1}
    assert cache.kept == []  # not offered back to the source that served it


def test_a_miss_a_corrupt_copy_and_a_dead_source_fail_over_to_the_store(
        caplog: pytest.LogCaptureFixture) -> None:
    cache = FakeCache("cache")  # a miss: not worth a warning
    bad = Fake("peer bad", corrupt(DATA))
    dead = Fake("peer dead", PeerTimeout("peer dead: no answer within 1s"))
    store = Fake("store", DATA)
    sources = SourceList([cache, bad, dead, store])
    with caplog.at_level(logging.WARNING, logger="weighthub"):
        assert sources.fetch(REF, timeout=1) == DATA
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "peer bad" in warned[0] and "computed" in warned[0]
    assert "peer dead" in warned[1] and "next source" in warned[1]
    assert cache.kept == [DATA] and sources.served == {"store": 1}


def test_when_every_source_fails_the_last_error_is_raised() -> None:
    sources = SourceList([FakeCache("cache"), Fake("store", corrupt(DATA))])
    with pytest.raises(ChecksumError, match="from store: manifest sha256="):
        sources.fetch(REF, timeout=1)
    with pytest.raises(ObjectNotFound):
        SourceList([Fake("store")]).fetch(REF, timeout=1)
    with pytest.raises(ChecksumError, match="bytes, manifest says"):
        SourceList([Fake("store", DATA + b"x")]).fetch(REF, timeout=1)


def test_a_group_is_asked_member_by_member_and_told_who_failed() -> None:
    good = Fake("peer good", DATA)
    group = FakeGroup("holders", [Fake("peer lacks"), Fake("peer bad", corrupt(DATA)),
                                  Fake("peer slow", PeerTimeout("slow")), good])
    store = Fake("store", DATA)
    sources = SourceList([group, store])
    assert sources.fetch(REF, timeout=1) == DATA
    assert group.failures == [("peer lacks", ObjectNotFound), ("peer bad", ChecksumError),
                              ("peer slow", PeerTimeout)]
    assert good.asked == 1 and store.asked == 0 and sources.served == {"holders": 1}
    # a group with no members (no holder known) is simply passed
    assert SourceList([FakeGroup("none", []), store]).fetch(REF, timeout=1) == DATA
    with pytest.raises(ObjectNotFound, match="no source has it"):
        SourceList([FakeGroup("none", [])]).fetch(REF, timeout=1)


def test_source_names_must_differ() -> None:
    with pytest.raises(UsageError, match="names must differ"):
        SourceList([Fake("store"), Fake("store")])
    with pytest.raises(UsageError, match="at least one"):
        SourceList([])


def test_each_chunk_is_checked_exactly_once_per_fetch(checksum_calls: list[int],
                                                      tmp_path: Path) -> None:
    store = MemoryStore()
    state = {"w": torch.randn(20_000).to(torch.bfloat16), "b": torch.randn(3000)}
    Publisher(store, full_span_bytes=8 << 10).publish(state)
    chunks = catalog.primary_manifest(store, 0).chunks
    assert len(chunks) > 1
    stage = StagingSource(tmp_path / "stage")
    cache = StoreCache(MemoryStore("pushed"), name="pushed cache")
    holders = HolderSource(lambda _ref: [], b"s" * 32)
    sources = SourceList([stage, cache, holders, StoreSource(store)])
    for served_by in ("store", "staging"):  # a miss everywhere, then a hit in the first cache
        checksum_calls.clear()
        target = StateDictTarget({})
        Receiver(store, target, sources=sources).sync()
        assert all((bits(target.state[n]) == bits(t)).all() for n, t in state.items())
        assert sorted(checksum_calls) == sorted(c.size for c in chunks), served_by
    assert sources.served == {stage.name: len(chunks), sources.sources[-1].name: len(chunks)}


def test_holders_bench_a_peer_that_failed_and_not_one_that_lacked_a_chunk() -> None:
    holders = HolderSource(lambda _ref: ["h1:1", "h2:2", "h3:3"], b"s" * 32, cooldown_s=60)
    assert [m.addr for m in holders.members(REF)] == ["h1:1", "h2:2", "h3:3"]
    h1, h2, h3 = holders.members(REF)
    holders.failed(h1, ObjectNotFound("lacks it"))
    holders.failed(h2, ChecksumError("other bytes"))
    holders.failed(h3, PeerTimeout("slow"))
    assert [m.addr for m in holders.members(REF)] == ["h1:1"] and holders.stats.benched == 2
    holders.cooldown_s = 0.0
    holders.failed(h2, ChecksumError("other bytes"))
    time.sleep(0.01)
    assert "h2:2" in [m.addr for m in holders.members(REF)]  # the bench ends


def test_holders_without_a_ranking_are_skipped_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    def hub_down(_ref: ChunkId) -> list[str]:
        raise PeerUnavailable("hub 127.0.0.1:9: no answer within 2s")

    holders = HolderSource(hub_down, b"s" * 32)
    with caplog.at_level(logging.WARNING, logger="weighthub"):
        assert holders.members(REF) == []
    assert "no holder list" in caplog.text
    with pytest.raises(ObjectNotFound):
        holders.get_chunk(REF, timeout=1)


def test_a_peer_request_honors_the_fetch_timeout() -> None:
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        addr = f"127.0.0.1:{silent.getsockname()[1]}"
        peer = PeerSource(addr, b"s" * 32, timeouts=Timeouts(connect=5, io=30, deadline=60))
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailable, match=addr):
            peer.get_chunk(REF, timeout=0.3)
        assert time.monotonic() - t0 < 3
        holders = HolderSource(lambda _ref: [addr], b"s" * 32,
                               timeouts=Timeouts(connect=5, io=30, deadline=60))
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailable):
            holders.get_chunk(REF, timeout=0.3)
        assert time.monotonic() - t0 < 3 and holders.stats.benched == 1


def test_a_store_cache_keeps_verified_copies_and_survives_a_failing_store() -> None:
    class Full(MemoryStore):
        def put(self, key: str, data: bytes | memoryview, **kw: object) -> None:
            raise StoreRefused("disk full")

    cache = StoreCache(MemoryStore("c"))
    cache.keep(REF, DATA)
    assert cache.get_chunk(REF, timeout=1) == DATA and cache.name.startswith("cache memory:")
    StoreCache(Full("f")).keep(REF, DATA)  # best effort: logged, never raised


def test_an_oversized_cached_copy_is_refused_unread_and_replaced() -> None:
    """A cache holding a far larger object under the chunk's key: refused by its size
    (LimitError, before reading it), the store's copy is used and kept in its place."""
    cache_store, store = MemoryStore("oversized-cache"), MemoryStore("oversized-store")
    cache_store.put(REF.key, b"x" * (1 << 20))
    store.put(REF.key, DATA)
    cache = StoreCache(cache_store)
    assert SourceList([cache, StoreSource(store)]).fetch(REF) == DATA
    assert cache_store.get(REF.key) == DATA
    fails = SourceList([StoreSource(cache_store)])
    cache_store.put(REF.key, b"x" * (1 << 20))
    with pytest.raises(LimitError, match=f"{REF.key}.*{1 << 20} bytes"):
        fails.fetch(REF)


def test_a_node_cache_is_read_in_place_and_copied_nowhere(tmp_path: Path) -> None:
    """Engines read the chunks pushed to their node daemon from its cache directory: no copy of
    them goes into the host staging cache (they are on this host already). A corrupt file there
    is refused by its checksum and the next source's copy is used (and kept by the caches);
    the daemon's directory is never written."""
    daemon = LocalStore(tmp_path / "cache")
    daemon.put(REF.key, DATA)
    staging = StagingSource(tmp_path / "stage")
    node = NodeCacheReader(tmp_path / "cache")
    store = MemoryStore("node-cache-store")
    store.put(REF.key, DATA)
    sources = SourceList([node, staging, StoreSource(store)])
    assert sources.fetch(REF) == DATA
    assert sources.served == {node.name: 1}
    with pytest.raises(ObjectNotFound):
        staging.get_chunk(REF, timeout=1)  # no second copy on the host
    daemon.put(REF.key, corrupt(DATA))
    assert sources.fetch(REF) == DATA  # the store's copy, after the checksum refused the file
    assert staging.get_chunk(REF, timeout=1) == DATA  # kept: it came from off the host
    assert daemon.get(REF.key) == corrupt(DATA)  # read only: the daemon repairs its own cache
    missing = NodeCacheReader(tmp_path / "no-daemon-here")  # a node without a cache yet: a miss
    assert SourceList([missing, StoreSource(store)]).fetch(REF) == DATA
    assert not (tmp_path / "no-daemon-here").exists()
