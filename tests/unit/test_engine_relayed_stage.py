"""An engine stages a one-step refit from the manifest relayed to its host, reading no listing
and no manifest from the store, when (and only when) the hub's digest vouches for that manifest
and it is one delta from what the engine holds; otherwise the store plans, as without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from counting_store import CountingStore
from weighthub import catalog
from weighthub.cluster.relayed import RelayedManifests, vouched
from weighthub.engines.vllm_checks import staged_relayed
from weighthub.format import chunk_checksum
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store.memory import MemoryStore
from weighthub.targets import StateDictTarget
from weighthub.tensors import bits


def _published(versions: int) -> tuple[MemoryStore, list[dict[str, torch.Tensor]]]:
    store = MemoryStore()
    pub = Publisher(store)
    torch.manual_seed(0)
    w = torch.randn(8192, dtype=torch.float32)
    states = []
    for _ in range(versions):
        w = w + 1e-2 * torch.randn_like(w)
        states.append({"w": w.to(torch.bfloat16), "b": (w[:64] * 2).to(torch.bfloat16)})
        pub.publish(states[-1])
    return store, states


def _engine_at(store: MemoryStore, version: int) -> tuple[Receiver, CountingStore, StateDictTarget]:
    """A bound engine's receiver (over RelayedManifests, as `weighthub_bind` makes it) at
    `version`, committed by that receiver (so it knows the held digests)."""
    counting = CountingStore(store)
    target = StateDictTarget({})
    receiver = Receiver(RelayedManifests(counting), target)
    receiver.sync(version)
    counting.listed.clear()
    counting.manifests_read.clear()
    return receiver, counting, target


def _manifest(store: MemoryStore, version: int) -> tuple[bytes, str]:
    raw = store.get(catalog.rep_key(version, None, primary=True))
    return raw, chunk_checksum(raw)


def test_a_vouched_manifest_plans_the_stage_without_the_store() -> None:
    store, states = _published(4)
    receiver, counting, target = _engine_at(store, 2)
    raw, digest = _manifest(store, 3)
    staged = staged_relayed(receiver, 3, raw, digest)
    assert staged is not None and (staged.version, staged.from_version) == (3, 2)
    assert counting.listed == [] and counting.manifests_read == []  # planned from the relay
    receiver.apply(staged)
    assert all(np.array_equal(bits(target.state[k]), bits(v)) for k, v in states[3].items())
    assert counting.manifests_read == []  # nor read in the pause


def test_a_route_past_the_relayed_version_reads_only_the_others_from_the_store() -> None:
    """Two versions behind: the one between comes from the store, the relayed one does not."""
    store, states = _published(4)
    receiver, counting, target = _engine_at(store, 1)
    raw, digest = _manifest(store, 3)
    staged = staged_relayed(receiver, 3, raw, digest)
    assert staged is not None and staged.route == (catalog.rep_key(2, None, primary=True),
                                                   catalog.rep_key(3, None, primary=True))
    assert counting.manifests_read == [catalog.rep_key(2, None, primary=True)]
    receiver.apply(staged)
    assert all(np.array_equal(bits(target.state[k]), bits(v)) for k, v in states[3].items())


@pytest.mark.parametrize("case", ["wrong digest", "no digest", "no manifest", "no version"])
def test_anything_else_leaves_the_plan_to_the_store(case: str) -> None:
    store, _states = _published(5)
    receiver, counting, _target = _engine_at(store, 1)
    raw, digest = _manifest(store, 2)
    version: int | None = 2
    manifest: bytes | None = raw
    if case == "wrong digest":
        digest = chunk_checksum(raw + b" ")
    elif case == "no digest":
        digest = None  # type: ignore[assignment]
    elif case == "no manifest":
        manifest = None
    elif case == "no version":
        version = None
    assert staged_relayed(receiver, version, manifest, digest) is None
    # nothing was staged from it; the store then plans, and the route is the usual one
    staged = receiver.stage(version)
    assert staged.version == (4 if version is None else version) and counting.listed


def test_a_receiver_over_the_store_itself_ignores_a_relayed_manifest() -> None:
    """`weighthub_stage(store_url=...)` reads a replica directly: no relayed manifest there."""
    store, _states = _published(3)
    target = StateDictTarget({})
    receiver = Receiver(store, target)
    receiver.sync(1)
    raw, digest = _manifest(store, 2)
    assert staged_relayed(receiver, 2, raw, digest) is None


def test_vouched_checks_the_hubs_digest_and_the_size() -> None:
    raw = b'{"a": 1}'
    assert vouched(raw, 3, chunk_checksum(raw), where="t") == raw
    assert vouched(raw, 3, chunk_checksum(b"other"), where="t") is None
    assert vouched(raw, 3, None, where="t") is None
    from weighthub.format.manifest import MAX_MANIFEST_BYTES
    big = b" " * (MAX_MANIFEST_BYTES + 1)
    assert vouched(big, 3, chunk_checksum(big), where="t") is None
