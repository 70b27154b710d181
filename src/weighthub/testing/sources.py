"""`SourceTests`: the behaviour every ChunkSource must have.

A source hands over a chunk's bytes, unchecked (the `SourceList` checks them): exactly the bytes
it holds, ObjectNotFound for a chunk it does not have, never longer than the call's timeout, and
safely from many threads. Subclass it and implement `make_source(chunks)`, a source holding
exactly those chunks. Abilities add kits: `SourceTimeoutTests` (a source that can stall:
implement `stalled_source()`), `CacheTests` (a ChunkCache serves what it `keep`s).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ..errors import ObjectNotFound, PeerRefused, PeerTimeout, StoreError, StoreTimeout, UsageError
from ..format import chunk_checksum
from ..sources import ChunkCache, ChunkId, ChunkSource
from ._check import raises

VERSION = 7
REP = f"v{VERSION:012d}/full.json"
SIZES = (1, 1000, 70_000, 300_001)  # odd sizes: no source may pad or round


def chunk_id(data: bytes, index: int, *, version: int = VERSION,
             token: str = "0123456789ab") -> ChunkId:
    """The ChunkId a manifest would give `data` as chunk `index` of a full representation."""
    key = f"v{version:012d}/full-{token}/c{index:06d}.whc"
    return ChunkId(version, f"v{version:012d}/full.json", index, key, len(data),
                   chunk_checksum(data))


def kit_chunks() -> dict[ChunkId, bytes]:
    """Chunks of random bytes (as a publisher's frames look to a source: opaque), new each call."""
    out = {}
    for i, size in enumerate(SIZES):
        data = os.urandom(size)
        out[chunk_id(data, i)] = data
    return out


class SourceTests:
    """Behaviour every ChunkSource must have. Subclasses implement `make_source`."""

    timeout_slack_s = 5.0  # allowance past a timeout for a loaded machine, not a speed target

    def make_source(self, chunks: dict[ChunkId, bytes]) -> ChunkSource:
        """A source that holds exactly `chunks` (called once per check)."""
        raise NotImplementedError("a SourceTests subclass implements make_source(chunks)")

    def test_is_a_source(self) -> None:
        source = self.make_source(kit_chunks())
        assert isinstance(source, ChunkSource)
        assert isinstance(source.name, str) and source.name

    def test_exact_bytes(self) -> None:
        chunks = kit_chunks()
        source = self.make_source(chunks)
        for ref, data in chunks.items():
            got = source.get_chunk(ref, timeout=30.0)
            assert bytes(got) == data, f"{source.name}: chunk {ref.key}: other bytes"

    def test_missing_chunk_is_object_not_found(self) -> None:
        chunks = kit_chunks()
        source = self.make_source(chunks)
        absent = b"absent chunk"
        # a chunk of a version the source has, and of another publish of it: not there
        for ref in (chunk_id(absent, len(chunks)), chunk_id(absent, 0, token="fedcba987654")):
            t0 = time.monotonic()
            with raises(ObjectNotFound):
                source.get_chunk(ref, timeout=30.0)
            assert time.monotonic() - t0 < self.timeout_slack_s, "a miss must not wait"
        # a version it does not have: a miss, or a holder's refusal naming what it serves
        with raises((ObjectNotFound, PeerRefused)):
            source.get_chunk(chunk_id(absent, 0, version=VERSION + 1), timeout=30.0)

    def test_errors_are_from_the_tree(self) -> None:
        source = self.make_source(kit_chunks())
        ref = chunk_id(b"absent", 99)
        try:
            source.get_chunk(ref, timeout=30.0)
        except ObjectNotFound as exc:
            assert isinstance(exc, StoreError)
        except (UsageError, StoreError) as exc:
            raise AssertionError(f"a missing chunk must be ObjectNotFound, got {exc!r}") from exc
        else:
            raise AssertionError(f"{source.name} served a chunk it was never given")

    def test_thread_safety(self) -> None:
        chunks = kit_chunks()
        source = self.make_source(chunks)
        refs = list(chunks) * 6

        def fetch(ref: ChunkId) -> bool:
            return bytes(source.get_chunk(ref, timeout=60.0)) == chunks[ref]

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(fetch, refs)), f"{source.name}: other bytes under threads"


class SourceTimeoutTests(SourceTests):
    """SourceTests plus: a fetch that cannot complete ends within its timeout. For sources that
    wait on something (a peer, a remote store); implement `stalled_source()` too."""

    def stalled_source(self) -> tuple[ChunkSource, ChunkId]:
        """A source and a chunk whose fetch would never complete (called once per try)."""
        raise NotImplementedError("a SourceTimeoutTests subclass implements stalled_source()")

    def test_honors_timeout(self) -> None:
        """A fetch that cannot complete ends in a timeout error about `timeout` after it began."""
        for timeout in (0.5, 1.5):
            source, ref = self.stalled_source()  # afresh: a source may bench what failed once
            t0 = time.monotonic()
            with raises((StoreTimeout, PeerTimeout)):
                source.get_chunk(ref, timeout=timeout)
            took = time.monotonic() - t0
            assert took < timeout + self.timeout_slack_s, f"timeout={timeout}: took {took:.2f}s"


class CacheTests(SourceTests):
    """SourceTests plus: a ChunkCache serves what it `keep`s, kept from many threads at once."""

    def test_cache_serves_what_it_keeps(self) -> None:
        source = self.make_source({})
        assert isinstance(source, ChunkCache), f"{source.name} has no keep(ref, data)"
        chunks = kit_chunks()
        errors: list[BaseException] = []

        def keep(ref: ChunkId) -> None:
            try:
                source.keep(ref, chunks[ref])
            except BaseException as exc:  # keep is best effort: it must never raise
                errors.append(exc)

        threads = [threading.Thread(target=keep, args=(ref,)) for ref in chunks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        for ref, data in chunks.items():
            assert bytes(source.get_chunk(ref, timeout=30.0)) == data
