"""HubClient: a node's (or publisher's) synchronous client of the hub, safe to share between threads.

Lifecycle on a holder: `register(...)` once, `start_heartbeat()` (a daemon thread renews the lease
every TTL/3 and reports what it holds and its load; `set_versions`/`set_load` change what the
next heartbeat says), `stop()` at the end (leaves the hub). A publisher: `plan(v, publisher=me)`
before streaming version v, `report_failed` when a relay node dies, `announce_committed(store,
v)` after the manifest's create-only write (a one-shot publisher, `weighthub publish --hub`,
only announces). Receivers: `sources(key, v)` (or `peer_sources(ref)` as a HolderSource's ranking),
`latest()`, `plan(v)`. A hub that knows no version yet (nothing announced) answers `latest()`
with None and `sources` with VersionNotFound: receivers then read the store, a normal state.

Every call is bounded by `timeout` (connect, send and each read): a hub that does not answer
raises PeerUnavailable naming its address; a refused token raises AuthError; the hub's other
errors come back as the same weighthub error classes (VersionNotFound, VersionError, …).
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .. import catalog, errors
from ..errors import LimitError, NetError, PeerUnavailable, UsageError, VersionNotFound, WeighthubError
from ..format import chunk_checksum, decode_manifest
from ..format.manifest import MAX_MANIFEST_BYTES
from ..net.auth import AUTH_HEADER, body_digest, sign
from ..sources import ChunkId
from ..store.base import Store
from .plan import RelayTree
from .topology import Labels

log = logging.getLogger(__name__)

MAX_REPLY = 16 << 20
# error classes the hub may name in a reply; anything else becomes a NetError
_KNOWN = {name: getattr(errors, name) for name in (
    "AuthError", "UsageError", "FormatError", "LimitError", "VersionError", "VersionNotFound",
    "ModelMismatch", "PeerUnavailable")}


@dataclass(frozen=True, slots=True)
class Source:
    """One ranked source: a holder's chunk server, or the store (tier "store", address its URL)."""

    id: str
    address: str
    tier: str
    load: int


@dataclass(frozen=True, slots=True)
class Plan:
    """A refit's relay plan and the chunk-server address of each of its nodes the hub knows."""

    version: int
    tree: RelayTree
    addresses: dict[str, str]


class HubClient:
    """See the module docstring.

    Args:
        address: the hub, "host:port" (as `weighthub serve hub` prints it) or "http://host:port".
        secret: the shared secret (`auth.load_secret`).
        timeout: seconds per call.
        labels: where this client runs (ranks `sources` for it; also registered by `register`).
    """

    def __init__(self, address: str, secret: bytes, *, timeout: float = 5.0,
                 labels: Labels | None = None):
        try:  # urlsplit and .port raise ValueError on "[::1" or a port like "²" or 99999999
            parsed = urllib.parse.urlsplit(address if "://" in address else f"http://{address}")
            port = parsed.port
        except ValueError:
            port = None
        if port is None or parsed.scheme != "http" or not parsed.hostname:
            raise UsageError(f"hub address {address!r} must be host:port (as `weighthub serve hub` prints)")
        if not timeout > 0:
            raise UsageError(f"hub timeout must be > 0 seconds, got {timeout}")
        self.address = f"{parsed.hostname}:{port}"
        self._host, self._port = parsed.hostname, port
        self._secret = secret
        self.timeout = timeout
        self.labels = labels or Labels()
        self._me: dict[str, Any] | None = None  # the registration the heartbeat repeats
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._down_until = 0.0  # peer_sources skips a hub that just failed (see there)
        self.lease_ttl: float | None = None
        self.last_error: WeighthubError | None = None
        self.on_release: Callable[[list[int]], None] | None = None
        self.on_beat: Callable[[], None] | None = None  # after each heartbeat the hub answered

    # -- transport ---------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body, sort_keys=True).encode() if body is not None else b""
        token = sign(self._secret, method, path, body_digest(data) if data else "")
        headers = {AUTH_HEADER: token, "Content-Type": "application/json"}
        conn = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)
        try:
            conn.request(method, path, body=data or None, headers=headers)
            resp = conn.getresponse()
            raw = resp.read(MAX_REPLY + 1)
        except (OSError, http.client.HTTPException) as exc:
            raise PeerUnavailable(f"hub {self.address} did not answer {method} {path} within "
                                  f"{self.timeout:g}s ({exc or type(exc).__name__}); is `weighthub "
                                  "serve hub` running there?") from exc
        finally:
            conn.close()
        if len(raw) > MAX_REPLY:
            raise LimitError(f"hub {self.address}: reply to {method} {path} is over {MAX_REPLY} bytes")
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise NetError(f"hub {self.address}: {method} {path} answered HTTP {resp.status} with "
                           f"non-JSON ({raw[:80]!r}); is that address a weighthub hub?") from exc
        if resp.status != 200:
            cls = _KNOWN.get(str(doc.get("error")) if isinstance(doc, dict) else "", NetError)
            message = doc.get("message") if isinstance(doc, dict) else doc
            raise cls(f"hub {self.address}: {message}")
        return doc

    # -- holders -----------------------------------------------------------------------------
    def register(self, holder_id: str, address: str, *, versions: Iterable[int] = (), load: int = 0,
                 subscribe: bool = False, dense: bool = False,
                 serving: Iterable[int] = ()) -> dict[str, Any]:
        """Register this node as a holder (its chunk server at `address`) with a fresh lease.

        `versions`: those whose chunks it serves. `dense`: its chunk server serves dense reads
        (the bits of the version it holds) to joining nodes; `serving`: the versions it can
        serve them of now (committed, server up, not being replaced; `set_serving` keeps it
        current). The hub lists a holder to a join of v only while v is in `serving`.

        Returns the hub's reply: {lease_ttl, latest, release: [held versions the hub released]}.
        """
        with self._lock:
            self._me = {"id": holder_id, "address": address, "labels": self.labels.to_dict(),
                        "versions": sorted(set(versions)), "load": load, "subscribe": subscribe,
                        "dense": dense, "serving": sorted(set(serving))}
        return self.heartbeat()

    def set_versions(self, versions: Iterable[int]) -> None:
        with self._lock:
            self._registered()["versions"] = sorted(set(versions))

    def set_serving(self, versions: Iterable[int]) -> None:
        """The versions whose dense bits it serves now (said by the next heartbeat)."""
        with self._lock:
            self._registered()["serving"] = sorted(set(versions))

    def set_load(self, load: int) -> None:
        with self._lock:
            self._registered()["load"] = load

    def _registered(self) -> dict[str, Any]:
        if self._me is None:
            raise UsageError("register() this node with the hub first")
        return self._me

    def heartbeat(self) -> dict[str, Any]:
        """Renew the lease now (re-registers after a hub restart: the call is an upsert)."""
        with self._lock:
            me = dict(self._registered())
        reply = self._call("PUT", "/v1/holders", me)
        self.lease_ttl = float(reply["lease_ttl"])
        if reply.get("release") and self.on_release is not None:
            self.on_release(list(reply["release"]))
        return reply

    def start_heartbeat(self, interval: float | None = None) -> None:
        """Heartbeat from a daemon thread every `interval` (default: a third of the lease TTL)."""
        if self._thread is not None:
            return
        self._registered()
        period = interval or (self.lease_ttl or 3.0) / 3

        def beat() -> None:
            while not self._stop.wait(period):
                try:
                    self.heartbeat()
                    self.last_error = None
                except WeighthubError as exc:  # keep beating: the hub may be restarting
                    if self.last_error is None:
                        log.warning("hub heartbeat failed (%s); retrying every %.1fs", exc, period)
                    self.last_error = exc
                    continue
                if self.on_beat is not None:
                    try:
                        self.on_beat()
                    except Exception:  # its own failure must not end the heartbeat
                        log.exception("hub %s: the after-heartbeat hook failed", self.address)
        self._stop.clear()
        self._thread = threading.Thread(target=beat, name=f"hub-heartbeat-{self.address}", daemon=True)
        self._thread.start()

    def stop(self, *, leave: bool = True) -> None:
        """Stop the heartbeat thread and (by default) leave the hub; never raises for a dead hub."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout + 1)
            self._thread = None
        if leave and self._me is not None:
            try:
                self._call("POST", "/v1/holders/leave", {"id": self._me["id"]})
            except NetError as exc:
                log.warning("could not leave hub %s (%s); the lease will expire", self.address, exc)

    # -- versions ------------------------------------------------------------------------------
    def announce(self, version: int, *, manifest_key: str, store_url: str, model_id: str, root: str,
                 publisher: str | None = None, manifest_sha256: str | None = None) -> list[int]:
        """Tell the hub `version` is committed. Returns the versions it released for retention.

        `manifest_sha256` (of the manifest's bytes) lets nodes trust the manifest when a peer
        relays it to them instead of their reading it from the store.
        """
        doc = {"version": version, "manifest_key": manifest_key, "store_url": store_url,
               "model_id": model_id, "root": root, "publisher": publisher,
               "manifest_sha256": manifest_sha256}
        return list(self._call("POST", "/v1/versions", doc)["released"])

    def announce_committed(self, store: Store, version: int, *, publisher: str | None = None,
                           manifest: bytes | None = None) -> list[int]:
        """`announce` a version committed in `store`, with what nodes check it by.

        Sends the primary manifest's key, the model id and root digest from it, and the SHA-256
        of its bytes (`manifest`: those bytes, if the caller still has them; else read here).

        Returns:
            The versions the hub released for retention.
        Raises:
            What `announce` raises; the store's errors reading the manifest (ObjectNotFound:
            `version` is not committed there); FormatError for a manifest that does not parse.
        """
        key = catalog.rep_key(version, None, primary=True)
        raw = store.get(key, max_bytes=MAX_MANIFEST_BYTES) if manifest is None else manifest
        m = decode_manifest(raw, where=f"{store.url}/{key}")
        return self.announce(version, manifest_key=key, store_url=store.url, model_id=m.model,
                             root=m.root, publisher=publisher, manifest_sha256=chunk_checksum(raw))

    def latest(self) -> int | None:
        return self._call("GET", "/v1/latest")["latest"]

    def latest_record(self) -> dict[str, Any] | None:
        """The latest committed version's record (version, manifest_key, manifest_sha256, ...)."""
        record = self._call("GET", "/v1/latest")["record"]
        return dict(record) if isinstance(record, dict) else None

    def versions(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/v1/versions")["versions"])

    def holders(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/v1/holders")["holders"])

    def release(self, version: int) -> list[int]:
        return list(self._call("POST", "/v1/release", {"version": version})["released"])

    # -- sources -------------------------------------------------------------------------------
    def source_details(self, key: str, version: int, *, dense: bool = False) -> list[Source]:
        """Ranked sources of `key` of `version` for this client: holders, then the store.

        `dense`: only holders that serve dense reads (for an elastic join).
        """
        query: dict[str, Any] = {"version": version, "key": key, **self.labels.to_dict()}
        if dense:
            query["dense"] = 1
        if self._me is not None:
            query["asker"] = self._me["id"]
        reply = self._call("GET", "/v1/sources?" + urllib.parse.urlencode(query))
        return [Source(s["id"], s["address"], s["tier"], s["load"]) for s in reply["sources"]]

    def sources(self, key: str, version: int, *, dense: bool = False) -> list[str]:
        """Ranked chunk-server addresses ("host:port") holding `version`, nearest and least loaded first.

        The store is not listed: it is a receiver's last source anyway. `dense`: only
        holders that serve dense reads.
        """
        return [s.address for s in self.source_details(key, version, dense=dense) if s.tier != "store"]

    def peer_sources(self, ref: ChunkId) -> list[str]:
        """`sources` of a chunk for a HolderSource: never raises, never stalls every chunk.

        A hub that fails is skipped for the next `timeout` seconds (the receiver uses the store),
        so a dead hub costs one timeout per period, not one per chunk.
        """
        if time.monotonic() < self._down_until:
            return []
        try:
            return self.sources(ref.key, ref.version)
        except VersionNotFound:
            # a normal state, not a failure: the hub knows no such version (it was published
            # without announcing it, or released), so it knows no holders; the store has it
            return []
        except WeighthubError as exc:
            if isinstance(exc, PeerUnavailable):
                self._down_until = time.monotonic() + self.timeout
            log.warning("hub sources for %s failed (%s); using the store", ref.key, exc)
            return []

    # -- relay plans ---------------------------------------------------------------------------
    def plan(self, version: int, *, publisher: str | None = None, degree: int | None = None) -> Plan:
        """The relay plan for `version`; the publisher (`publisher=` its holder id) creates it."""
        doc: dict[str, Any] = {"version": version, "publisher": publisher}
        if degree is not None:
            doc["degree"] = degree
        if publisher is None:
            return self._plan(self._call("GET", f"/v1/plans/{int(version)}"))
        return self._plan(self._call("POST", "/v1/plans", doc))

    def report_failed(self, version: int, failed: Iterable[str]) -> Plan:
        """Report dead relay nodes; returns the replanned tree (idempotent)."""
        return self._plan(self._call("POST", f"/v1/plans/{int(version)}/failed", {"failed": sorted(failed)}))

    @staticmethod
    def _plan(doc: dict[str, Any]) -> Plan:
        return Plan(int(doc["version"]), RelayTree.from_dict(doc["tree"]), dict(doc["addresses"]))
