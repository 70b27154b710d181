"""The hub's durable state in SQLite: committed versions, releases, holders and relay plans.

A `HubDB` is used from one thread at a time (the hub runs every call on its single DB thread,
so the event loop never blocks on disk). WAL journal with synchronous=FULL: a version the hub
acknowledged survives kill -9 and power loss. Leases are not stored: they restart from the hub's
start time, so a holder that died while the hub was down is offered for one TTL at most.
Nor is what a holder *serves* now (the versions whose dense bits it can hand a joiner, apart
from the versions it registered as holding chunks of): it is as volatile as the lease, lives
beside it in the hub's memory (`hubcore`), and a restarted hub offers no holder to joiners
until its next heartbeat says what it serves.

Schema (version 2; a version-1 database is upgraded in place when opened):
    versions(version PK, manifest_key, store_url, model_id, root, publisher, committed_at, released_at,
             manifest_sha256)
    holders(id PK, address, region, zone, host, versions JSON, subscribed, dense)
    plans(version PK, tree JSON)

`manifest_sha256` (NULL when the publisher did not send it) is what lets a node trust a
manifest relayed to it by a peer: it must hash to the digest the hub recorded at the commit.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .topology import Labels

SCHEMA_VERSION = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS versions (
    version INTEGER PRIMARY KEY, manifest_key TEXT NOT NULL, store_url TEXT NOT NULL,
    model_id TEXT NOT NULL, root TEXT NOT NULL, publisher TEXT, committed_at REAL NOT NULL,
    released_at REAL, manifest_sha256 TEXT);
CREATE TABLE IF NOT EXISTS holders (
    id TEXT PRIMARY KEY, address TEXT NOT NULL, region TEXT NOT NULL, zone TEXT NOT NULL,
    host TEXT NOT NULL, versions TEXT NOT NULL, subscribed INTEGER NOT NULL,
    dense INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS plans (version INTEGER PRIMARY KEY, tree TEXT NOT NULL);
"""
# schema 1 -> 2: both new columns are optional facts (unknown digest, no dense reads declared)
_UPGRADE_1 = """
ALTER TABLE versions ADD COLUMN manifest_sha256 TEXT;
ALTER TABLE holders ADD COLUMN dense INTEGER NOT NULL DEFAULT 0;
"""


@dataclass(frozen=True, slots=True)
class VersionRecord:
    """A committed version as announced by its publisher (`released_at` None while retained)."""

    version: int
    manifest_key: str
    store_url: str
    model_id: str
    root: str
    publisher: str | None
    committed_at: float
    released_at: float | None = None
    manifest_sha256: str | None = None  # SHA-256 hex of the manifest's bytes (trust for relays)

    def same_commit(self, other: VersionRecord) -> bool:
        """Whether `other` announces the same commit (a retried announce is not a conflict)."""
        return (self.manifest_key, self.store_url, self.model_id, self.root) == \
            (other.manifest_key, other.store_url, other.model_id, other.root)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "manifest_key": self.manifest_key, "store_url": self.store_url,
                "model_id": self.model_id, "root": self.root, "publisher": self.publisher,
                "committed_at": self.committed_at, "released": self.released_at is not None,
                "manifest_sha256": self.manifest_sha256}


@dataclass(frozen=True, slots=True)
class HolderRecord:
    """What a holder registered: where its chunk server listens, where it runs, what it holds."""

    id: str
    address: str
    labels: Labels
    versions: tuple[int, ...]
    subscribed: bool
    dense: bool = False  # its chunk server serves dense reads (elastic joins ask only those)


class HubDB:
    """SQLite persistence for the hub. Not thread-safe: call from one thread (see module doc)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            elif row[0] == "1":
                self._db.executescript(f"BEGIN IMMEDIATE; {_UPGRADE_1} UPDATE meta "
                                       f"SET value='{SCHEMA_VERSION}' WHERE key='schema'; COMMIT;")
            elif row[0] != str(SCHEMA_VERSION):
                raise UsageError(f"hub database {self.path} has schema {row[0]}; this build reads "
                                 f"{SCHEMA_VERSION} (use a new --db path)")
        except sqlite3.Error as exc:
            raise UsageError(f"hub database {self.path} cannot be opened ({exc}); check the path, "
                             "its permissions, or that it is a weighthub hub database") from exc

    def close(self) -> None:
        self._db.close()

    # -- reads (at start) ------------------------------------------------------------------
    def load_versions(self) -> list[VersionRecord]:
        rows = self._db.execute("SELECT version, manifest_key, store_url, model_id, root, publisher, "
                                "committed_at, released_at, manifest_sha256 FROM versions "
                                "ORDER BY version").fetchall()
        return [VersionRecord(*r) for r in rows]

    def load_holders(self) -> list[HolderRecord]:
        rows = self._db.execute("SELECT id, address, region, zone, host, versions, subscribed, dense "
                                "FROM holders ORDER BY id").fetchall()
        return [HolderRecord(i, a, Labels(r, z, h), tuple(json.loads(v)), bool(s), bool(d))
                for i, a, r, z, h, v, s, d in rows]

    def load_plans(self) -> dict[int, Any]:
        return {v: json.loads(t) for v, t in self._db.execute("SELECT version, tree FROM plans")}

    # -- writes (each one transaction) ---------------------------------------------------------
    def commit_version(self, rec: VersionRecord, release: list[int], at: float) -> None:
        """Insert a committed version and release older ones (retention), atomically."""
        with self._tx():
            self._db.execute("INSERT INTO versions VALUES (?, ?, ?, ?, ?, ?, ?, NULL, ?)",
                             (rec.version, rec.manifest_key, rec.store_url, rec.model_id, rec.root,
                              rec.publisher, rec.committed_at, rec.manifest_sha256))
            self._release(release, at)

    def release(self, versions: list[int], at: float) -> None:
        with self._tx():
            self._release(versions, at)

    def _release(self, versions: list[int], at: float) -> None:
        self._db.executemany("UPDATE versions SET released_at=? WHERE version=? AND released_at IS NULL",
                             [(at, v) for v in versions])
        self._db.executemany("DELETE FROM plans WHERE version=?", [(v,) for v in versions])

    def put_holder(self, h: HolderRecord) -> None:
        with self._tx():
            self._db.execute("INSERT OR REPLACE INTO holders VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                             (h.id, h.address, h.labels.region, h.labels.zone, h.labels.host,
                              json.dumps(list(h.versions)), int(h.subscribed), int(h.dense)))

    def delete_holders(self, ids: list[str]) -> None:
        with self._tx():
            self._db.executemany("DELETE FROM holders WHERE id=?", [(i,) for i in ids])

    def put_plan(self, version: int, tree: dict[str, Any]) -> None:
        with self._tx():
            self._db.execute("INSERT OR REPLACE INTO plans VALUES (?, ?)",
                             (version, json.dumps(tree, sort_keys=True)))

    def _tx(self) -> _Transaction:
        return _Transaction(self._db)


class _Transaction:
    """BEGIN IMMEDIATE … COMMIT, or ROLLBACK on any error (no partial state left behind)."""

    def __init__(self, db: sqlite3.Connection):
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")
