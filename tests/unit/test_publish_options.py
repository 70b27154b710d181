"""Publisher options are checked once, when a publisher is made, with errors that say what to do;
the single-process Publisher is the sharded pipeline on a group of one."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch

from weighthub.chunking import MIN_SPAN
from weighthub.errors import UsageError
from weighthub.publish import Publisher, PublishOptions, ShardedPublisher
from weighthub.publish.group import SoloGroup
from weighthub.publish.options import (
    DELTA_CHUNK_BYTES,
    DELTA_SPAN_BYTES,
    check_committer,
    delta_span,
)
from weighthub.receive import Receiver
from weighthub.store.memory import MemoryStore
from weighthub.targets import StateDictTarget
from weighthub.tensors import bits


@pytest.mark.parametrize("kwargs,words", [
    ({"anchor_every": -1}, "anchor_every=-1 is not a count of versions"),
    ({"skip_every": -2}, "skip_every=-2 is not a count of versions"),
    ({"retain": "3"}, "retain='3' is not a count of versions"),
    ({"workers": 0}, "workers=0: pass at least 1"),
    ({"delta_span_bytes": MIN_SPAN - 1}, f"below the minimum chunk span of {MIN_SPAN} bytes"),
    ({"full_span_bytes": 1.5}, "full_span_bytes=1.5 is below"),
    ({"retain": 2, "anchor_every": 4}, "retain=2 is shorter than anchor_every=4"),
    ({"policy": "fast"}, "is not an EncodePolicy"),
    ({"delta_chunk_bytes": -1}, "delta_chunk_bytes=-1: pass the payload bytes"),
])
def test_bad_options_are_refused_before_the_store_is_touched(kwargs: dict[str, object],
                                                             words: str) -> None:
    store = MemoryStore()
    with pytest.raises(UsageError, match=re.escape(words)):
        Publisher(store, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=re.escape(words)):
        PublishOptions(**kwargs)  # type: ignore[arg-type]
    assert store.children("") == []


def test_good_options_are_kept_and_policy_can_be_swapped_with_a_check() -> None:
    pub = Publisher(MemoryStore(), anchor_every=4, skip_every=2, retain=8, workers=3,
                    delta_span_bytes=MIN_SPAN, full_span_bytes=2 * MIN_SPAN)
    assert (pub.anchor_every, pub.skip_every, pub.retain, pub.workers) == (4, 2, 8, 3)
    assert (pub.delta_span_bytes, pub.full_span_bytes) == (MIN_SPAN, 2 * MIN_SPAN)
    with pytest.raises(UsageError, match="not an EncodePolicy"):
        pub.policy = None  # type: ignore[assignment]


def test_a_committer_outside_the_group_is_refused() -> None:
    check_committer(0, 1)
    for bad in (-1, 2, "0"):
        with pytest.raises(UsageError, match=r"is not a rank of the group \(size 2\)"):
            check_committer(bad, 2)  # type: ignore[arg-type]


def test_a_sharded_publisher_needs_torch_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(UsageError, match=r"needs torch\.distributed initialized"):
        ShardedPublisher(MemoryStore())


def test_publisher_is_the_sharded_pipeline_on_a_group_of_one() -> None:
    store = MemoryStore()
    pub = Publisher(store, anchor_every=2, delta_span_bytes=MIN_SPAN, full_span_bytes=MIN_SPAN)
    assert isinstance(pub, ShardedPublisher) and isinstance(pub._group, SoloGroup)
    state = {"w": torch.arange(3000, dtype=torch.float32), "b": torch.zeros(5, dtype=torch.bfloat16)}
    assert pub.publish(state).version == 0
    state["w"][7] += 1
    r = pub.publish(state)
    assert (r.version, r.base, r.changed) == (1, 0, 1)
    assert r.stream_seconds > 0 and r.encode_seconds > 0  # the stream's timing, as before
    # a second publisher on the same store adopts its head and goes on with a delta
    again = Publisher(store)
    assert again.version == 1
    state["b"][0] = 1
    assert (again.publish(state).version, again.version) == (2, 2)


def test_a_publish_result_carries_the_root_its_manifest_committed() -> None:
    """Callers attest with the result's root instead of reading the manifest back."""
    from weighthub import catalog

    store = MemoryStore()
    pub = Publisher(store)
    roots = set()
    for step in range(3):
        result = pub.publish({"w": torch.arange(64, dtype=torch.float32) * (step + 1)})
        assert result.root == catalog.primary_manifest(store, result.version).root
        roots.add(result.root)
    assert len(roots) == 3


def test_delta_spans_grow_to_carry_a_chunk_payload_and_split_the_words_evenly() -> None:
    """A 269 MB policy at ~1.5% payload per dense byte: four chunks of ~1 MiB instead of nine
    of ~450 KB; at 3% eight; never fewer than two per encoder, never wider than 4 spans."""
    options = PublishOptions()
    assert options.delta_chunk_bytes == DELTA_CHUNK_BYTES  # the default span adapts
    dense = 269_000_000
    for ratio, chunks in ((0.0152, 4), (0.03, 8), (0.0001, 4), (0.0, 9)):
        span = delta_span(options, dense, ratio)
        assert span % MIN_SPAN == 0 and span >= DELTA_SPAN_BYTES
        assert -(-dense // span) == chunks, (ratio, span)
    # an 8B model at 1.5%: spans of ~67 MiB, at most 4x the span however small the payload
    assert delta_span(options, 16 << 30, 0.015) >> 20 == 66
    assert delta_span(options, 16 << 30, 1e-6) == 4 * DELTA_SPAN_BYTES
    # a span the caller chose is kept, unless a chunk payload is asked for as well
    assert PublishOptions(delta_span_bytes=MIN_SPAN).delta_chunk_bytes == 0
    assert delta_span(PublishOptions(delta_span_bytes=MIN_SPAN), dense, 0.0152) == MIN_SPAN
    assert PublishOptions(delta_span_bytes=MIN_SPAN, delta_chunk_bytes=7).delta_chunk_bytes == 7


def test_a_publisher_widens_its_delta_chunks_from_the_last_payload_and_stays_bit_exact() -> None:
    g = torch.Generator().manual_seed(0)
    master = {f"w{i}": torch.randn(8192, generator=g) for i in range(8)}
    dense = 8 * 8192 * 2  # bytes of bf16 words
    store = MemoryStore()
    pub = Publisher(store, delta_span_bytes=MIN_SPAN, delta_chunk_bytes=400)
    target = StateDictTarget({})
    receiver = Receiver(store, target)
    results = []
    for _ in range(4):
        state = {k: v.to(torch.bfloat16) for k, v in master.items()}
        results.append(pub.publish(state, donate=True))
        receiver.sync()
        assert all(np.array_equal(bits(target.state[k]), bits(v)) for k, v in state.items())
        for t in master.values():  # ~2% of the words move each step
            t[torch.randperm(t.numel(), generator=g)[:160]] += 0.05
    # v1, the first delta, in MIN_SPAN spans; from v2 on the spans follow the last payload
    assert results[1].chunks == dense // MIN_SPAN == 32
    for before, now in itertools.pairwise(results[1:]):
        span = delta_span(pub.options, dense, before.payload_bytes / dense)
        assert now.chunks == -(-dense // span) and 8 <= now.chunks < 32
    # v1 carried more payload than v2, so v2 went out in more chunks than v3
    assert results[2].chunks > results[3].chunks
