"""engines.warm: after `warm_kernels`, a process's refits compile (or load) no kernel.

Run in a fresh interpreter: the test process has called most kernels already. The refits are
shaped like a small transformer's training steps (bf16 matrices, an embedding split over chunks,
dozens of norms scattered as rows, an fp32 buffer, an integer buffer), coded `compact` and `fast`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import importlib, json, sys
    import torch
    from numba.core.registry import CPUDispatcher
    from weighthub.codec.coding import ENCODE_PROFILES
    from weighthub.engines.warm import warm_kernels
    from weighthub.kernel_cache import KERNEL_MODULES
    from weighthub.publish import Publisher
    from weighthub.receive import Receiver
    from weighthub.store import MemoryStore
    from weighthub.targets import StateDictTarget

    def signatures():
        out = {}
        for path in KERNEL_MODULES:
            mod = importlib.import_module("weighthub." + path[:-3].replace("/", "."))
            for name, obj in vars(mod).items():
                if isinstance(obj, CPUDispatcher) and obj.__module__ == mod.__name__:
                    out[mod.__name__ + "." + name] = len(obj.signatures)
        return out

    first = warm_kernels()
    second = warm_kernels()
    before = signatures()
    gen = torch.Generator().manual_seed(1)
    shapes = {"embed": (8192, 576), "q": (576, 576), "mlp": (1536, 576), "tiny": (64,)}
    shapes |= {f"layers.{i}.norm": (576,) for i in range(48)}
    state = {k: (0.05 * torch.randn(*s, generator=gen)).to(torch.bfloat16) for k, s in shapes.items()}
    state["rope.inv_freq"] = 0.05 * torch.randn(4096, generator=gen)
    state["steps"] = torch.arange(16)
    states = [state]
    for rate in (0.06, 0.02, 0.01):
        new = {k: v.clone() for k, v in states[-1].items()}
        for k, v in new.items():
            if v.is_floating_point():
                flat = v.view(-1).view(torch.int16 if v.dtype == torch.bfloat16 else torch.int32)
                hit = torch.rand(flat.numel(), generator=gen) < rate
                flat[hit] += torch.randint(-2, 3, (int(hit.sum()),), generator=gen,
                                           dtype=flat.dtype)
        new["steps"] += 1
        states.append(new)
    for profile in ("compact", "fast"):
        store = MemoryStore()
        publisher = Publisher(store, policy=ENCODE_PROFILES[profile])
        target = StateDictTarget({})
        receiver = Receiver(store, target)
        for s in states:
            receiver.sync(publisher.publish(s).version)
        assert all(torch.equal(target.state[k].view(-1).view(torch.uint8),
                               states[-1][k].view(-1).view(torch.uint8)) for k in shapes)
    after = signatures()
    grew = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    json.dump({"first": first, "second": second, "grew": grew}, sys.stdout)
""")


def test_refits_after_warm_up_compile_nothing() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["first"] > 0.0  # it ran
    assert got["second"] == 0.0  # once per process
    # every kernel the refits called was compiled (or loaded) by the warm-up already
    assert got["grew"] == {}
