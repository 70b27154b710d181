"""Where versions live in a store, how to read them, and how to get from one to another.

Layout (keys relative to the store root; v and b zero-padded to 12 digits):

    v{v}/manifest.json          the primary representation; its create-only write commits v
    v{v}/full.json              an anchor: a full representation of v (written after commit)
    v{v}/from-{b}.json          a skip delta b → v (written after commit)
    v{v}/{rep}-{token}/c{i}.whc the chunks of one representation; `token` is unique per publish,
                                so racing publishers never overwrite each other's chunks

A version without manifest.json does not exist, whatever else is under v{v}/.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass

from .errors import FormatError, NoSyncPath, ObjectNotFound, VersionNotFound
from .format import Manifest, decode_manifest
from .store import Store

PRIMARY = "manifest.json"
FULL = "full.json"
_VERSION_DIR = re.compile(r"^v(\d{12})$")
_REP = re.compile(r"^(manifest|full|from-(\d{12}))\.json$")


def version_dir(v: int) -> str:
    return f"v{v:012d}"


def rep_name(base: int | None) -> str:
    return "full" if base is None else f"from-{base:012d}"


def rep_key(v: int, base: int | None, *, primary: bool) -> str:
    leaf = PRIMARY if primary else (FULL if base is None else f"from-{base:012d}.json")
    return f"{version_dir(v)}/{leaf}"


def list_versions(store: Store) -> list[int]:
    """Committed versions, ascending."""
    out = []
    for name in store.children(""):
        m = _VERSION_DIR.match(name)
        if m and PRIMARY in store.children(name):
            out.append(int(m.group(1)))
    return sorted(out)


def latest_version(store: Store) -> int | None:
    versions = list_versions(store)
    return versions[-1] if versions else None


def read_manifest(store: Store, key: str) -> Manifest:
    try:
        raw = store.get(key)
    except ObjectNotFound:
        raise
    return decode_manifest(raw, where=f"{store.url}/{key}")


def primary_manifest(store: Store, v: int) -> Manifest:
    try:
        return read_manifest(store, rep_key(v, None, primary=True))
    except ObjectNotFound:
        raise VersionNotFound(f"version {v} is not committed in {store.url}") from None


@dataclass(frozen=True, slots=True)
class Rep:
    """One representation of a version: the manifest key and what it needs as a start."""

    version: int
    base: int | None
    key: str
    payload_bytes: int


def representations(store: Store, v: int) -> list[Rep]:
    reps = []
    for leaf in store.children(version_dir(v)):
        if not _REP.match(leaf):
            continue
        key = f"{version_dir(v)}/{leaf}"
        try:
            m = read_manifest(store, key)
        except (ObjectNotFound, FormatError):
            if leaf == PRIMARY:
                raise  # the commit record itself is damaged: say so, do not route around it
            continue  # a damaged optional representation just is not a route
        if m.version != v:
            continue
        reps.append(Rep(v, m.base, key, m.payload_bytes))
    return reps


def plan(store: Store, start: int | None, target: int) -> list[Rep]:
    """Cheapest sequence of representations (by payload bytes) from `start` to `target`.

    start None means the receiver holds nothing (only full representations can begin a path).
    Routes may use delta chains, skip deltas and anchors (full representations), mixed.
    """
    versions = [v for v in list_versions(store) if v <= target]
    if target not in versions:
        raise VersionNotFound(f"version {target} is not committed in {store.url} "
                              f"(have {versions[-5:] if versions else 'none'})")
    # a full representation starts a route from anywhere (also backwards, to an older version);
    # a delta only from its own base, so only versions after `start` matter for those
    lo = start if start is not None and start < target else -1
    reps_to: dict[int, list[Rep]] = {v: representations(store, v) for v in versions if v > lo}
    # Dijkstra over versions; node -1 stands for "nothing held"
    origin = start if start is not None else -1
    best: dict[int, tuple[int, list[Rep]]] = {origin: (0, [])}
    heap = [(0, origin)]
    while heap:
        cost, node = heapq.heappop(heap)
        if node == target:
            return best[node][1]
        if cost > best[node][0]:
            continue
        for v, reps in reps_to.items():
            for r in reps:
                if r.base is None or r.base == node:
                    c = cost + r.payload_bytes
                    if v not in best or c < best[v][0]:
                        best[v] = (c, best[node][1] + [r])
                        heapq.heappush(heap, (c, v))
    held = "nothing" if start is None else f"version {start}"
    raise NoSyncPath(f"no retained chain in {store.url} leads from {held} to version {target}; "
                     "pull without an existing target to materialize it from an anchor")
