"""Read leases: a holder never changes bits that a reader is reading.

A newcomer copies a held version tensor by tensor, range by range, from a holder's live target
(dense reads). Choice: **defer the holder's apply behind read leases**, not copy-on-write.
A snapshot of the version would cost a second copy of the whole model in every holder (holders
are GPU workers with no spare memory for that), while a join takes seconds: deferring the next
apply by at most `wait_s` is cheap, and the holder's Receiver stages (fetches, decodes) during
that wait anyway, so only the pause starts later.

Protocol:
    reader   each dense read names a lease id; the first read of an id opens the lease (only
             while no apply is pending), every read renews it for `ttl_s`, `release` ends it.
    holder   `LeasedTarget.open()` (the start of the Receiver's apply) calls `begin_apply`:
             no new lease opens; it waits until every open lease is released or expired, at
             most `wait_s` (a stuck reader cannot stall refits forever), and always until no
             copy is in flight (copies are bounded by the server's max body, milliseconds).
             Then reads are refused until `commit`/`abort` (`end_apply`); after a commit the
             old version is gone and reads of it are refused, naming the version now held.
Each read copies its range out under the in-flight count, so the bytes sent are the held
version's even if the apply starts right after the copy.

Distrust: when the node finds its held bits modified outside weighthub (`baseguard`), it calls
`distrust(reason)`: reads are refused from then on (naming the reason), the target claims to
hold nothing (so the receiver re-materializes it), until the next commit. `on_change` is told
whenever the version served by dense reads may have changed (an apply begins, distrust), so the
node can tell the hub at once rather than at its next heartbeat.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

import numpy as np

from ..errors import LimitError, PeerRefused, WeighthubError
from ..targets.base import Held, Target, TargetWrapper, host_views
from ..tensors import TensorSpec, Words


class ReadLeases:
    """Lease table and apply gate over one holder's target. Thread-safe.

    Args:
        target: the holder's live target (its `held()` version is what dense reads serve).
        ttl_s: a lease not renewed for this long expires.
        wait_s: longest an apply waits for open leases.
        on_change: called (no lock held) when dense reads stop serving what they served.
    """

    def __init__(self, target: Target, *, ttl_s: float = 30.0, wait_s: float = 30.0,
                 on_change: Callable[[], None] | None = None) -> None:
        self.target = target
        self.ttl_s = ttl_s
        self.wait_s = wait_s
        self.on_change = on_change or (lambda: None)
        self.distrusted: str | None = None  # why the held bits are not served (see module doc)
        self._cond = threading.Condition()
        self._leases: dict[str, float] = {}  # lease id -> expiry (monotonic)
        self._inflight = 0
        self._pending = False  # an apply waits: no new leases
        self._applying = False  # bits are changing: no reads
        self.last_wait_s = 0.0  # how long the last begin_apply waited for readers

    def held_versions(self) -> list[int]:
        """The version dense reads serve now: none while applying or distrusted."""
        held = self._held()
        return [] if held is None or self._applying else [held.version]

    def _held(self) -> Held | None:
        if self.distrusted is not None:
            return None
        try:
            return self.target.held()
        except WeighthubError:  # e.g. the file changed behind us: nothing trusted to serve
            return None

    def distrust(self, reason: str) -> None:
        """Serve no dense reads of the held bits (modified outside weighthub) until `trust()`."""
        with self._cond:
            self.distrusted = reason
        self.on_change()

    def trust(self) -> None:
        with self._cond:
            self.distrusted = None

    def read(self, version: int, lease: str, tensor: str, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of `tensor`'s canonical bits at `version`, under `lease`.

        Raises:
            PeerRefused: the version is not held (or is being replaced), or no new lease may
                open because an apply is pending.
            LimitError: unknown tensor or a range outside it.
        """
        if not lease:
            raise LimitError("dense read without a lease id")
        with self._cond:
            held = self._held()
            now = time.monotonic()
            if self.distrusted is not None:
                raise PeerRefused(f"serving nothing, asked for dense version {version}: this "
                                  f"holder's bits are being re-materialized ({self.distrusted})")
            if self._applying or held is None or held.version != version:
                have = "nothing" if held is None or self._applying else f"version {held.version}"
                raise PeerRefused(f"serving {have}, asked for dense version {version}")
            if self._pending and self._leases.get(lease, 0.0) < now:
                raise PeerRefused(f"version {version} is being replaced; no new read leases")
            self._leases[lease] = now + self.ttl_s
            self._inflight += 1
        try:
            bits = host_views(self.target.peek(), "serving dense ranges").get(tensor)
            if bits is None:
                raise LimitError(f"no tensor {tensor!r} in version {version}")
            raw = bits.reshape(-1).view(np.uint8)
            if stop > raw.size:
                raise LimitError(f"range [{start}, {stop}) outside tensor {tensor!r} "
                                 f"({raw.size} bytes)")
            return raw[start:stop].tobytes()
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    def release(self, lease: str) -> None:
        with self._cond:
            self._leases.pop(lease, None)
            self._cond.notify_all()

    def begin_apply(self) -> bool:
        """Wait for readers (see module doc). True if every lease ended, False if some timed out.

        `last_wait_s` then holds how long it waited (reported by holders; tests check the bound
        on it rather than on the wall time of a whole sync, which a loaded machine stretches).
        """
        with self._cond:
            self._pending = True
            started = time.monotonic()
            deadline = started + self.wait_s
            while True:
                now = time.monotonic()
                live = any(exp > now for exp in self._leases.values())
                if not self._inflight and (not live or now >= deadline):
                    break
                self._cond.wait(timeout=0.05)  # woken early by release() and finished copies
            self._leases.clear()
            self._pending = False
            self._applying = True
            self.last_wait_s = now - started
        self.on_change()
        return not live

    def end_apply(self) -> None:
        with self._cond:
            self._applying = False
            self._cond.notify_all()


class LeasedTarget(TargetWrapper):
    """A Target whose apply waits for read leases: give it to the holder's Receiver.

    The Receiver calls open() at the start of its apply (inside its lock) and always ends with
    commit() or abort(); those bracket the window in which dense reads are refused. Reads
    (held, specs, peek) go to the inner target unchanged, except while the leases distrust the
    held bits: then it holds nothing, so the next transaction is a full representation.
    """

    def __init__(self, target: Target, leases: ReadLeases) -> None:
        super().__init__(target)
        self.leases = leases
        self.last_wait_clean = True
        self._own = target  # the inner target outside a re-materialization

    def rematerialize(self, reason: str, via: Target | None = None) -> None:
        """Hold nothing (and serve nothing) until the next commit; `via`: the inner target to
        write that commit through (one that re-materializes what the usual one refuses)."""
        self.leases.distrust(reason)
        self.inner = via or self._own

    def held(self) -> Held | None:
        return None if self.leases.distrusted is not None else self.inner.held()

    def specs(self) -> list[TensorSpec] | None:
        return None if self.leases.distrusted is not None else self.inner.specs()

    def open(self, specs: list[TensorSpec]) -> Mapping[str, Words]:
        self.last_wait_clean = self.leases.begin_apply()
        return self.inner.open(specs)

    def commit(self, held: Held) -> None:
        try:
            self.inner.commit(held)
            self.inner = self._own
            self.leases.trust()
        finally:
            self.leases.end_apply()

    def abort(self) -> None:
        try:
            self.inner.abort()
        finally:
            self.leases.end_apply()
