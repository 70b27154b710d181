"""Where versions live in a store, how to read them, and how to get from one to another.

Layout (keys relative to the store root; v and b zero-padded to 12 digits):

    v{v}/manifest.json          the primary representation; its create-only write commits v
    v{v}/full.json              an anchor: a full representation of v (written after commit)
    v{v}/from-{b}.json          a skip delta b → v (written after commit)
    v{v}/{rep}-{token}/c{i}.whc the chunks of one representation; `token` is unique per publish,
                                so racing publishers never overwrite each other's chunks

A version without manifest.json does not exist, whatever else is under v{v}/.

Routes run forward (a full representation, then deltas from their bases) and, to roll back,
backward: a delta from b to v whose segments are all invertible, applied inversely, takes v back
to b (`invertible`). The planner takes whichever is fewer bytes.
"""

from __future__ import annotations

import heapq
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from .codec import coding_invertible
from .errors import FormatError, NoSyncPath, ObjectNotFound, VersionNotFound
from .format import Manifest, decode_manifest
from .format.manifest import MAX_MANIFEST_BYTES
from .store import Store

PRIMARY = "manifest.json"
CHUNK_SUFFIX = ".whc"  # chunk objects: a relay streams them, manifests it does not
FULL = "full.json"
_VERSION_DIR = re.compile(r"^v(\d{12})$")
_REP = re.compile(r"^(manifest|full|from-(\d{12}))\.json$")


def version_dir(v: int) -> str:
    return f"v{v:012d}"


def delete_version(store: Store, v: int) -> None:
    """Delete everything under version v's directory, its manifest first: once the manifest
    is gone the version no longer exists, whatever a failure leaves behind."""
    _delete_tree(store, version_dir(v))


def _delete_tree(store: Store, prefix: str) -> None:
    names = store.children(prefix)
    if PRIMARY in names:
        store.delete(f"{prefix}/{PRIMARY}")
    for name in names:
        key = f"{prefix}/{name}"
        if store.children(key):
            _delete_tree(store, key)
        elif name != PRIMARY:
            store.delete(key)


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
    """The newest committed version: the store's root listed once, then version directories
    from the newest down until one holds a manifest (usually the first), not all of them."""
    for name in sorted(store.children(""), reverse=True):  # zero-padded: sorts as numbers
        if _VERSION_DIR.match(name) and PRIMARY in store.children(name):
            return int(name[1:])
    return None


def read_manifest(store: Store, key: str) -> Manifest:
    """The manifest at `key`, read no further than the manifest size limit (a hostile store's
    endless or multi-GB object is refused with LimitError, not read first)."""
    return decode_manifest(store.get(key, max_bytes=MAX_MANIFEST_BYTES), where=f"{store.url}/{key}")


def primary_manifest(store: Store, v: int) -> Manifest:
    try:
        return read_manifest(store, rep_key(v, None, primary=True))
    except ObjectNotFound:
        raise VersionNotFound(f"version {v} is not committed in {store.url}") from None


INVERSE = " (inverse)"  # how a route reports a delta applied inversely: its key + this


def invertible(m: Manifest) -> bool:
    """Can this delta be applied inversely, taking version m.version back to m.base?

    Only if every segment is xor or add with positions coded independently of the base's bits
    (codec.invertible), which the manifest tells per tensor in `ops`. A tensor that changed but
    lists no ops (a writer that did not record them) makes the delta not invertible; one that
    neither changed nor lists ops has no segments. The receiver still checks every segment of
    an inverse step while staging, so a manifest that misstates its ops is refused, not applied.
    """
    if m.base is None:
        return False
    for t in m.tensors:
        if not t.ops and t.changed:
            return False
        if not all(coding_invertible(name) for name in t.ops):
            return False
    return True


@dataclass(frozen=True, slots=True)
class Rep:
    """One representation of a version: the manifest key and what it needs as a start.

    On a route, `inverse` marks a delta applied inversely: that step starts at `version`
    and ends at `base`.
    """

    version: int
    base: int | None
    key: str
    payload_bytes: int
    invertible: bool = False  # a delta that can be applied inversely (see `invertible`)
    inverse: bool = False
    # the manifest as the planner read it, so that staging does not read it again
    manifest: Manifest | None = field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        """The step as a sync reports it: the manifest key, marked when applied inversely."""
        return self.key + INVERSE if self.inverse else self.key


def representations(store: Store, v: int, leaves: list[str] | None = None) -> list[Rep]:
    """Version v's representations (`leaves`: its directory's listing, if already read)."""
    reps = []
    for leaf in store.children(version_dir(v)) if leaves is None else leaves:
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
        reps.append(Rep(v, m.base, key, m.payload_bytes, invertible(m), manifest=m))
    return reps


# A forward route at most this many versions long is planned from those versions' directories
# alone: one listing each, not one per version in the store (a refit's plan must not grow with
# the run's length: on an S3 store behind a link each listing is a round trip).
PROBE_AHEAD = 8


def plan(store: Store, start: int | None, target: int) -> list[Rep]:
    """Cheapest sequence of representations (by payload bytes) from `start` to `target`.

    start None means the receiver holds nothing (only full representations can begin a path).
    Routes may use delta chains, skip deltas and anchors (full representations), mixed; and, to
    go back to an older version, invertible deltas applied inversely (marked `inverse`; each
    takes its version back to its base, which must be committed: the receiver checks against
    the base's manifest). At equal bytes the route with fewer inverse steps wins.
    """
    # Which versions' representations can be on a route. Forward, a delta applies only from its
    # own base, so versions in (start, target]; from nothing, [0, target]; backward, [0, start]:
    # anchors and deltas up to the target, and the deltas above it to undo.
    if start is not None and start < target:
        lo, hi = start, target
    else:
        lo, hi = -1, target if start is None else start
    reps_of, committed = _committed_reps(store, lo, hi, target)
    # (version a step leads to, the step)
    fulls: list[tuple[int, Rep]] = []  # a full representation starts a route from anywhere
    steps: dict[int, list[tuple[int, Rep]]] = {}  # from a version: deltas forward, inverse back
    for v, reps in reps_of.items():
        for r in reps:
            if r.base is None:
                fulls.append((v, r))
                continue
            steps.setdefault(r.base, []).append((v, r))
            if r.invertible and committed(r.base):
                steps.setdefault(v, []).append((r.base, replace(r, inverse=True)))
    # Dijkstra over versions; node -1 stands for "nothing held"; cost (bytes, inverse steps)
    origin = start if start is not None else -1
    best: dict[int, tuple[tuple[int, int], list[Rep]]] = {origin: ((0, 0), [])}
    heap = [((0, 0), origin)]
    while heap:
        cost, node = heapq.heappop(heap)
        if node == target:
            return best[node][1]
        if cost > best[node][0]:
            continue
        for nxt, r in itertools.chain(fulls, steps.get(node, ())):
            c = (cost[0] + r.payload_bytes, cost[1] + r.inverse)
            if nxt not in best or c < best[nxt][0]:
                best[nxt] = (c, best[node][1] + [r])
                heapq.heappush(heap, (c, nxt))
    held = "nothing" if start is None else f"version {start}"
    raise NoSyncPath(f"no retained chain in {store.url} leads from {held} to version {target}; "
                     "pull without an existing target to materialize it from an anchor")


def _committed_reps(store: Store, lo: int, hi: int, target: int
                    ) -> tuple[dict[int, list[Rep]], Callable[[int], bool]]:
    """The representations of every committed version in (lo, hi], which must include `target`,
    and a test of whether a version is committed: from those versions' directories when the
    range starts at a held version and is short, else from a listing of the whole store."""
    if lo >= 0 and hi - lo <= PROBE_AHEAD:
        found = {}
        for v in range(lo + 1, hi + 1):
            leaves = store.children(version_dir(v))
            if PRIMARY in leaves:
                found[v] = representations(store, v, leaves)
        if target not in found:
            raise VersionNotFound(f"version {target} is not committed in {store.url}")
        below: dict[int, bool] = {}

        def committed(v: int) -> bool:
            if v >= lo:  # lo: the held version; a step back to it never shortens a route
                return v == lo or v in found
            if v not in below:  # the base of an invertible skip delta: rare, looked up once
                below[v] = PRIMARY in store.children(version_dir(v))
            return below[v]
        return found, committed
    versions = list_versions(store)
    if target not in versions:
        raise VersionNotFound(f"version {target} is not committed in {store.url} "
                              f"(have {versions[-5:] if versions else 'none'})")
    return {v: representations(store, v) for v in versions if lo < v <= hi}, set(versions).__contains__
