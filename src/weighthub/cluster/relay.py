"""RelayTee: the publisher's Store wrapper that streams each chunk into the relay tree as it is put.

The Publisher calls `put` for every chunk from its encode threads as soon as the chunk is
ready, and puts the manifest last (create-only: the commit). RelayTee writes each chunk to the
backing store and, at the same time, pushes it to the tree's roots (each forwards it cut-through
to its subtree, see `server`). `put` returns when both are done, so memory stays bounded by the
Publisher's own encode concurrency (no queue here). The manifest and every other object go to
the backing store only; after the commit the publisher relays the manifest itself down the
same tree (`push_object`), once the hub recorded its digest: that push is how nodes learn of
the version, and what spares each of them reading the manifest from the store. Any chunk that
did not reach a node through the tree it fetches from a holder or the store (its sources).

Push failures never fail the publish: they are collected in `failed` (address -> chunk count)
for the hub to replan. A backing-store failure does fail `put`, as without the relay.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..catalog import CHUNK_SUFFIX
from ..errors import NetError
from ..format import chunk_checksum
from ..net import wire
from ..net.client import DEFAULT_TIMEOUTS, PeerClient, Timeouts
from ..store.base import Store

log = logging.getLogger(__name__)


class RelayTee:
    """A Store: the backing store, plus every chunk pushed to `tree()`'s roots. See module doc.

    Args:
        backing: where the version is committed (local directory, S3).
        tree: the current relay tree's roots with their subtrees (asked at every chunk, so a
            replanned tree takes effect on the next chunk).
        secret: the shared secret.
        max_pushes: concurrent pushes (roots x chunks in flight) across all callers.
        timeouts: per push (see PeerClient).
    """

    def __init__(self, backing: Store, tree: Callable[[], list[wire.Hop]], secret: bytes, *,
                 max_pushes: int = 8, timeouts: Timeouts = DEFAULT_TIMEOUTS) -> None:
        self.backing = backing
        self.url = backing.url
        self.tree = tree
        self.secret = secret
        self._timeouts = timeouts
        self._pool = ThreadPoolExecutor(max_pushes, thread_name_prefix="relay-push")
        self._lock = threading.Lock()
        self.failed: Counter[str] = Counter()
        self.pushed = 0

    def put(self, key: str, data: bytes | memoryview, *, create_only: bool = False) -> None:
        if not key.endswith(CHUNK_SUFFIX) or create_only:
            self.backing.put(key, data, create_only=create_only)
            return
        checksum = chunk_checksum(data)
        jobs = [self._pool.submit(self._push, root, key, data, checksum) for root in self.tree()]
        try:
            self.backing.put(key, data)
        finally:
            for job in jobs:
                job.result()  # _push never raises

    def push_object(self, key: str, data: bytes | memoryview, roots: list[wire.Hop]) -> None:
        """Push one object (not through the backing store) to `roots` and their subtrees; waits.

        Failures are counted in `failed` like a chunk's, never raised.
        """
        checksum = chunk_checksum(data)
        for job in [self._pool.submit(self._push, root, key, data, checksum) for root in roots]:
            job.result()

    def _push(self, root: wire.Hop, key: str, data: bytes | memoryview, checksum: str) -> None:
        try:
            failed = PeerClient(root.addr, self.secret, timeouts=self._timeouts).push(
                key, data, root.children, checksum)
        except NetError as exc:
            log.warning("relay push of %s to root %s failed: %s", key, root.addr, exc)
            failed = wire.addresses(root)
        with self._lock:
            self.pushed += 1
            self.failed.update(failed)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- everything else is the backing store's ---------------------------------------------
    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        return self.backing.get(key, max_bytes=max_bytes)

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        return self.backing.get_range(key, start, stop)

    def size(self, key: str) -> int:
        return self.backing.size(key)

    def delete(self, key: str) -> None:
        self.backing.delete(key)

    def children(self, prefix: str) -> list[str]:
        return self.backing.children(prefix)
