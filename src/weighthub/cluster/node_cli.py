"""`weighthub serve node`: its options, and running a `Node` until SIGTERM/SIGINT.

Apart from `node` so that the daemon's module holds the daemon; this one only turns arguments
into a `Node` (store, target, cache directory, hub client) and prints its events.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..net.auth import load_secret
from ..store import LocalStore, open_store
from ..targets.base import Target
from .hubclient import HubClient
from .node import Node, NodeConfig
from .topology import parse_labels

MEMORY_TARGET = "memory://"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `weighthub serve node`."""
    p.add_argument("store", help="store directory, file:// URI or s3://BUCKET/PREFIX")
    p.add_argument("out", help="target: a path ending in .safetensors, a directory, or memory:// "
                              "(an in-memory state dict, for tests and benchmarks)")
    p.add_argument("--hub", default=None, metavar="HOST:PORT",
                   help="the hub (`weighthub serve hub`); without it the node follows the store")
    p.add_argument("--secret-file", default=None, metavar="F",
                   help="shared secret (default: $WEIGHTHUB_SECRET)")
    p.add_argument("--labels", default="", metavar="L",
                   help="where this node runs: region=R,zone=Z,host=H (ranks sources, plans relays)")
    p.add_argument("--id", default=None, help="holder id (default: HOSTNAME:PID)")
    p.add_argument("--host", default="127.0.0.1", help="chunk server address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="chunk server port (default: a free one)")
    p.add_argument("--fanout", type=int, default=4, metavar="D",
                   help="holders an elastic join stripes its reads across (default 4)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="seconds for each hub call and each peer socket wait (default 10)")
    p.add_argument("--poll", type=float, default=2.0, metavar="S",
                   help="how often the hub is asked for the latest version (default 2); a relayed "
                        "manifest wakes the node at once, so this is the fallback")
    p.add_argument("--store-check", type=float, default=30.0, metavar="S",
                   help="read the store's listing too when the hub has named the same latest "
                        "version for S seconds, in case it missed an announcement (default 30; "
                        "0: only while the hub fails)")
    p.add_argument("--full-check-versions", type=int, default=16, metavar="N",
                   help="digest all of OUT against the version it holds every N versions, to "
                        "find edits made outside weighthub that a stat cannot see (default 16; "
                        "0: not by count); a stat is checked before every apply anyway")
    p.add_argument("--full-check-s", type=float, default=1800.0, metavar="S",
                   help="... and every S seconds (default 1800; 0: not by time)")
    p.add_argument("--nice", type=int, default=0, metavar="N",
                   help="run the node's own applies at nice N (0..19; default 0) where it shares "
                        "the host's cores with engines; chunks are relayed and served at the "
                        "process's priority")
    p.add_argument("--cache", default=None, metavar="DIR",
                   help="chunk cache served to peers (default: next to OUT, or a temp dir)")
    p.add_argument("--endpoint-url", default=None, metavar="URL", help="S3 endpoint for s3:// stores")
    p.add_argument("--json", action="store_true", help="print events as JSON lines")


def _target(out: str) -> tuple[Target, Path | None]:
    """The target, and the default cache directory next to it (None: in memory, use a temp dir)."""
    if out.startswith(MEMORY_TARGET):
        from ..targets import StateDictTarget
        return StateDictTarget({}), None
    from ..targets import SafetensorsTarget
    path = Path(out).expanduser().absolute()
    return SafetensorsTarget(path), path.with_name(f".{path.name}.weighthub-cache")


def run_from_args(args: argparse.Namespace) -> None:
    """`weighthub serve node ARGS`: runs until SIGTERM/SIGINT."""
    import json

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    labels = parse_labels(args.labels)
    config = NodeConfig(node_id=args.id or f"{socket.gethostname()}:{os.getpid()}", labels=labels,
                        timeout=args.timeout, poll_s=args.poll, store_check_s=args.store_check,
                        stripes=args.fanout,
                        host=args.host, port=args.port, full_check_versions=args.full_check_versions,
                        full_check_s=args.full_check_s, nice=args.nice)
    secret = load_secret(args.secret_file)
    backing = open_store(args.store, **({"endpoint_url": args.endpoint_url} if args.endpoint_url else {}))
    target, cache_dir = _target(args.out)
    temp = None
    if args.cache is not None:
        cache_dir = Path(args.cache)
    elif cache_dir is None:
        temp = cache_dir = Path(tempfile.mkdtemp(prefix="weighthub-node-cache-"))
    hub = HubClient(args.hub, secret, timeout=config.timeout, labels=labels) if args.hub else None
    lock = threading.Lock()

    def emit(event: dict[str, Any]) -> None:
        if args.json:
            line = json.dumps(event, sort_keys=True)
        else:
            line = " ".join(f"{k}={v}" for k, v in event.items() if k not in ("stats", "by_holder"))
        with lock:
            print(line, flush=True)

    node = Node(backing, target, secret, config, hub=hub, cache=LocalStore(cache_dir), on_event=emit)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: node.request_stop())
    node.start()
    try:
        node.wait()
    finally:
        node.stop()
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
        print("weighthub node stopped", file=sys.stderr, flush=True)
