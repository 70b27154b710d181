"""The publish stream puts chunks on threads of their own (`publish.stream`): encoding goes on
while a slow store takes a put, and a put that fails midway leaves nothing of the version
behind (every chunk put, even one submitted after the failure, is deleted)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from weighthub import catalog
from weighthub.chunking import MIN_SPAN
from weighthub.errors import StoreUnavailable
from weighthub.publish import Publisher
from weighthub.publish import stream as stream_module
from weighthub.receive import Receiver
from weighthub.store.memory import MemoryStore
from weighthub.targets import StateDictTarget


class _SlowStore:
    """A store whose chunk puts take `delay` seconds and can fail at the Nth one."""

    def __init__(self, delay: float, fail_at: int | None = None) -> None:
        self.inner = MemoryStore()
        self.delay = delay
        self.fail_at = fail_at
        self.puts = 0
        self.late: list[str] = []  # chunk puts that started after a failure
        self.failed = threading.Event()
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def put(self, key: str, data: bytes, **kw: Any) -> None:
        if key.endswith(catalog.CHUNK_SUFFIX):
            with self.lock:
                self.puts += 1
                n = self.puts
                if self.failed.is_set():
                    self.late.append(key)
            time.sleep(self.delay)
            if n == self.fail_at:
                self.failed.set()
                raise StoreUnavailable(f"injected: connection reset while writing {key}")
        self.inner.put(key, data, **kw)


def _states(n: int = 6) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    w = torch.randn(8, MIN_SPAN // 2, dtype=torch.float32)  # 8 chunks of one span each
    out = []
    for _ in range(n):
        w += 1e-2 * torch.randn_like(w)
        out.append({f"t{i}": w[i].to(torch.bfloat16) for i in range(8)})
    return out


def test_encoding_goes_on_while_the_store_takes_a_put(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every put waits until two more chunks than there are encoders have been encoded: only
    encoders that do not wait for puts get there (they used to put their own chunks, and would
    both have stood in a put's wait)."""
    encoded = [0]
    enough = threading.Event()
    real = stream_module.encode_chunk

    def counting(*args: Any, **kw: Any) -> bytes:
        frame = real(*args, **kw)
        encoded[0] += 1
        if encoded[0] >= 4:
            enough.set()
        return frame

    store = _SlowStore(delay=0.0)
    pub = Publisher(store, workers=2, delta_span_bytes=MIN_SPAN, full_span_bytes=MIN_SPAN)
    states = _states(2)
    pub.publish(states[0])
    monkeypatch.setattr(stream_module, "encode_chunk", counting)
    waited: list[bool] = []
    inner_put = store.put

    def put_waits(key: str, data: bytes, **kw: Any) -> None:
        waited.append(enough.wait(10))
        inner_put(key, data, **kw)

    store.put = put_waits  # type: ignore[method-assign]
    r = pub.publish(states[1])
    assert r.chunks == 8 and len(waited) == 9 and all(waited)  # 8 chunks and the manifest
    target = StateDictTarget({})
    Receiver(store.inner, target).sync()
    assert all(torch.equal(target.state[k].view(torch.int16), v.view(torch.int16))
               for k, v in states[1].items())


@pytest.mark.parametrize("fail_at", [1, 4, 8])
def test_a_put_that_fails_midway_leaves_nothing_of_the_version(fail_at: int) -> None:
    store = _SlowStore(delay=0.01)
    pub = Publisher(store, workers=2, delta_span_bytes=MIN_SPAN, full_span_bytes=MIN_SPAN)
    states = _states(3)
    pub.publish(states[0])
    store.puts, store.fail_at = 0, fail_at
    with pytest.raises(StoreUnavailable, match="injected"):
        pub.publish(states[1])
    # no manifest, and not one chunk left: the puts already submitted when the failure was
    # seen finished before the publisher deleted what it had put
    assert catalog.list_versions(store.inner) == [0]
    assert store.inner.children(catalog.version_dir(1)) == []
    assert store.puts <= fail_at + 2 * 2 + 2  # what was in flight at most, then nothing new
    store.fail_at = None
    r = pub.publish(states[2])  # against the last committed version: both steps
    assert (r.version, r.base) == (1, 0)
    target = StateDictTarget({})
    Receiver(store.inner, target).sync()
    assert all(torch.equal(target.state[k].view(torch.int16), v.view(torch.int16))
               for k, v in states[2].items())


@pytest.mark.parametrize(("numel", "backend", "threads"), [
    (2048, "auto", 1),  # small host pieces: one encoder (GIL hand-overs cost more than a thread)
    (1 << 17, "auto", 2),  # pieces big enough for two
    (2048, "torch", 2),  # torch words (the device path) keep every worker
])
def test_encoder_threads_follow_the_mean_piece_size(numel: int, backend: str, threads: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Small host pieces are encoded on one thread and big ones on `workers`; the version is
    the same bits either way."""
    pools: list[int] = []

    class Recording(ThreadPoolExecutor):
        def __init__(self, max_workers: int, thread_name_prefix: str = "") -> None:
            if thread_name_prefix != "weighthub-put":  # the encoders' pool
                pools.append(max_workers)
            super().__init__(max_workers, thread_name_prefix=thread_name_prefix)

    gen = torch.Generator().manual_seed(numel)
    state = {f"t{i}": torch.randn(numel, generator=gen).to(torch.bfloat16) for i in range(6)}
    store = MemoryStore()
    span = numel * 2  # one tensor per chunk
    pub = Publisher(store, workers=2, delta_span_bytes=span, full_span_bytes=span, backend=backend)
    pub.publish(state)
    for t in state.values():
        t.view(torch.int16)[::5] += 1
    monkeypatch.setattr(stream_module, "ThreadPoolExecutor", Recording)
    pub.publish(state)
    assert pools == [threads]
    target = StateDictTarget({})
    Receiver(store, target).sync()
    assert all(torch.equal(target.state[k].view(torch.int16), v.view(torch.int16))
               for k, v in state.items())
