"""The publisher's device backend (codec/device_encode.py) beyond the golden bytes
(test_publish_golden.py runs every golden trajectory through it): where its baseline lives,
ranges where nearly every word changed, what it refuses, and that it scans on the device.
CPU tensors stand in for CUDA ones through backend="torch"; the `gpu` test runs on CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import weighthub.codec.device_encode as device_encode
from store_golden import masked_objects
from weighthub.errors import UsageError
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import MemoryStore
from weighthub.targets import StateDictTarget
from weighthub.tensors import bits

SPAN = 1 << 16


def _states(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    master = torch.randn(50_000, generator=g) * 0.02
    out = []
    for v in range(n):
        if v:
            master += 3e-4 * torch.randn(master.shape, generator=g)
        out.append({"w": master.to(torch.bfloat16), "n": torch.arange(7, dtype=torch.int64) + v})
    if n > 2:  # a step where nearly every word changes: the scan gives up, a dense segment
        out[2]["w"] = (master * 1.5).to(torch.bfloat16)
    return out


def _publish(states, **kw) -> MemoryStore:
    store = MemoryStore()
    pub = Publisher(store, delta_span_bytes=SPAN, full_span_bytes=SPAN, **kw)
    for s in states:
        pub.publish(s)
    return store


def test_device_scans_store_what_host_scans_do_including_dense_fallbacks() -> None:
    states = _states(5)
    assert masked_objects(_publish(states, backend="torch")) == masked_objects(_publish(states))


def test_the_baseline_lives_on_the_device_unless_asked_for_the_host() -> None:
    states = _states(3)
    on_device = Publisher(MemoryStore(), backend="torch")
    on_host = Publisher(MemoryStore(), backend="torch", host_baseline=True)
    for s in states:
        on_device.publish(s)
        on_host.publish(s)
    assert all(isinstance(b, torch.Tensor) for b in on_device._baseline.bits.values())
    assert all(isinstance(b, np.ndarray) for b in on_host._baseline.bits.values())
    for base in (on_device._baseline, on_host._baseline):  # both hold the last version's bits
        assert np.array_equal(np.asarray(base.bits["w"]).view(np.uint16), bits(states[-1]["w"]))


def test_a_restarted_device_publisher_moves_its_adopted_baseline_to_the_device() -> None:
    states = _states(4)
    store = MemoryStore()
    first = Publisher(store, backend="torch")
    for s in states[:2]:
        first.publish(s)
    again = Publisher(store, backend="torch")  # adopts v1 as a receiver reads it: host words
    assert again.publish(states[2]).base == 1
    assert all(isinstance(b, torch.Tensor) for b in again._baseline.bits.values())
    again.publish(states[3])
    target = StateDictTarget({})
    Receiver(store, target).sync()
    assert np.array_equal(bits(target.state["w"]), bits(states[3]["w"]))


def test_the_device_path_scans_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = device_encode.D.scan
    monkeypatch.setattr(device_encode.D, "scan",
                        lambda old, new, limit: calls.append(new.numel()) or real(old, new, limit))
    _publish(_states(2), backend="torch")
    assert calls  # every delta run went through codec.device.scan


def test_bad_backend_options_and_devices_are_refused() -> None:
    with pytest.raises(UsageError, match="backend='gpu'"):
        Publisher(MemoryStore(), backend="gpu")
    with pytest.raises(UsageError, match="host_baseline"):
        Publisher(MemoryStore(), host_baseline="yes")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="is on meta"):
        Publisher(MemoryStore()).publish({"w": torch.empty(4, device="meta")})
    with pytest.raises(UsageError, match="host or CUDA memory"):
        StateDictTarget({}, device="meta")
    with pytest.raises(UsageError, match="is on meta"):
        StateDictTarget({"w": torch.empty(4, device="meta")})
    with pytest.raises(UsageError, match="not a torch device"):
        StateDictTarget({}, device="gpu0")


@pytest.mark.gpu
def test_a_cuda_state_publishes_the_host_path_bytes() -> None:
    states = _states(5)
    on_gpu = [{n: t.cuda() for n, t in s.items()} for s in states]
    assert masked_objects(_publish(on_gpu)) == masked_objects(_publish(states))
    assert masked_objects(_publish(on_gpu, host_baseline=True)) == masked_objects(_publish(states))
