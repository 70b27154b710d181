"""S3 reads are bounded by what the caller expects (issue #17, item 1), against a real
SeaweedFS: an object larger than its manifest entry or limit is refused after its first
(bounded) part, never read whole; a pull facing one fails cleanly and leaves the target as it was.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest
import torch

from weighthub import catalog
from weighthub.errors import LimitError
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.targets import StateDictTarget

MiB = 1 << 20


def traced_peak_of(call: Any) -> tuple[int, BaseException | None]:
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        call()
        caught = None
    except Exception as exc:  # the test inspects it
        caught = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, caught


def test_oversized_object_refused_after_one_bounded_part(seaweedfs: Any, s3_prefix: str) -> None:
    store = seaweedfs.store(s3_prefix)
    store.put("v1/c0.whc", b"\x5a" * (48 * MiB))  # multipart: several parts a plain get reads
    peak, caught = traced_peak_of(lambda: store.get("v1/c0.whc", max_bytes=MiB))
    assert isinstance(caught, LimitError), caught
    assert "c0.whc" in str(caught) and f"{48 * MiB} bytes" in str(caught)
    assert peak < 8 * MiB, f"{peak} bytes allocated to refuse it"
    assert store.get("v1/c0.whc", max_bytes=48 * MiB)[-3:] == b"\x5a" * 3


def test_pull_refuses_an_oversized_chunk_and_manifest(seaweedfs: Any, s3_prefix: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    store = seaweedfs.store(s3_prefix)
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(256, 256, generator=g).to(torch.bfloat16)}
    Publisher(store, full_span_bytes=32 << 10).publish(state)
    ref = catalog.primary_manifest(store, 0).chunks[0]
    store.put(ref.key, b"\0" * (40 * MiB))  # far larger than its manifest entry
    target = StateDictTarget({})
    peak, caught = traced_peak_of(lambda: Receiver(store, target, workers=2).sync())
    assert isinstance(caught, LimitError), caught
    assert ref.key in str(caught) and peak < 16 * MiB
    assert target.state == {}

    monkeypatch.setattr(catalog, "MAX_MANIFEST_BYTES", MiB)  # the limit, scaled down
    store.put(catalog.rep_key(0, None, primary=True), b" " * (8 * MiB))
    peak, caught = traced_peak_of(lambda: Receiver(store, target).sync())
    assert isinstance(caught, LimitError) and "manifest.json" in str(caught), caught
    assert peak < 4 * MiB
    assert target.state == {}
