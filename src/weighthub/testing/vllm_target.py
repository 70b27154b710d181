"""`TargetTests` on a vLLM engine's target, run inside the engine's worker process.

The engine target (`engines.vllm_target.EngineTarget`) lives in vLLM's worker, where pytest cannot
reach; the driver sends `run_engine_target_kit` there with `collective_rpc` and gets the kit's
outcomes back as plain strings (`run_kit`). Each check gets its own engine target over a copy of
the bound mirror, pushing into the real engine through the bound placement (bound in place: over
the engine's own parameters, reset to what they served), and commits versions
that the kit publishes into a scratch memory store (the engine target reads the committed
version's manifest digests at commit). Afterwards every group of the engine is reloaded from a
copy of what it served, so the engine serves what it served before (the driver checks its outputs).

    results = llm.collective_rpc(run_engine_target_kit)[0]   # {check: 'passed' | ...}
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import torch

from .. import catalog
from ..store import MemoryStore
from ..targets.base import Held, Target
from ..targets.state_dict import StateDictTarget
from ..tensors import TensorSpec, specs_of
from ._check import run_kit
from .targets import TargetTests

_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}  # torch-viewable integer words


def run_engine_target_kit(worker: Any) -> dict[str, str]:
    """Run the Target kit on `worker`'s bound engine target, then restore the engine.

    Raises:
        UsageError: the worker is not bound to a store (`bind(llm, url)` first).
    """
    from ..engines.vllm_target import EngineTarget
    from ..publish import Publisher

    _receiver, bound = worker._wh_bound()
    scratch = MemoryStore(f"weighthub-kit-{uuid.uuid4().hex[:8]}")
    publisher = Publisher(scratch)
    specs = {s.name: s for s in specs_of(bound.mirror.state)}

    served = {n: t.clone() for n, t in bound.mirror.state.items()}  # restored afterwards

    class EngineTargetTests(TargetTests):
        def make_target(self) -> Target:
            if bound.in_place:  # over the engine's own parameters, reset to what it served
                views = bound.mirror.state
                for name, view in views.items():
                    view.copy_(served[name])
                return EngineTarget(StateDictTarget(views, bound.mirror.held()), bound.placement,
                                     scratch, dict(bound.digests), in_place=True)
            mirror = StateDictTarget({n: t.clone() for n, t in served.items()},
                                     bound.mirror.held())
            return EngineTarget(mirror, bound.placement, scratch, dict(bound.digests))

        def model_specs(self) -> list[TensorSpec]:
            return list(specs.values())

        def held_for(self, bits: dict[str, np.ndarray], version: int) -> Held:
            state = {name: _tensor(specs[name], words) for name, words in bits.items()}
            v = publisher.publish(state).version
            manifest = catalog.primary_manifest(scratch, v)
            return Held(scratch.url, manifest.model, v, manifest.root)

    try:
        return run_kit(EngineTargetTests())
    finally:  # the kit's versions reached the engine: serve the bound version again
        bound.overwrite_all(served)


def _tensor(spec: TensorSpec, words: np.ndarray) -> torch.Tensor:
    raw = torch.from_numpy(np.ascontiguousarray(words).view(_SIGNED[spec.dtype.width]).copy())
    return raw.view(spec.dtype.torch_dtype).reshape(spec.shape)
