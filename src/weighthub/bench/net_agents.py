"""The publisher agent of `weighthub bench net`: a NetPublisher in its own process (and namespace).

    python -m weighthub.bench.net_agents publisher

speaks JSON lines on stdin/stdout like bench.shaped_agents (one command per line, one reply per
line, `{"ok": true, ...}` or `{"ok": false, "error": ...}`; EOF ends it; logs go to stderr):

    start {store, hub, secret_file, labels, host, degree, endpoint_url?}   -> {address}
    load {size_mib}      the real MiniLM pair (bench.shaped_agents.real_pair), tiled to ~size_mib
    publish {kill?: {address: pid}, kill_after?: n}   the next state: v0 the real pair's first
                         state, v1 its second (the real step), then synthetic 3% steps; with
                         `kill`, kill -9 the process of the relay tree's first root after n more
                         chunk pushes (a relay dying mid-refit)
                         -> {version, seconds, payload_bytes, dense_bytes, chunks, planned,
                             pushed, dead, root, changed_fraction, killed}
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import Any

from ..errors import UsageError
from .shaped_agents import MiB, real_pair, synthetic_step, tile

DELTA_SPAN_BYTES = 2 << 20  # dense bytes per delta chunk: enough chunks to pipeline down a tree
SYNTHETIC_RATE = 0.03


class PublisherAgent:
    def __init__(self) -> None:
        self.pub: Any = None
        self.pair: tuple[Any, Any] | None = None
        self.state: Any = None
        self.next_version = 0

    def op_start(self, store: str, hub: str, secret_file: str, labels: str, host: str,
                 degree: int, endpoint_url: str | None = None) -> dict[str, Any]:
        from ..cluster.hubclient import HubClient
        from ..cluster.publisher import NetPublisher
        from ..cluster.topology import parse_labels
        from ..net.auth import load_secret
        from ..store import open_store

        secret = load_secret(secret_file)
        backing = open_store(store, **({"endpoint_url": endpoint_url} if endpoint_url else {}))
        client = HubClient(hub, secret, timeout=10.0, labels=parse_labels(labels))
        self.pub = NetPublisher(backing, secret, hub=client, publisher_id="publisher", degree=degree,
                                host=host, delta_span_bytes=DELTA_SPAN_BYTES).start()
        return {"address": self.pub.address}

    def op_load(self, size_mib: int) -> dict[str, Any]:
        a, b, source = real_pair()
        one = sum(t.numel() * t.element_size() for t in a.values())
        copies = max(1, round(size_mib * MiB / one))
        self.pair = (tile(a, copies), tile(b, copies))
        return {"source": source, "dense_bytes": one * copies}

    def _next_state(self) -> Any:
        if self.pair is None:
            raise UsageError("publish: call load first")
        v = self.next_version
        if v < 2:
            return self.pair[v]
        return synthetic_step(self.state, SYNTHETIC_RATE, seed=v)

    def op_publish(self, kill: dict[str, int] | None = None, kill_after: int = 0) -> dict[str, Any]:
        from .. import catalog

        state = self._next_state()
        killed: list[str] = []
        tee = self.pub.tee
        if kill:
            start, put = tee.pushed, tee.put

            # In the put that completes the `kill_after`-th push, while the relay still runs:
            # a thread polling the count could wake after a small version's relay ended.
            def put_then_kill(key: str, data: bytes | memoryview, *,
                              create_only: bool = False) -> None:
                put(key, data, create_only=create_only)
                with kill_lock:
                    roots = self.pub.relay_roots()
                    if not killed and tee.pushed - start >= kill_after and roots \
                            and roots[0] in kill:
                        os.kill(kill[roots[0]], signal.SIGKILL)
                        killed.append(roots[0])
            kill_lock = threading.Lock()
            tee.put = put_then_kill
        try:
            r = self.pub.publish(state)
        finally:
            if kill:
                del tee.put  # the class's put again
        self.state, self.next_version = state, self.next_version + 1
        return {"version": r.version, "seconds": r.seconds, "payload_bytes": r.payload_bytes,
                "dense_bytes": r.dense_bytes, "chunks": r.chunks, "planned": r.planned,
                "pushed": r.pushed, "dead": list(r.dead), "killed": killed,
                "changed_fraction": r.changed_fraction,
                "root": catalog.primary_manifest(self.pub.store, r.version).root}

    def op_stop(self) -> dict[str, Any]:
        if self.pub is not None:
            self.pub.close()
            self.pub = None
        return {}


def serve() -> int:
    import traceback

    handler = PublisherAgent()
    replies, sys.stdout = sys.stdout, sys.stderr
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            doc = {"ok": True, **getattr(handler, f"op_{op}")(**cmd)}
        except Exception as exc:
            traceback.print_exc()
            doc = {"ok": False, "error": f"{op}: {type(exc).__name__}: {exc}"}
        replies.write(json.dumps(doc) + "\n")
        replies.flush()
    handler.op_stop()
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["publisher"]:
        print("usage: python -m weighthub.bench.net_agents publisher", file=sys.stderr)
        sys.exit(2)
    sys.exit(serve())
