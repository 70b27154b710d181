"""The hub's logic: versions, holders with leases, source ranking, relay plans, retention.

`Hub` keeps the state in memory (every read is answered from there) and writes each change to
SQLite (`hubstate.HubDB`) before it takes effect in memory, on one DB thread so the event loop
never blocks: what the hub has acknowledged is on disk. Writers are serialized by one asyncio
lock; heartbeats that change nothing but the lease and load touch no disk at all.

Every operation takes the request's JSON document, validates it here (the edge) and returns a
JSON-able dict, or raises a weighthub error that the HTTP layer maps to a status code.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ..errors import LimitError, ModelMismatch, UsageError, VersionError, VersionNotFound
from ..net.wire import parse_addr
from .hubstate import HolderRecord, HubDB, VersionRecord
from .plan import MAX_DEGREE, Node, RelayTree, plan_tree, replan
from .topology import Candidate, Labels, rank

MAX_VERSION = 2**62
MAX_ID = 256
MAX_ADDRESS = 512
MAX_KEY = 1024
MAX_URL = 2048
MAX_HELD = 4096  # versions one holder may list
MAX_LOAD = 1_000_000
MAX_FAILED = 4096
_SHA256_HEX = frozenset("0123456789abcdef")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class HubConfig:
    """Args of `weighthub serve hub`: database path, lease TTL, retention, default fan-out."""

    db: Path
    lease_ttl: float = 10.0
    retain: int = 8  # newest K committed versions kept; 0 keeps all
    degree: int = 4

    def __post_init__(self) -> None:
        if not 0.1 <= self.lease_ttl <= 3600:
            raise UsageError(f"--lease-ttl must be in 0.1..3600 seconds, got {self.lease_ttl}")
        if not 0 <= self.retain <= 1_000_000:
            raise UsageError(f"--retain must be ≥ 0 (0 keeps every version), got {self.retain}")
        if not 1 <= self.degree <= MAX_DEGREE:
            raise UsageError(f"--fanout must be in 1..{MAX_DEGREE}, got {self.degree}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `weighthub serve hub` (also `python -m weighthub.cluster.hub`)."""
    p.add_argument("--db", required=True, metavar="PATH", help="SQLite database (created if absent)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: a free one, printed)")
    p.add_argument("--secret-file", default=None, metavar="F",
                   help="shared secret (default: $WEIGHTHUB_SECRET)")
    p.add_argument("--lease-ttl", type=float, default=10.0, metavar="S",
                   help="a holder that has not heartbeat for S seconds is no longer a source")
    p.add_argument("--retain", type=int, default=8, metavar="K",
                   help="keep the K newest versions; older ones are released (0: keep all)")
    p.add_argument("--fanout", type=int, default=4, metavar="D", help="default relay fan-out degree")


def config_from_args(args: argparse.Namespace) -> HubConfig:
    return HubConfig(db=Path(args.db), lease_ttl=args.lease_ttl, retain=args.retain, degree=args.fanout)


@dataclass(slots=True)
class _Holder:
    record: HolderRecord
    load: int
    expires: float  # on the hub's monotonic clock
    # versions whose dense bits it serves now: a liveness fact like the lease (not stored, so
    # a restarted hub offers a holder to joiners only once it says so again)
    serving: tuple[int, ...] = ()


def _field(doc: Mapping[str, Any], name: str, kind: type[T], *, required: bool = True,
           default: T | None = None) -> T:
    if not isinstance(doc, Mapping):
        raise UsageError(f"request body must be a JSON object, got {type(doc).__name__}")
    if name not in doc or doc[name] is None:
        if required:
            raise UsageError(f"missing field {name!r}")
        return default  # type: ignore[return-value]
    value = doc[name]
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise UsageError(f"field {name!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def _int(doc: Mapping[str, Any], name: str, lo: int, hi: int, **kw: Any) -> int:
    value = _field(doc, name, int, **kw)
    if value is not None and not lo <= value <= hi:
        raise UsageError(f"field {name!r} must be in {lo}..{hi}, got {value}")
    return value


def _versions(doc: Mapping[str, Any], name: str) -> tuple[int, ...]:
    held = _field(doc, name, list, required=False, default=[])
    if len(held) > MAX_HELD or not all(type(v) is int and 0 <= v <= MAX_VERSION for v in held):
        raise UsageError(f"field {name!r} must be a list of at most {MAX_HELD} version numbers")
    return tuple(sorted(set(held)))


def _sha256(doc: Mapping[str, Any], name: str) -> str | None:
    value = _field(doc, name, str, required=False)
    if value is not None and (len(value) != 64 or not set(value) <= _SHA256_HEX):
        raise UsageError(f"field {name!r} must be a SHA-256 as 64 lowercase hex digits, got {value[:80]!r}")
    return value


def _str(doc: Mapping[str, Any], name: str, limit: int, **kw: Any) -> str:
    value = _field(doc, name, str, **kw)
    if value is not None and not 0 < len(value) <= limit:
        raise UsageError(f"field {name!r} must be 1..{limit} characters, got {len(value)}")
    return value


def _address(doc: Mapping[str, Any]) -> str:
    """The holder's chunk-server address, checked as peers will parse it: the hub hands it out."""
    address = _str(doc, "address", MAX_ADDRESS)
    try:
        parse_addr(address)
    except LimitError as exc:
        raise UsageError(f"field 'address' {address!r} must be host:port where the holder "
                         "serves chunks") from exc
    return address


class Hub:
    """See the module docstring. `await open()` before use, `await close()` after."""

    def __init__(self, config: HubConfig, *, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._clock = clock
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hubdb")
        self._lock = asyncio.Lock()
        self._db: HubDB | None = None
        self.versions: dict[int, VersionRecord] = {}
        self.holders: dict[str, _Holder] = {}
        self.plans: dict[int, RelayTree] = {}

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    @property
    def db(self) -> HubDB:
        if self._db is None:
            raise RuntimeError("Hub.open() was not awaited")
        return self._db

    async def open(self) -> None:
        """Load the durable state; every stored holder gets a fresh lease from now."""
        self._db = await self._run(HubDB, self.config.db)
        self.versions = {r.version: r for r in await self._run(self.db.load_versions)}
        expires = self._clock() + self.config.lease_ttl
        self.holders = {h.id: _Holder(h, 0, expires) for h in await self._run(self.db.load_holders)}
        self.plans = {v: RelayTree.from_dict(t) for v, t in (await self._run(self.db.load_plans)).items()}

    async def close(self) -> None:
        if self._db is not None:
            await self._run(self._db.close)
            self._db = None
        self._io.shutdown(wait=True)

    # -- versions ----------------------------------------------------------------------------
    def latest_version(self) -> int | None:
        return max(self.versions, default=None)

    def _retained(self, v: int) -> VersionRecord:
        rec = self.versions.get(v)
        if rec is not None and rec.released_at is not None:
            raise VersionNotFound(f"version {v} was released by the hub (it keeps the newest "
                                  f"{self.config.retain}); sync to the latest, {self.latest_version()}")
        if rec is None:
            raise VersionNotFound(f"version {v} is not committed on this hub "
                                  f"(latest: {self.latest_version()})")
        return rec

    async def announce(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        """A publisher committed a version. Idempotent for the same commit; versions only grow.

        `manifest_sha256` (optional) is recorded with it: nodes trust a manifest a peer relays
        to them only if it hashes to this digest.
        """
        rec = VersionRecord(
            version=_int(doc, "version", 0, MAX_VERSION), manifest_key=_str(doc, "manifest_key", MAX_KEY),
            store_url=_str(doc, "store_url", MAX_URL), model_id=_str(doc, "model_id", MAX_ID),
            root=_str(doc, "root", MAX_ID), publisher=_str(doc, "publisher", MAX_ID, required=False),
            committed_at=time.time(), manifest_sha256=_sha256(doc, "manifest_sha256"))
        async with self._lock:
            old = self.versions.get(rec.version)
            if old is not None:
                if not old.same_commit(rec):
                    raise VersionError(f"version {rec.version} is already committed with root {old.root} "
                                       f"(manifest {old.manifest_key}); publish the next version instead")
                return {"version": rec.version, "created": False, "released": []}
            latest = self.latest_version()
            if latest is not None:
                if rec.version < latest:
                    raise VersionError(f"version {rec.version} is older than the latest committed, "
                                       f"{latest}: versions only grow")
                if rec.model_id != self.versions[latest].model_id:
                    raise ModelMismatch(f"version {rec.version} is of model {rec.model_id!r}; this hub "
                                        f"tracks {self.versions[latest].model_id!r} (run one hub per model)")
            kept = sorted(v for v, r in self.versions.items() if r.released_at is None)
            release = kept[: max(0, len(kept) + 1 - self.config.retain)] if self.config.retain else []
            now = time.time()
            await self._run(self.db.commit_version, rec, release, now)
            self.versions[rec.version] = rec
            self._mark_released(release, now)
        return {"version": rec.version, "created": True, "released": release}

    def _mark_released(self, versions: list[int], at: float) -> None:
        for v in versions:
            self.versions[v] = dataclasses.replace(self.versions[v], released_at=at)
            self.plans.pop(v, None)

    async def release(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        """Release one version: holders may drop it. The latest version cannot be released."""
        v = _int(doc, "version", 0, MAX_VERSION)
        async with self._lock:
            rec = self.versions.get(v)
            if rec is None:
                raise VersionNotFound(f"version {v} is not committed on this hub "
                                      f"(latest: {self.latest_version()})")
            if rec.released_at is not None:
                return {"released": []}
            if v == self.latest_version():
                raise VersionError(f"version {v} is the latest; it cannot be released "
                                   "(receivers and newcomers sync to it)")
            now = time.time()
            await self._run(self.db.release, [v], now)
            self._mark_released([v], now)
        return {"released": [v]}

    def latest(self) -> dict[str, Any]:
        v = self.latest_version()
        return {"latest": v, "record": None if v is None else self.versions[v].to_dict()}

    def list_versions(self) -> dict[str, Any]:
        return {"versions": [self.versions[v].to_dict() for v in sorted(self.versions)]}

    # -- holders -----------------------------------------------------------------------------
    async def register(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        """Register or heartbeat (the same call): renews the lease, updates what it holds and its load.

        Returns the lease TTL, the latest version, and which of its versions the hub released.
        """
        held, serving = _versions(doc, "versions"), _versions(doc, "serving")
        rec = HolderRecord(id=_str(doc, "id", MAX_ID), address=_address(doc),
                           labels=Labels.from_dict(_field(doc, "labels", dict, required=False)),
                           versions=held,
                           subscribed=_field(doc, "subscribe", bool, required=False, default=False),
                           dense=_field(doc, "dense", bool, required=False, default=False))
        load = _int(doc, "load", 0, MAX_LOAD, required=False, default=0)
        current = self.holders.get(rec.id)
        if current is None or current.record != rec:
            async with self._lock:
                await self._run(self.db.put_holder, rec)
                self.holders[rec.id] = _Holder(rec, load, self._clock() + self.config.lease_ttl,
                                               serving)
        else:  # a plain heartbeat: lease, load and what it serves live in memory only
            current.load, current.expires = load, self._clock() + self.config.lease_ttl
            current.serving = serving
        released = [v for v in rec.versions
                    if v in self.versions and self.versions[v].released_at is not None]
        return {"lease_ttl": self.config.lease_ttl, "latest": self.latest_version(), "release": released}

    async def leave(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        hid = _str(doc, "id", MAX_ID)
        async with self._lock:
            if self.holders.pop(hid, None) is None:
                return {"left": False}
            await self._run(self.db.delete_holders, [hid])
        return {"left": True}

    def live_holders(self) -> list[_Holder]:
        now = self._clock()
        return [h for h in self.holders.values() if h.expires > now]

    async def sweep(self) -> list[str]:
        """Forget holders whose lease expired (they re-register with their next heartbeat)."""
        now = self._clock()
        async with self._lock:
            gone = [i for i, h in self.holders.items() if h.expires <= now]
            for i in gone:  # from memory first: a heartbeat racing this sweep then re-registers
                del self.holders[i]
            if gone:
                await self._run(self.db.delete_holders, gone)
        return gone

    def list_holders(self) -> dict[str, Any]:
        now = self._clock()
        return {"holders": [{"id": h.record.id, "address": h.record.address,
                             "labels": h.record.labels.to_dict(), "versions": list(h.record.versions),
                             "load": h.load, "subscribed": h.record.subscribed, "dense": h.record.dense,
                             "serving": list(h.serving),
                             "lease_left": round(h.expires - now, 3)}
                            for h in sorted(self.live_holders(), key=lambda h: h.record.id)]}

    def sources(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        """Where to get `key` of `version`: live holders of it ranked for the asker, then the store.

        A version being relayed (it has a plan) but not yet committed has holders, no store entry.
        With `dense` true only holders that declared they serve dense reads, and said they serve
        `version`'s now (committed, not being replaced), are listed: a joining node asks for
        those; others (a publisher, a node that only has the version's chunks or is applying
        it) would only refuse it.
        """
        v = _int(doc, "version", 0, MAX_VERSION)
        key = _str(doc, "key", MAX_KEY)
        asker = _str(doc, "asker", MAX_ID, required=False)
        labels = Labels.from_dict(_field(doc, "labels", dict, required=False))
        dense = _field(doc, "dense", bool, required=False, default=False)
        rec = self.versions.get(v)
        if rec is not None or v not in self.plans:
            rec = self._retained(v)
        cands = [Candidate(h.record.id, h.record.address, h.record.labels, h.load)
                 for h in self.live_holders() if v in h.record.versions and h.record.id != asker
                 and (not dense or (h.record.dense and v in h.serving))]
        out = [{"id": c.id, "address": c.address, "tier": t, "load": c.load}
               for c, t in rank(cands, labels, key)]
        if rec is not None:
            out.append({"id": "store", "address": rec.store_url, "tier": "store", "load": 0})
        return {"version": v, "key": key, "sources": out}

    # -- relay plans ---------------------------------------------------------------------------
    def _plan_doc(self, v: int, tree: RelayTree) -> dict[str, Any]:
        addresses = {n: self.holders[n].record.address for n in tree.labels if n in self.holders}
        return {"version": v, "tree": tree.to_dict(), "addresses": addresses}

    def get_plan(self, v: int) -> dict[str, Any]:
        tree = self.plans.get(v)
        if tree is None:
            rec = self.versions.get(v)
            if rec is not None and rec.released_at is not None:
                self._retained(v)  # raises: released
            raise VersionNotFound(f"no relay plan for version {v} (its publisher creates it; "
                                  "fetch from sources instead)")
        return self._plan_doc(v, tree)

    async def plan(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        """The relay plan of a refit: created by its publisher (frozen from then on), read by all."""
        v = _int(doc, "version", 0, MAX_VERSION)
        publisher = _str(doc, "publisher", MAX_ID, required=False)
        degree = _int(doc, "degree", 1, MAX_DEGREE, required=False, default=self.config.degree)
        async with self._lock:
            tree = self.plans.get(v)
            if tree is not None or publisher is None:
                if tree is not None and publisher is not None and publisher != tree.root:
                    raise VersionError(f"version {v} is already being relayed by {tree.root!r}, "
                                       f"not {publisher!r}")
                return self.get_plan(v)
            if v in self.versions:
                self._retained(v)
            live = {h.record.id: h.record for h in self.live_holders()}
            if publisher not in live:
                raise UsageError(f"publisher {publisher!r} is not a registered holder (or its lease "
                                 "expired); register it with the hub before planning")
            receivers = [Node(r.id, r.labels) for r in live.values()
                         if r.subscribed and r.id != publisher and v not in r.versions]
            tree = plan_tree(Node(publisher, live[publisher].labels), receivers, degree)
            await self._run(self.db.put_plan, v, tree.to_dict())
            self.plans[v] = tree
        return self._plan_doc(v, tree)

    async def report_failed(self, v: int, doc: Mapping[str, Any]) -> dict[str, Any]:
        """Nodes of a plan failed: re-attach their children (idempotent)."""
        failed = _field(doc, "failed", list)
        if len(failed) > MAX_FAILED or not all(isinstance(f, str) for f in failed):
            raise UsageError(f"field 'failed' must be a list of at most {MAX_FAILED} holder ids")
        async with self._lock:
            tree = self.plans.get(v)
            if tree is None:
                return self.get_plan(v)  # raises
            new = replan(tree, failed)
            if new is not tree:
                await self._run(self.db.put_plan, v, new.to_dict())
                self.plans[v] = new
        return self._plan_doc(v, new)
