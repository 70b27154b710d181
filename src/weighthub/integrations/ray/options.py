"""The RL demo's command-line options (`weighthub demo --rl`): importing this loads nothing heavy."""

from __future__ import annotations

import argparse

# the demo's processes (driver, raylets, actors): no model hub, a small vLLM CPU KV cache
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
       "TOKENIZERS_PARALLELISM": "false"}


def add_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--engines", type=int, default=2, help="vLLM rollout actors (default 2)")
    p.add_argument("--nodes", type=int, default=2, help="local Ray nodes to start (default 2)")
    p.add_argument("--address", default=None, help="use this Ray cluster instead of starting one")
    p.add_argument("--lag", type=int, choices=[0, 1], default=0,
                   help="1: generate the next batch while training (default 0: on-policy)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    p.add_argument("--samples", type=int, default=4, help="completions per prompt (default 4)")
    p.add_argument("--max-tokens", type=int, default=16, help="completion length cap (default 16)")
    p.add_argument("--encode", choices=["fast", "compact", "grouped"], default="fast",
                   help="the publisher's encode profile (default fast: loopback links)")
    p.add_argument("--no-baseline", action="store_true", help="skip the object-store route")
    p.add_argument("--early-decode", action="store_true",
                   help="with --lag 0, tell the engines to stage each update before the trainer "
                        "starts it: they decode its chunks as they are pushed to their node, "
                        "during the publish (pays where the trainer has cores of its own; on one "
                        "shared host it slows the publish more than it saves)")
    p.add_argument("--probe-rounds", type=int, default=3, metavar="N",
                   help="after the steps (--lag 0), N rounds of one engine generating idle and "
                        "while it stages a new version, alternated: generation throughput while "
                        "staging as a share of idle (default 3; 0 skips it)")
    p.add_argument("--plain-cpu-weights", action="store_true",
                   help="vLLM CPU keeps linear weights plain (no oneDNN packing), so refits apply "
                        "in place in the engines' memory instead of reloading through vLLM's "
                        "loader; generation uses torch's slower CPU GEMM")
    p.add_argument("--rollout-nodes", choices=["all", "others"], default="all",
                   help="where the rollout engines run: 'all' Ray nodes (default) or only 'others' "
                        "than the trainer's, so every refit crosses the network")
    p.add_argument("--link-mbit", type=float, default=None, metavar="RATE",
                   help="run across a shaped link (root): the trainer's and the engines' Ray nodes "
                        "in two network namespaces joined by one veth capped at RATE Mbit/s, the "
                        "store (SeaweedFS) on the trainer's side; reports the link's bytes per route")
    p.add_argument("--link-dev", default=None, metavar="DEV",
                   help="count the bytes through network device DEV per route (set by --link-mbit)")
