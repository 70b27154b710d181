"""Compile (or load from numba's disk cache) the codec kernels a refit runs, before the first one.

numba compiles each kernel on its first call in a process, per argument types, and writes it
to its disk cache; a later process loads it from there. Either way the first publish and the
first staging and apply of a process pay it, inside the refit: in the RL demo on a fresh
install the first refit took 13.8 s (7.6 s of it the trainer's publish, 5.6 s each engine's
staging) against ~0.45 s for the next ones, and loading the cached kernels alone costs a
process ~0.5 s. `warm_kernels` runs a tiny publish and sync of the same kinds of deltas through
memory (nothing is stored), once per process, where a trainer or an engine starts up.
"""

from __future__ import annotations

import threading
import time

import torch

from ..codec.coding import ENCODE_PROFILES
from ..publish import Publisher
from ..receive import Receiver
from ..receive.rows import ROWS_AT_ONCE
from ..store import MemoryStore
from ..targets import StateDictTarget

SMALL_TENSORS = 2 * ROWS_AT_ONCE  # enough small segments in a chunk to be scattered as rows
_lock = threading.Lock()
_warm = False


def warm_kernels() -> float:
    """Publish and sync a small synthetic model through a memory store with the `compact` and
    the `fast` coding (about 1 s; more on a fresh install, where it compiles). Once per process:
    later calls return at once. Returns the seconds it took (0.0 when already warm)."""
    global _warm
    with _lock:
        if _warm:
            return 0.0
        t0 = time.perf_counter()
        for profile in ("compact", "fast"):
            store = MemoryStore()
            publisher = Publisher(store, policy=ENCODE_PROFILES[profile], workers=1)
            receiver = Receiver(store, StateDictTarget({}), workers=1)
            for state in _states():
                receiver.sync(publisher.publish(state).version)
        _warm = True
        return time.perf_counter() - t0


def _states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """An old and a new state whose delta takes every path a training step's does, in bf16 and
    in fp32: ±1 ulp changes at the densities that select each position coding (far likelier on
    large weights, where exponent groups pay off; uniform, as gaps; busy; dense), small tensors
    coded in bulk and then applied as rows (receive.rows); and an integer buffer."""
    gen = torch.Generator().manual_seed(0)
    n = 1 << 17
    old: dict[str, torch.Tensor] = {"ids": torch.arange(512)}
    rates: dict[str, torch.Tensor] = {}
    for dtype in (torch.bfloat16, torch.float32):
        kind = str(dtype).removeprefix("torch.")
        big = {f"{kind}.{name}": (0.05 * torch.randn(n, generator=gen)).to(dtype)
               for name in ("by_exponent", "uniform", "busy", "dense")}
        rates |= {f"{kind}.by_exponent": torch.where(big[f"{kind}.by_exponent"].abs() > 0.05,
                                                     0.2, 0.005),
                  f"{kind}.uniform": torch.full((n,), 0.02), f"{kind}.busy": torch.full((n,), 0.15),
                  f"{kind}.dense": torch.full((n,), 0.6)}
        small = {f"{kind}.small.{i}": (0.05 * torch.randn(1024, generator=gen)).to(dtype)
                 for i in range(SMALL_TENSORS)}
        rates |= {name: torch.full((1024,), 0.02) for name in small}
        old |= big | small
    new = {k: v.clone() for k, v in old.items()}
    for name, rate in rates.items():
        words = new[name].view(torch.int16 if new[name].dtype == torch.bfloat16 else torch.int32)
        words[torch.rand(rate.numel(), generator=gen) < rate] += 1
    new["ids"][::7] += 1
    return old, new
