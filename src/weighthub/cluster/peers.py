"""Holders as chunk sources: the peers that hold a version, ranked, with failover and benching.

`HolderSource` is the holders' place in a receiver's `SourceList` (after the host staging cache
and the pushed cache, before the store). For each chunk it asks `rank(ref)` (normally the hub:
`HubClient.peer_sources`) for the addresses that hold `ref.version`, best first, and offers one
`PeerSource` per address that is not benched. The list asks them in turn and checks each one's
bytes; a peer that timed out, refused, died or sent bytes other than the manifest's is reported
back (`failed`) and skipped for `cooldown_s`, so one bad holder costs one timeout, not one per
chunk. A peer that lacks one chunk may have the next: that costs it nothing.

Nothing here trusts a peer: the list checks every chunk against its manifest, which comes from
the store (or is a relayed manifest the hub vouched for: `cluster.relayed`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import NetError, ObjectNotFound
from ..net.client import PeerClient, Timeouts
from ..sources import ChunkId, ChunkSource

log = logging.getLogger(__name__)
FETCH_TIMEOUTS = Timeouts(connect=2.0, io=5.0, deadline=30.0)


@dataclass(slots=True)
class HolderStats:
    benched: int = 0  # failures that benched a peer (timeouts, refusals, wrong bytes)


class PeerSource:
    """One holder's chunk server as a source. Each request waits ≤ min(its timeouts, timeout)
    and takes no body longer than the chunk's size in its manifest."""

    def __init__(self, addr: str, secret: bytes, *, timeouts: Timeouts = FETCH_TIMEOUTS) -> None:
        self.addr = addr
        self.name = f"peer {addr}"
        self.secret = secret
        self.timeouts = timeouts

    def get_chunk(self, ref: ChunkId, *, timeout: float) -> bytes:
        t = self.timeouts
        bounded = Timeouts(min(t.connect, timeout), min(t.io, timeout), min(t.deadline, timeout))
        # an answer longer than the manifest's chunk is refused before its body is received
        return PeerClient(self.addr, self.secret, timeouts=bounded,
                          max_body=ref.size).get(ref.key)


class HolderSource:
    """The ranked holders of a chunk's version (a `SourceGroup`); see the module docstring.

    Args:
        rank: chunk -> ranked holder addresses ("host:port"); may raise NetError (hub down:
            then no holder is asked, the store has every chunk).
        secret: the shared secret of the chunk servers.
        timeouts: per peer request (see PeerClient), each also bounded by the fetch's timeout.
        cooldown_s: how long a peer that failed is skipped.
    """

    def __init__(self, rank: Callable[[ChunkId], Sequence[str]], secret: bytes, *,
                 timeouts: Timeouts = FETCH_TIMEOUTS, cooldown_s: float = 30.0,
                 name: str = "holders") -> None:
        self.name = name
        self.rank = rank
        self.secret = secret
        self.timeouts = timeouts
        self.cooldown_s = cooldown_s
        self.stats = HolderStats()
        self._benched: dict[str, float] = {}  # addr -> monotonic time until which it is skipped
        self._lock = threading.Lock()

    def members(self, ref: ChunkId) -> list[PeerSource]:
        """A source per ranked holder of `ref.version` not benched now, best first."""
        try:
            ranked = self.rank(ref)
        except NetError as exc:  # the hub is down or slow: the store still has every chunk
            log.warning("chunk %s: no holder list (%s); reading the next source", ref.key, exc)
            return []
        now = time.monotonic()
        with self._lock:
            live = [a for a in ranked if self._benched.get(a, 0.0) <= now]
        return [PeerSource(a, self.secret, timeouts=self.timeouts) for a in live]

    def failed(self, member: ChunkSource, exc: Exception) -> None:
        """Bench the peer behind `member` for cooldown_s, unless it merely lacked the chunk."""
        if isinstance(exc, ObjectNotFound) or not isinstance(member, PeerSource):
            return
        with self._lock:
            self.stats.benched += 1
            self._benched[member.addr] = time.monotonic() + self.cooldown_s

    def get_chunk(self, ref: ChunkId, *, timeout: float) -> bytes:
        """The first answer of a ranked holder, unchecked (a `SourceList` checks each member
        in turn instead). Raises ObjectNotFound when no holder has it, else the last failure."""
        deadline = time.monotonic() + timeout
        last: Exception = ObjectNotFound(f"chunk {ref.key}: no holder of version {ref.version} "
                                         "has it")
        for member in self.members(ref):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                return member.get_chunk(ref, timeout=left)
            except (ObjectNotFound, NetError) as exc:
                self.failed(member, exc)
                last = exc
        raise last
