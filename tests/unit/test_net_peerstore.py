"""PeerStore without peers: manifests only from the backing store, cached chunks verified, no writes."""

from __future__ import annotations

import pytest
import torch

from weighthub import catalog
from weighthub.cluster.peerstore import PeerStore
from weighthub.errors import PeerUnavailable, UsageError
from weighthub.net.auth import load_secret
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import MemoryStore
from weighthub.targets import StateDictTarget
from weighthub.tensors import bits

SECRET = b"0123456789abcdef0123456789abcdef"


def published() -> tuple[MemoryStore, dict[str, torch.Tensor]]:
    store = MemoryStore()
    state = {"w": torch.randn(20_000).to(torch.bfloat16), "b": torch.randn(3000)}
    Publisher(store, full_span_bytes=8 << 10).publish(state)
    return store, state


def test_a_receiver_syncs_through_it_and_fills_the_cache() -> None:
    store, state = published()
    cache = MemoryStore()
    peers = PeerStore(store, lambda _k: [], SECRET, cache=cache)
    target = StateDictTarget({})
    Receiver(peers, target).sync()
    assert all((bits(target.state[n]) == bits(t)).all() for n, t in state.items())
    keys = [c.key for c in catalog.primary_manifest(store, 0).chunks]
    assert len(keys) > 1 and all(cache.get(k) == store.get(k) for k in keys)
    assert peers.stats.from_backing == len(keys)


def test_a_corrupt_cached_chunk_is_not_used() -> None:
    store, state = published()
    cache = MemoryStore()
    key = catalog.primary_manifest(store, 0).chunks[0].key
    blob = bytearray(store.get(key))
    blob[len(blob) // 2] ^= 1
    cache.put(key, bytes(blob))
    peers = PeerStore(store, lambda _k: [], SECRET, cache=cache)
    target = StateDictTarget({})
    Receiver(peers, target).sync()
    assert all((bits(target.state[n]) == bits(t)).all() for n, t in state.items())
    assert cache.get(key) == store.get(key)  # replaced by the verified copy


def test_it_refuses_writes() -> None:
    store, _ = published()
    peers = PeerStore(store, lambda _k: [], SECRET)
    with pytest.raises(UsageError, match="read-only"):
        peers.put("v000000000001/manifest.json", b"{}", create_only=True)
    with pytest.raises(UsageError, match="read-only"):
        peers.delete("v000000000000/manifest.json")


def test_unreachable_peers_fall_back_to_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    store, state = published()
    monkeypatch.setenv("WEIGHTHUB_SECRET", SECRET.decode())
    # port 1 on loopback: connection refused at once; the peer is then skipped (cooldown)
    peers = PeerStore(store, lambda _k: ["127.0.0.1:1"], load_secret())
    target = StateDictTarget({})
    Receiver(peers, target).sync()
    assert all((bits(target.state[n]) == bits(t)).all() for n, t in state.items())
    assert 1 <= peers.stats.peer_failures <= 4  # the fetch threads that raced to it first


def test_a_failing_source_list_falls_back_to_the_store() -> None:
    store, state = published()

    def hub_down(_key: str) -> list[str]:
        raise PeerUnavailable("hub 127.0.0.1:9: no answer within 2s")

    target = StateDictTarget({})
    Receiver(PeerStore(store, hub_down, SECRET), target).sync()
    assert all((bits(target.state[n]) == bits(t)).all() for n, t in state.items())


class _Counting(MemoryStore):
    """A MemoryStore that records manifest reads and listings (what crosses a region boundary)."""

    def __init__(self) -> None:
        super().__init__()
        self.metadata_reads: list[str] = []

    def get(self, key: str) -> bytes:
        if key.endswith(".json"):
            self.metadata_reads.append(key)
        return super().get(key)

    def children(self, prefix: str) -> list[str]:
        self.metadata_reads.append(f"list {prefix!r}")
        return super().children(prefix)


def test_a_relayed_manifest_spares_every_manifest_read_and_listing_of_the_store() -> None:
    store = _Counting()
    s0 = {"w": torch.randn(20_000).to(torch.bfloat16), "b": torch.randn(3000)}
    pub = Publisher(store, full_span_bytes=8 << 10)
    pub.publish(s0)
    target = StateDictTarget({})
    peers = PeerStore(store, lambda _k: [], SECRET)
    receiver = Receiver(peers, target)
    receiver.sync(0)
    s1 = {"w": s0["w"].clone(), "b": s0["b"] + 1}
    s1["w"][::97] += 1
    pub.publish(s1)
    raw = store.get(catalog.rep_key(1, None, primary=True))
    store.metadata_reads.clear()
    with peers.trusted_route({1: raw}):
        receiver.sync(1)
    assert all((bits(target.state[n]) == bits(t)).all() for n, t in s1.items())
    assert store.metadata_reads == [] and peers.stats.manifests_relayed >= 1
    # outside the context, listings and manifests come from the store again
    assert peers.children("") == store.children("")


def test_a_relayed_manifest_is_trusted_only_with_the_hubs_digest() -> None:
    from weighthub.cluster.peerstore import relayed_manifest
    from weighthub.format import chunk_checksum

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
