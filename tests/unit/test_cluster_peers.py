"""A node's sources without peers: chunks from its cache (checked) or the store, relayed manifests
trusted only with the hub's digest, and a manifest view that never writes."""

from __future__ import annotations

import pytest
import torch

from weighthub import catalog
from weighthub.cluster.peers import HolderSource
from weighthub.cluster.relayed import RelayedManifests, relayed_manifest
from weighthub.errors import PeerUnavailable, UsageError
from weighthub.format import chunk_checksum
from weighthub.net.auth import load_secret
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.sources import ChunkId, SourceList, StoreCache, StoreSource
from weighthub.store import MemoryStore
from weighthub.targets import StateDictTarget
from weighthub.tensors import bits

SECRET = b"0123456789abcdef0123456789abcdef"


def published() -> tuple[MemoryStore, dict[str, torch.Tensor]]:
    store = MemoryStore()
    state = {"w": torch.randn(20_000).to(torch.bfloat16), "b": torch.randn(3000)}
    Publisher(store, full_span_bytes=8 << 10).publish(state)
    return store, state


def node_sources(store: MemoryStore, holders: HolderSource,
                 cache: MemoryStore | None = None) -> SourceList:
    """As a node orders them: its cache, the holders, the store."""
    return SourceList([StoreCache(cache if cache is not None else MemoryStore("cache")),
                       holders, StoreSource(store)])


def test_a_receiver_syncs_through_them_and_fills_the_cache() -> None:
    store, state = published()
    cache = MemoryStore("cache")
    sources = node_sources(store, HolderSource(lambda _r: [], SECRET), cache)
    target = StateDictTarget({})
    Receiver(store, target, sources=sources).sync()
    assert all((bits(target.state[n]) == bits(t)).all() for n, t in state.items())
    keys = [c.key for c in catalog.primary_manifest(store, 0).chunks]
    assert len(keys) > 1 and all(cache.get(k) == store.get(k) for k in keys)
    assert sources.served == {f"store {store.url}": len(keys)}


def test_a_corrupt_cached_chunk_is_not_used() -> None:
    store, state = published()
    cache = MemoryStore("cache")
    key = catalog.primary_manifest(store, 0).chunks[0].key
    blob = bytearray(store.get(key))
    blob[len(blob) // 2] ^= 1
    cache.put(key, bytes(blob))
    sources = node_sources(store, HolderSource(lambda _r: [], SECRET), cache)
    target = StateDictTarget({})
    Receiver(store, target, sources=sources).sync()
    assert all((bits(target.state[n]) == bits(t)).all() for n, t in state.items())
    assert cache.get(key) == store.get(key)  # replaced by the verified copy


def test_the_manifest_view_refuses_writes() -> None:
    store, _ = published()
    view = RelayedManifests(store)
    with pytest.raises(UsageError, match="read-only"):
        view.put("v000000000001/manifest.json", b"{}", create_only=True)
    with pytest.raises(UsageError, match="read-only"):
        view.delete("v000000000000/manifest.json")


def test_unreachable_peers_fall_back_to_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    store, state = published()
    monkeypatch.setenv("WEIGHTHUB_SECRET", SECRET.decode())
    # port 1 on loopback: connection refused at once; the peer is then skipped (cooldown)
    holders = HolderSource(lambda _r: ["127.0.0.1:1"], load_secret())
    target = StateDictTarget({})
    Receiver(store, target, sources=node_sources(store, holders)).sync()
    assert all((bits(target.state[n]) == bits(t)).all() for n, t in state.items())
    assert 1 <= holders.stats.benched <= 4  # the fetch threads that raced to it first


def test_a_failing_holder_ranking_falls_back_to_the_store() -> None:
    store, state = published()

    def hub_down(_ref: ChunkId) -> list[str]:
        raise PeerUnavailable("hub 127.0.0.1:9: no answer within 2s")

    target = StateDictTarget({})
    Receiver(store, target, sources=node_sources(store, HolderSource(hub_down, SECRET))).sync()
    assert all((bits(target.state[n]) == bits(t)).all() for n, t in state.items())


class _Counting(MemoryStore):
    """A MemoryStore that records manifest reads and listings (what crosses a region boundary)."""

    def __init__(self) -> None:
        super().__init__()
        self.metadata_reads: list[str] = []

    def get(self, key: str, **kw: float | None) -> bytes:
        if key.endswith(".json"):
            self.metadata_reads.append(key)
        return super().get(key, **kw)

    def children(self, prefix: str, **kw: float | None) -> list[str]:
        self.metadata_reads.append(f"list {prefix!r}")
        return super().children(prefix, **kw)


def test_a_relayed_manifest_spares_every_manifest_read_and_listing_of_the_store() -> None:
    store = _Counting()
    s0 = {"w": torch.randn(20_000).to(torch.bfloat16), "b": torch.randn(3000)}
    pub = Publisher(store, full_span_bytes=8 << 10)
    pub.publish(s0)
    target = StateDictTarget({})
    view = RelayedManifests(store)
    receiver = Receiver(view, target,
                        sources=node_sources(store, HolderSource(lambda _r: [], SECRET)))
    receiver.sync(0)
    s1 = {"w": s0["w"].clone(), "b": s0["b"] + 1}
    s1["w"][::97] += 1
    pub.publish(s1)
    raw = store.get(catalog.rep_key(1, None, primary=True))
    store.metadata_reads.clear()
    with view.trusted_route({1: raw}):
        receiver.sync(1)
    assert all((bits(target.state[n]) == bits(t)).all() for n, t in s1.items())
    assert store.metadata_reads == [] and view.relayed >= 1
    # outside the context, listings and manifests come from the store again
    assert view.children("") == store.children("")
    assert view.get(catalog.rep_key(1, None, primary=True)) == raw and store.metadata_reads


def test_a_relayed_manifest_is_trusted_only_with_the_hubs_digest() -> None:
    store, _ = published()
    key = catalog.rep_key(0, None, primary=True)
    good = store.get(key)
    cache = MemoryStore()
    assert relayed_manifest(cache, 0, chunk_checksum(good), where="t") is None  # not relayed
    cache.put(key, good)
    assert relayed_manifest(cache, 0, chunk_checksum(good), where="t") == good
    assert relayed_manifest(cache, 0, None, where="t") is None  # the hub recorded no digest
    forged = good.replace(b'"version"', b'"version" ', 1)
    cache.put(key, forged)
    assert forged != good and relayed_manifest(cache, 0, chunk_checksum(good), where="t") is None


def test_a_version_counts_as_relayed_only_with_every_chunk_at_its_size() -> None:
    """What a node daemon tells its engines before its own apply (`relayed_chunks`, `all_relayed`)."""
    from weighthub.cluster.relayed import all_relayed, relayed_chunks

    store, _ = published()
    key = catalog.rep_key(0, None, primary=True)
    raw = store.get(key)
    m = catalog.primary_manifest(store, 0)
    assert len(m.chunks) >= 2
    digest = chunk_checksum(raw)
    cache = MemoryStore()
    assert relayed_chunks(cache, 0, digest, where="t") is None  # no manifest relayed yet
    cache.put(key, raw)
    assert relayed_chunks(cache, 0, None, where="t") is None  # the hub vouched for nothing
    assert relayed_chunks(cache, 0, chunk_checksum(raw + b" "), where="t") is None  # another one
    chunks = relayed_chunks(cache, 0, digest, where="t")
    assert chunks == list(m.chunks)
    assert not all_relayed(cache, chunks)  # no chunk pushed yet
    for c in m.chunks[:-1]:
        cache.put(c.key, store.get(c.key))
    assert not all_relayed(cache, chunks)  # one missing
    last = m.chunks[-1]
    cache.put(last.key, store.get(last.key)[:-1])
    assert not all_relayed(cache, chunks)  # one cut short
    cache.put(last.key, store.get(last.key))
    assert all_relayed(cache, chunks)
