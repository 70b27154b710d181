"""The engine-target kit runner (weighthub.testing.vllm_target) on a toy engine, without vLLM:
the Target kit passes on `EngineTarget`, and afterwards the engine holds the bound version.

The real vLLM engine runs the same runner in tests/integration/test_vllm.py.
"""

from __future__ import annotations

from typing import Any

from test_vllm_placement import _bound, _engine_holds  # tests/unit is on sys.path (rootdir)

from weighthub import catalog
from weighthub.engines.vllm_target import EngineTarget
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import MemoryStore
from weighthub.targets.state_dict import StateDictTarget
from weighthub.testing.vllm_target import run_engine_target_kit


class _Worker:
    """What the runner needs of a bound WeighthubWorker."""

    def __init__(self, bound: tuple[Receiver, EngineTarget]) -> None:
        self.bound = bound

    def _wh_bound(self) -> tuple[Receiver, EngineTarget]:
        return self.bound


def test_engine_target_kit_on_a_toy_engine() -> None:
    model, placement, s0 = _bound()
    store = MemoryStore()
    Publisher(store).publish(s0)
    mirror = StateDictTarget({})
    Receiver(store, mirror).sync(0)
    digests = {e.name: e.digest for e in catalog.primary_manifest(store, 0).tensors}
    target = EngineTarget(mirror, placement, store, digests)
    results: dict[str, Any] = run_engine_target_kit(_Worker((Receiver(store, target), target)))
    assert len(results) >= 7 and all(r == "passed" for r in results.values()), results
    assert _engine_holds(model, s0)  # restored to the bound version
    assert mirror.held() is not None and mirror.held().version == 0
