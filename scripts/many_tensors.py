"""Publish, staging and pause of a model with many small tensors (MoE experts), per step.

    python scripts/many_tensors.py [--tensors 8000] [--elements 4096] [--steps 8] [--encode fast]

A synthetic bf16 model of `--tensors` tensors of `--elements` each; every step moves 2% of its
words by one ulp, publishes the delta (`--encode`, `fast` by default) to a local store, and a
state dict receiver stages and applies it. Prints the medians (and ranges) of the three, and
the payload, over the steps. A list of
300k small lists stands in for the long-lived heap of a real trainer or engine process, which
every full garbage collection walks. Compare two checkouts side by side in one session (these
machines are noisy): `PYTHONPATH=<other checkout>/src python scripts/many_tensors.py`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from weighthub.codec.coding import ENCODE_PROFILES
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import LocalStore
from weighthub.targets import StateDictTarget


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=8000)
    ap.add_argument("--elements", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--encode", choices=sorted(ENCODE_PROFILES), default="fast")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    state = {f"model.layers.{i // 64}.mlp.experts.{i % 64}.w{i % 3}":
             (torch.randn(args.elements, generator=gen) * 0.05).to(torch.bfloat16)
             for i in range(args.tensors)}
    heap = [[i] for i in range(300_000)]
    with tempfile.TemporaryDirectory(prefix="weighthub-many-") as d:
        pub = Publisher(LocalStore(d), policy=ENCODE_PROFILES[args.encode])
        pub.publish(state)
        rx = Receiver(LocalStore(d, create=False), StateDictTarget({}))
        rx.sync()
        publish, stage, pause, sent = [], [], [], []
        for _ in range(args.steps):
            for t in state.values():
                t.view(torch.int16)[torch.rand(t.shape, generator=gen) < 0.02] += 1
            t0 = time.perf_counter()
            sent.append(pub.publish(state).payload_bytes)
            publish.append(time.perf_counter() - t0)
            r = rx.apply(rx.stage())
            stage.append(r.stage_seconds)
            pause.append(r.pause_seconds)

    def ms(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1e3:.0f} ms ({min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f})"
    print(f"{args.tensors} tensors x {args.elements}, {args.encode}: publish {ms(publish)}, "
          f"staging {ms(stage)}, pause {ms(pause)}, {statistics.median(sent) / 1e6:.3f} MB a "
          f"step ({len(heap)} long-lived objects beside)")


if __name__ == "__main__":
    main()
