"""Elastic join: a node with no weights gets the latest version's dense bits from holders.

A newcomer needs a whole version, not a delta. The store offers one only as an anchor plus a
chain of deltas (or a full representation written every K versions); every holder that
committed version v holds v's bits in memory and serves them as dense tensor ranges under read
leases (`leases`). So the join is a *source of a full representation* of v, fed to the one
transaction engine (`receive.transact`) like any other input:

    trust    the version's primary manifest, read from the store (its create-only write is the
             commit); its tensor digests and root are what the bits must make, and its table
             must make its root (checked before the target is touched)
    read     the version's tensors in batches, each as ranges of `range_bytes` striped
             round-robin over the nearest holders; a range fails over to the next holder
    check    every tensor's digest against the manifest as it arrives; a tensor that does not
             match is re-read from holders that did not serve any of it (a corrupt or lying
             holder is excluded for the rest of the join)
    engine   each checked tensor is a chunk of a full representation (one dense segment): the
             engine applies it to the target opened for v while the next batch is read,
             verifies every tensor's digest, and commits `Held(store, model, v, root)` or rolls
             back and aborts: the target holds nothing rather than mixed bits, and the caller
             falls back to the store (a Receiver over a PeerStore: anchor + deltas)

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
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import numpy as np

from .. import catalog
from ..codec import Op, Positions, Segment, Values
from ..digest import digest_bits, root_digest
from ..errors import IntegrityError, NetError, PeerUnavailable, UsageError, WeighthubError
from ..format import ChunkFrame, ChunkRef, Manifest
from ..net.client import PeerClient, Timeouts
from ..receive import Chunk, Step, transact
from ..store.base import Store
from ..targets.base import Target
from ..tensors import TensorSpec, check_same_model

log = logging.getLogger(__name__)

RANGE_BYTES = 8 << 20  # one dense read: a few ms on a LAN, small enough to stripe a tensor
BATCH_RANGES = 4  # ranges per stripe in one batch: bounds the tensors held before the apply
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
        IntegrityError: tensors still did not match the manifest after re-reads, or the
            manifest's tensor table contradicts its root.
        UsageError: the target already holds a version, or bad arguments.
        Anything the store raises for the manifest. On every failure the target is rolled back
        and aborted (by the engine).
    """
    held = target.held()
    if held is not None:
        raise UsageError(f"elastic join needs an empty target; this one holds version {held.version}: "
                         "sync it with a Receiver instead")
    if stripes < 1 or range_bytes < 1:
        raise UsageError(f"join stripes and range_bytes must be ≥ 1, got {stripes}, {range_bytes}")
    t0 = time.perf_counter()
    manifest = catalog.primary_manifest(store, version)
    full = as_full_representation(manifest)
    specs = full.specs()
    current = target.specs()
    if current is not None:
        check_same_model(specs, current, "the target")
    pool = _Holders(holders)
    if not pool.addrs:
        raise PeerUnavailable(f"no holder of version {version} to join from")
    result = JoinResult(version)
    with HolderSource(full, pool, secret, lease=lease or f"join-{uuid.uuid4().hex}",
                      stripes=stripes, range_bytes=range_bytes, timeouts=timeouts,
                      counts=result.bytes_by_holder) as source:
        transact(target, [Step(full, source.chunks())], store=store.url, held=None, specs=specs,
                 fresh=current is None)
    result.excluded = pool.excluded()
    result.seconds = time.perf_counter() - t0
    return result


def as_full_representation(manifest: Manifest) -> Manifest:
    """The version's manifest as a full representation whose chunks are its whole tensors
    (`dense/<name>`), as a join reads them from holders.

    Raises IntegrityError if the manifest's tensor table does not make its root.
    """
    specs = manifest.specs()
    root = root_digest((s, bytes.fromhex(e.digest)) for s, e in zip(specs, manifest.tensors,
                                                                     strict=True)).hex()
    if root != manifest.root:
        raise IntegrityError(f"join v{manifest.version}: tensor digests make root {root[:12]}…, "
                             f"the manifest says {manifest.root[:12]}…")
    prefix = f"{catalog.version_dir(manifest.version)}/dense"
    chunks = [ChunkRef(f"{prefix}/{s.name}", s.nbytes, "", [(ti, 0, s.numel)])
              for ti, s in enumerate(specs)]
    dense = sum(s.nbytes for s in specs)
    return msgspec.structs.replace(manifest, base=None, base_root=None, chunks=chunks,
                                   dense_bytes=dense, payload_bytes=dense,
                                   changed=sum(s.numel for s in specs))


class HolderSource:
    """Reads a full representation's tensors from holders, striped, each digest-checked.

    Use as a context manager: on exit its readers stop and every holder it read from is sent
    `release(lease)`. `counts` (holder → bytes served) is updated as ranges arrive.
    """

    def __init__(self, full: Manifest, holders: _Holders, secret: bytes, *, lease: str,
                 stripes: int, range_bytes: int, timeouts: Timeouts,
                 counts: dict[str, int]) -> None:
        self.full = full
        self.holders = holders
        self.secret = secret
        self.lease = lease
        self.range_bytes = range_bytes
        self.batch_bytes = range_bytes * stripes * BATCH_RANGES
        self.timeouts = timeouts
        self.counts = counts
        self._lock = threading.Lock()
        self._used: set[str] = set()
        self._stripe = 0  # index of the next range: consecutive ranges start on other holders
        self._ex = ThreadPoolExecutor(stripes)

    def __enter__(self) -> HolderSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self._ex.shutdown(wait=True, cancel_futures=True)
        _release(self._used, self.lease, self.secret, self.timeouts)

    def chunks(self) -> Iterator[Chunk]:
        """The representation's chunks (one per tensor), a batch of tensors at a time."""
        specs = self.full.specs()
        batch: list[int] = []
        size = 0
        for ti, s in enumerate(specs):
            batch.append(ti)
            size += s.nbytes
            if size >= self.batch_bytes or ti == len(specs) - 1:
                bufs = self._read_checked([specs[i] for i in batch])
                for i in batch:
                    s = specs[i]
                    seg = Segment(i, 0, s.numel, Op.DENSE, Positions.ALL, Values.RAW, s.numel,
                                  np.empty(0, np.uint8), bufs[s.name])
                    yield Chunk(ChunkFrame((seg,) if s.numel else ()), self.full.chunks[i])
                batch, size = [], 0

    def _read_checked(self, specs: list[TensorSpec]) -> dict[str, np.ndarray]:
        """Read `specs`' bytes; re-read tensors whose digests miss the manifest's."""
        version = self.full.version
        expected = {e.name: e.digest for e in self.full.tensors}
        bufs = {s.name: np.empty(s.nbytes, np.uint8) for s in specs}
        served_by: dict[str, set[str]] = {s.name: set() for s in specs}
        todo = list(specs)
        for round_ in range(_VERIFY_ROUNDS + 1):
            avoid = {s.name: frozenset(served_by[s.name]) for s in todo}
            for s in todo:
                served_by[s.name] = set()
            ranges = _ranges(todo, self.range_bytes)
            with self._lock:
                first, self._stripe = self._stripe, self._stripe + len(ranges)
            jobs = [(first + i, r, avoid[r.tensor]) for i, r in enumerate(ranges)]
            list(self._ex.map(lambda job: self._read(job[0], job[1], job[2], bufs, served_by),
                              jobs))
            digests = self._ex.map(
                lambda s: digest_bits(bufs[s.name].view(s.dtype.uint), threads=1).hex(), todo)
            bad = [s for s, d in zip(todo, digests, strict=True) if d != expected[s.name]]
            if not bad:
                return bufs
            liars = sorted({a for s in bad for a in served_by[s.name]})
            log.warning("join v%d: %d tensor(s) do not match the manifest (%s…), served by %s; "
                        "re-reading them from other holders", version, len(bad), bad[0].name, liars)
            for a in liars:
                self.holders.exclude(a)
            if round_ == _VERIFY_ROUNDS:
                raise IntegrityError(f"join v{version}: tensors {[s.name for s in bad[:5]]} still "
                                     f"differ from the manifest's digests after {_VERIFY_ROUNDS} "
                                     "re-reads; falling back to the store")
            todo = bad
        raise AssertionError("unreachable")  # the last round returns or raises

    def _read(self, i: int, r: _Range, avoid: frozenset[str], bufs: dict[str, np.ndarray],
              served_by: dict[str, set[str]]) -> None:
        """Read range `r` into its tensor's buffer from the first holder that serves it."""
        version = self.full.version
        problems = []
        for addr in self.holders.order(i, avoid):
            with self._lock:
                self._used.add(addr)
            try:
                data = PeerClient(addr, self.secret, timeouts=self.timeouts).dense_range(
                    version, r.tensor, r.start, r.stop, lease=self.lease)
            except NetError as exc:
                log.warning("join v%d: holder %s failed for %s[%d:%d] (%s); next holder",
                            version, addr, r.tensor, r.start, r.stop, exc)
                self.holders.exclude(addr)
                problems.append(f"{addr}: {exc}")
                continue
            if len(data) != r.stop - r.start:
                self.holders.exclude(addr)
                problems.append(f"{addr}: {len(data)} bytes for a range of {r.stop - r.start}")
                continue
            bufs[r.tensor][r.start:r.stop] = np.frombuffer(data, dtype=np.uint8)
            with self._lock:
                self.counts[addr] = self.counts.get(addr, 0) + len(data)
                served_by[r.tensor].add(addr)
            return
        raise PeerUnavailable(f"join v{version}: no holder served {r.tensor}[{r.start}:{r.stop}] "
                              f"({'; '.join(problems) or 'every holder excluded'})")


def _ranges(specs: Sequence[TensorSpec], range_bytes: int) -> list[_Range]:
    return [_Range(s.name, a, min(a + range_bytes, s.nbytes))
            for s in specs for a in range(0, s.nbytes, range_bytes)]


def _release(addrs: set[str], lease: str, secret: bytes, timeouts: Timeouts) -> None:
    quick = Timeouts(connect=min(timeouts.connect, 1.0), io=min(timeouts.io, 2.0),
                     deadline=min(timeouts.deadline, 3.0))
    for addr in sorted(addrs):
        with contextlib.suppress(WeighthubError):  # dead or slow: the lease expires (holder's TTL)
            PeerClient(addr, secret, timeouts=quick).release(lease)
