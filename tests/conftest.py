"""Suite-wide set-up: compile the numba kernels once, before the first test's clock starts.

The kernels are `@njit(cache=True)`: the first process to call one compiles it and writes the
machine code next to the module (`__pycache__`); every later process, the CLI and peer
subprocesses that tests start included, loads it in milliseconds. In a fresh clone nothing is
cached, and on a loaded 2-core machine that first compilation took longer than the per-test
timeout of whichever test happened to run first. Compiling here, in `pytest_sessionstart`, puts
it outside every test's timeout and makes each test's run time independent of test order.
"""

from __future__ import annotations

import time

import pytest


def _warm_kernels() -> float:
    """Publish a full version and deltas of every op and dtype family, sync a receiver through
    them: each kernel signature the suite reaches is compiled (or loaded from the cache)."""
    import torch

    from weighthub.publish import ENCODE_PROFILES, Publisher
    from weighthub.receive import Receiver
    from weighthub.store.memory import MemoryStore
    from weighthub.targets import StateDictTarget

    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    base = {dtype: torch.randn(4096, generator=gen).to(dtype)
            for dtype in (torch.bfloat16, torch.float16, torch.float32)}
    for profile in ENCODE_PROFILES.values():
        store = MemoryStore()
        publisher = Publisher(store, policy=profile)
        receiver = Receiver(store, StateDictTarget({}))
        state = {f"w_{str(d).split('.')[-1]}": t.clone() for d, t in base.items()}
        state["ints"] = torch.arange(4096, dtype=torch.int64)
        for step in range(3):
            publisher.publish(state)
            receiver.sync()
            # small steps (xor/add), then a large rewrite of part of each tensor (overwrite/dense)
            state = {k: (v + 1 if k == "ints" else
                         (v.float() * (1 + 1e-3 * torch.randn(v.shape, generator=gen))).to(v.dtype))
                     for k, v in state.items()}
            if step == 1:
                state = {k: torch.where(torch.arange(v.numel()) < 1024, v * 3, v)
                         for k, v in state.items()}
    return time.perf_counter() - t0


def pytest_sessionstart(session: pytest.Session) -> None:
    if not session.config.option.collectonly:
        _warm_kernels()
