"""Step 3 of a publish: the manifest and its create-only write (the commit); retention.

Every rank assembles the same manifest from what every rank wrote (chunk refs in rank then
chunk order, change counts, ops, digest contributions summed per tensor); the committer puts it
create-only, which is the commit, and broadcasts the outcome, so every rank knows whether the
version exists. An extra representation of a committed version (anchor, skip delta) carries
that version's digests and root.
"""

from __future__ import annotations

import contextlib
import time

import xxhash

from .. import catalog
from ..digest import ZERO_DIGEST, add_digests, root_digest
from ..errors import ObjectExists, PeerUnavailable, WeighthubError
from ..format import Manifest, TensorEntry, encode_manifest
from ..format.manifest import KIND, MANIFEST_FORMAT
from ..store import Store
from ..tensors import TensorSpec
from .agree import Plan
from .group import Group, error_class
from .stream import Written


def model_id(specs: list[TensorSpec]) -> str:
    """Identity of a model's tensor table (names, dtypes, shapes)."""
    h = xxhash.xxh3_128()
    for s in specs:
        h.update(f"{s.name}\0{s.dtype.name}\0{list(s.shape)}\n".encode())
    return h.hexdigest()


def assemble(plan: Plan, written: list[Written], base: tuple[int, str] | None, publisher: str,
             known: Manifest | None = None) -> Manifest:
    """The manifest of one representation of `plan.version`, delta from `base` (None: full).

    The tensor digests are the sum of every rank's contributions, or `known`'s (the committed
    primary manifest) for an extra representation.
    """
    if known is not None:
        digests, root = digests_of(known), known.root
    else:
        digests = {s.name: ZERO_DIGEST for s in plan.specs}
        add_digests(digests, [pair for w in written for pair in w.digests.items()])
        root = root_digest((s, digests[s.name]) for s in plan.specs).hex()
    changed = {s.name: sum(w.changed.get(s.name, 0) for w in written) for s in plan.specs}
    tensors = [TensorEntry(s.name, s.dtype.name, list(s.shape), digests[s.name].hex(),
                           changed[s.name], sorted(set().union(*(w.ops.get(s.name, set())
                                                                 for w in written))))
               for s in plan.specs]
    refs = [r for w in written for r in w.refs]
    return Manifest(
        format=MANIFEST_FORMAT, kind=KIND, model=model_id(plan.specs), version=plan.version,
        base=None if base is None else base[0], base_root=None if base is None else base[1],
        root=root, tensors=tensors, chunks=refs,
        dense_bytes=sum(s.nbytes for s in plan.specs), payload_bytes=sum(r.size for r in refs),
        changed=sum(changed.values()), publisher=publisher, created=time.time())


def commit(store: Store, group: Group, committer: int, manifest: Manifest, *, token: str,
           lost_race: str) -> None:
    """Put the primary manifest create-only (on the committer) and tell every rank the outcome.

    Args:
        token: this publish's token, which the committer's manifest ends its publisher with
            in a group (how a rank that lost the group mid-commit tells whether it stands).
        lost_race: what to do when another publisher committed the version first (the advice
            that ends the ObjectExists message).

    Raises:
        ObjectExists: another publisher committed this version first.
        PeerUnavailable: the group failed before the outcome was heard, and the version is not
            in the store (if it is, the commit stands and nothing is raised).
        the committer's store error, on every rank (as its class in weighthub.errors).
    """
    version = manifest.version
    outcome = ("ok", "")
    error: Exception | None = None
    if group.rank == committer:
        try:
            store.put(catalog.rep_key(version, manifest.base, primary=True),
                      encode_manifest(manifest), create_only=True)
        except ObjectExists:
            outcome = ("ObjectExists", f"version {version} was committed by another publisher "
                       f"in {store.url}; this publish was discarded ({lost_race})")
        except Exception as exc:  # every rank must still hear the outcome
            error, outcome = exc, (type(exc).__name__, f"committing version {version} failed "
                                   f"on the committer: {exc}")
    try:
        kind, message = group.broadcast(outcome, committer, f"committing version {version}")
    except PeerUnavailable as exc:
        # outcome unknown: the committer may have written the manifest before it went away
        if not _in_store(store, version, token):
            raise PeerUnavailable(f"{exc}; version {version} is not committed") from exc
        kind, message = "ok", ""
    if error is not None:
        raise error
    if kind == "ObjectExists":
        raise ObjectExists(message)
    if kind != "ok":
        raise error_class(kind)(message)


def put_extra(store: Store, manifest: Manifest) -> None:
    """Write the manifest of an extra representation (anchor, skip delta), create-only."""
    store.put(catalog.rep_key(manifest.version, manifest.base, primary=False),
              encode_manifest(manifest), create_only=True)


def _in_store(store: Store, version: int, token: str) -> bool:
    """After a failed outcome broadcast: did the committer's manifest make it to the store?"""
    try:
        stored = catalog.primary_manifest(store, version)
    except WeighthubError:
        return False
    return stored.publisher.endswith(f"/{token}")


def delete_keys(store: Store, keys: list[str]) -> None:
    """Best effort: chunks without a manifest are garbage, never part of a version."""
    for key in keys:
        with contextlib.suppress(WeighthubError):
            store.delete(key)


def collect_garbage(store: Store, version: int, retain: int) -> None:
    """Delete versions older than the `retain` newest (0: keep all), keeping the newest anchor.

    Called by the committer after it committed `version`.
    """
    if not retain:
        return
    versions = catalog.list_versions(store)
    keep_from = version - retain + 1
    # a newcomer starts from the newest anchor and chains forward: keep it and what follows
    anchors = [v for v in versions if any(
        r.base is None for r in catalog.representations(store, v))]
    floor = min(keep_from, anchors[-1]) if anchors else keep_from
    for v in versions:
        if v < floor:
            catalog.delete_version(store, v)


def digests_of(manifest: Manifest) -> dict[str, bytes]:
    """The tensor digests a manifest records, by name."""
    return {t.name: bytes.fromhex(t.digest) for t in manifest.tensors}
