"""Publisher options are checked once, when a publisher is made, with errors that say what to do;
the single-process Publisher is the sharded pipeline on a group of one."""

from __future__ import annotations

import re

import pytest
import torch

from weighthub.chunking import MIN_SPAN
from weighthub.errors import UsageError
from weighthub.publish import Publisher, PublishOptions, ShardedPublisher
from weighthub.publish.group import SoloGroup
from weighthub.publish.options import check_committer
from weighthub.store.memory import MemoryStore


@pytest.mark.parametrize("kwargs,words", [
    ({"anchor_every": -1}, "anchor_every=-1 is not a count of versions"),
    ({"skip_every": -2}, "skip_every=-2 is not a count of versions"),
    ({"retain": "3"}, "retain='3' is not a count of versions"),
    ({"workers": 0}, "workers=0: pass at least 1"),
    ({"delta_span_bytes": MIN_SPAN - 1}, f"below the minimum chunk span of {MIN_SPAN} bytes"),
    ({"full_span_bytes": 1.5}, "full_span_bytes=1.5 is below"),
    ({"retain": 2, "anchor_every": 4}, "retain=2 is shorter than anchor_every=4"),
    ({"policy": "fast"}, "is not an EncodePolicy"),
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
