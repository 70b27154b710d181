"""Elastic join: a node with no weights copies the latest version's dense bits from holders.

A newcomer needs a whole version, not a delta. The store offers one only as an anchor plus a
chain of deltas (or a full representation written every K versions); every holder that
committed version v holds v's bits in memory and serves them as dense tensor ranges under read
leases (`leases`). So the join stripes the version's canonical bytes over the nearest holders
(ranges of `range_bytes`, round-robin; each range fails over to the next holder), writes them
straight into the target opened for v, and proves them before committing:

    trust    the version's primary manifest, read from the store (its create-only write is the
             commit); its tensor digests and root are what the bits must make
    verify   every tensor's digest against the manifest; a tensor that does not match is
             re-read from a holder that did not serve any of it (a corrupt or lying holder is
             excluded for the rest of the join); the root is checked last
    commit   `target.commit(Held(store, model, v, root))`, or `abort()` on any failure: the
             target holds nothing rather than mixed bits, and the caller falls back to the
             store (a Receiver over a PeerStore: anchor + deltas)

Leases: every holder the join read from is sent `release` at the end (best effort: an
unreleased lease expires after the holder's TTL), so holders defer an apply only while the
copy runs.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .. import catalog
from ..errors import IntegrityError, NetError, PeerUnavailable, UsageError, WeighthubError
from ..net.client import PeerClient, Timeouts
from ..store.base import Store
from ..targets.base import Held, Target
from ..tensors import TensorSpec, digest_bits, root_digest

log = logging.getLogger(__name__)

RANGE_BYTES = 8 << 20  # one dense read: a few ms on a LAN, small enough to stripe a tensor
_VERIFY_ROUNDS = 2  # re-reads of mismatching tensors before giving up on holders
JOIN_TIMEOUTS = Timeouts(connect=2.0, io=5.0, deadline=30.0)


@dataclass(slots=True)
class JoinResult:
    """What one join did: the version, how many bytes came from each holder, the time."""

    version: int
    bytes_by_holder: dict[str, int] = field(default_factory=dict)
    excluded: list[str] = field(default_factory=list)  # holders that failed or lied
    seconds: float = 0.0

    @property
    def bytes(self) -> int:
        return sum(self.bytes_by_holder.values())


@dataclass(frozen=True, slots=True)
class _Range:
    tensor: str
    start: int  # byte offsets into the tensor's canonical bytes
    stop: int


class _Holders:
    """The join's holders, in rank order; those that failed are excluded (thread-safe)."""

    def __init__(self, addrs: Sequence[str]):
        self.addrs = list(dict.fromkeys(addrs))
        self._bad: set[str] = set()
        self._lock = threading.Lock()

    def exclude(self, addr: str) -> None:
        with self._lock:
            self._bad.add(addr)

    def excluded(self) -> list[str]:
        with self._lock:
            return sorted(self._bad)

    def order(self, i: int, avoid: frozenset[str] = frozenset()) -> list[str]:
        """Holders for the i-th range: round-robin start (striping), then the others."""
        with self._lock:
            good = [a for a in self.addrs if a not in self._bad and a not in avoid]
        if not good:
            return []
        k = i % len(good)
        return good[k:] + good[:k]


def join_from_holders(target: Target, store: Store, version: int, holders: Sequence[str],
                      secret: bytes, *, stripes: int = 4, range_bytes: int = RANGE_BYTES,
                      timeouts: Timeouts = JOIN_TIMEOUTS,
                      lease: str | None = None) -> JoinResult:
    """Materialize `version` in `target` (which must hold nothing) from holders' dense bits.

    Args:
        target: an empty target (held() is None).
        store: the object store: the version's manifest (the trust anchor) is read from it.
        version: a committed version the holders hold.
        holders: chunk-server addresses, best first (the hub's ranking).
        secret: the shared secret.
        stripes: parallel range reads (spread over the holders).
        range_bytes: bytes per dense read.
        timeouts: per read (see PeerClient).
        lease: read-lease id (default: a fresh one).

    Raises:
        PeerUnavailable: no holder could serve some range (all failed, refused or were excluded).
        IntegrityError: tensors still did not match the manifest after re-reads.
        UsageError: the target already holds a version, or bad arguments.
        Anything the store raises for the manifest. On every failure the target is aborted.
    """
    held = target.held()
    if held is not None:
        raise UsageError(f"elastic join needs an empty target; this one holds version {held.version}: "
                         "sync it with a Receiver instead")
    if stripes < 1 or range_bytes < 1:
        raise UsageError(f"join stripes and range_bytes must be ≥ 1, got {stripes}, {range_bytes}")
    t0 = time.perf_counter()
    manifest = catalog.primary_manifest(store, version)
    specs = manifest.specs()
    expected = {e.name: e.digest for e in manifest.tensors}
    pool = _Holders(holders)
    if not pool.addrs:
        raise PeerUnavailable(f"no holder of version {version} to join from")
    lease_id = lease or f"join-{uuid.uuid4().hex}"
    result = JoinResult(version)
    counted = threading.Lock()
    used: set[str] = set()
    views = target.open(specs)
    try:
        served_by: dict[str, set[str]] = {s.name: set() for s in specs}

        def read(job: tuple[int, _Range, frozenset[str]]) -> None:
            i, r, avoid = job
            dst = views[r.tensor].reshape(-1).view(np.uint8)
            problems = []
            for addr in pool.order(i, avoid):
                with counted:
                    used.add(addr)
                try:
                    data = PeerClient(addr, secret, timeouts=timeouts).dense_range(
                        version, r.tensor, r.start, r.stop, lease=lease_id)
                except NetError as exc:
                    log.warning("join v%d: holder %s failed for %s[%d:%d] (%s); next holder",
                                version, addr, r.tensor, r.start, r.stop, exc)
                    pool.exclude(addr)
                    problems.append(f"{addr}: {exc}")
                    continue
                if len(data) != r.stop - r.start:
                    pool.exclude(addr)
                    problems.append(f"{addr}: {len(data)} bytes for a range of {r.stop - r.start}")
                    continue
                dst[r.start:r.stop] = np.frombuffer(data, dtype=np.uint8)
                with counted:
                    result.bytes_by_holder[addr] = result.bytes_by_holder.get(addr, 0) + len(data)
                    served_by[r.tensor].add(addr)
                return
            raise PeerUnavailable(f"join v{version}: no holder served {r.tensor}[{r.start}:{r.stop}] "
                                  f"({'; '.join(problems) or 'every holder excluded'})")

        todo = [s.name for s in specs]
        by_name = {s.name: s for s in specs}
        with ThreadPoolExecutor(max(1, stripes)) as ex:
            for round_ in range(_VERIFY_ROUNDS + 1):
                avoid = {n: frozenset(served_by[n]) for n in todo}
                for n in todo:
                    served_by[n] = set()
                jobs = [(i, r, avoid[r.tensor])
                        for i, r in enumerate(_ranges([by_name[n] for n in todo], range_bytes))]
                list(ex.map(read, jobs))
                bad = _mismatching(views, [by_name[n] for n in todo], expected, ex)
                if not bad:
                    break
                liars = sorted({a for n in bad for a in served_by[n]})
                log.warning("join v%d: %d tensor(s) do not match the manifest (%s…), served by %s; "
                            "re-reading them from other holders", version, len(bad), bad[0], liars)
                for a in liars:
                    pool.exclude(a)
                if round_ == _VERIFY_ROUNDS:
                    raise IntegrityError(f"join v{version}: tensors {bad[:5]} still differ from the "
                                         f"manifest's digests after {_VERIFY_ROUNDS} re-reads; "
                                         "falling back to the store")
                todo = bad
        digests = {s.name: bytes.fromhex(expected[s.name]) for s in specs}
        root = root_digest((s, digests[s.name]) for s in specs).hex()
        if root != manifest.root:  # the manifest's own table contradicts its root
            raise IntegrityError(f"join v{version}: tensor digests make root {root[:12]}…, the "
                                 f"manifest says {manifest.root[:12]}…")
        target.commit(Held(store.url, manifest.model, version, manifest.root))
    except BaseException:
        target.abort()
        raise
    finally:
        _release(used, lease_id, secret, timeouts)
    result.excluded = pool.excluded()
    result.seconds = time.perf_counter() - t0
    return result


def _ranges(specs: Sequence[TensorSpec], range_bytes: int) -> list[_Range]:
    return [_Range(s.name, a, min(a + range_bytes, s.nbytes))
            for s in specs for a in range(0, s.nbytes, range_bytes)]


def _mismatching(views: dict[str, np.ndarray], specs: Sequence[TensorSpec],
                 expected: dict[str, str], ex: ThreadPoolExecutor) -> list[str]:
    digests = ex.map(lambda s: digest_bits(views[s.name], threads=1).hex(), specs)
    return [s.name for s, d in zip(specs, digests, strict=True) if d != expected[s.name]]


def _release(addrs: set[str], lease: str, secret: bytes, timeouts: Timeouts) -> None:
    quick = Timeouts(connect=min(timeouts.connect, 1.0), io=min(timeouts.io, 2.0),
                     deadline=min(timeouts.deadline, 3.0))
    for addr in sorted(addrs):
        with contextlib.suppress(WeighthubError):  # dead or slow: the lease expires (holder's TTL)
            PeerClient(addr, secret, timeouts=quick).release(lease)
