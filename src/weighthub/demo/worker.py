"""A demo receiver process: `python -m weighthub.demo.worker STORE [--name NAME]`.

It holds its own copy of the model (a StateDictTarget, materialized on the first sync) and
speaks a line protocol: on stdin one command per line, on stdout one JSON object per line.

    (start)    -> {"ok": true, "ready": true, "pid": ...}   (after a JIT warm-up, ~1 s)
    sync N     -> {"ok": true, "version": N, "from": ..., "route": [...], "bytes": ...,
                   "stage_s": ..., "apply_s": ..., "pause_s": ..., "root": "<hex>"}
                  or {"ok": false, "error": "<type>: <message>"} (the target stays at its
                  previous version: the receiver rolled back)
    quit / EOF -> exits 0

`root` is computed here, independently of the receiver's own verification, from the tensors
the worker now holds (tensor_digest + root_digest), so the publisher side can check bit-exactness
against the manifest. stdout carries the protocol only: anything else printed goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import IO, Any

import torch

from ..digest import root_digest, tensor_digest
from ..engines.warm import warm_kernels
from ..receive import Receiver
from ..store import LocalStore
from ..targets import StateDictTarget
from ..tensors import specs_of


def state_root(state: dict[str, torch.Tensor]) -> str:
    """Root digest of a state dict, computed from its tensors' bits."""
    return root_digest((s, tensor_digest(state[s.name])) for s in specs_of(state)).hex()


def serve(store_path: str, commands: IO[str], replies: IO[str]) -> int:
    """Answer commands until `quit` or end of input."""
    target = StateDictTarget({})
    receiver = Receiver(LocalStore(store_path, create=False), target)
    warm_kernels()

    def reply(obj: dict[str, Any]) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    reply({"ok": True, "ready": True, "pid": os.getpid()})
    for line in commands:
        words = line.split()
        if not words:
            continue
        if words == ["quit"]:
            break
        if len(words) != 2 or words[0] != "sync" or not words[1].isdigit():
            reply({"ok": False, "error": f"UsageError: unknown command {line.strip()!r}"})
            continue
        try:
            r = receiver.sync(int(words[1]))
            root = state_root(target.state)
        except Exception as exc:  # reported to the publisher side, which decides what to do
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            continue
        reply({"ok": True, "version": r.version, "from": r.from_version, "route": list(r.route),
               "bytes": r.bytes_fetched, "stage_s": r.stage_seconds, "apply_s": r.apply_seconds,
               "pause_s": r.pause_seconds,
               "root": root})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weighthub.demo.worker")
    parser.add_argument("store", help="local store directory to sync from")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # several workers share the machine with the trainer
    # keep the protocol channel private: stray prints from libraries must not corrupt it
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # C-level writes to fd 1 now land on stderr too
    sys.stdout = sys.stderr
    with replies:
        return serve(args.store, sys.stdin, replies)


if __name__ == "__main__":
    sys.exit(main())
