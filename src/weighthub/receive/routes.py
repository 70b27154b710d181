"""The route's manifests and what binds each step to the state it applies to.

`catalog.plan` picks the cheapest route of representations from what the target holds; this
module reads their manifests from the store (the authority), finds for each inverse step the
manifest of the version it arrives at, finds the held version's digests for incremental
verification, and states the base binding every step must meet at apply time (invariant 4).
"""

from __future__ import annotations

from .. import catalog
from ..digest import root_digest
from ..digest.words import digest_words
from ..errors import BaseMismatch, FormatError, ObjectNotFound, UsageError, VersionNotFound
from ..format import Manifest
from ..store import Store
from ..targets.base import Held, Target
from ..tensors import check_same_model, words_numel
from .inputs import Step
from .verify import modified_outside


def read_route(store: Store, route: list[catalog.Rep]) -> list[tuple[Manifest, Manifest]]:
    """(manifest, the manifest of the version the step arrives at) for every step of `route`."""
    manifests = [r.manifest or catalog.read_manifest(store, r.key) for r in route]
    return [(m, expected_base(store, manifests, i) if r.inverse else m)
            for i, (r, m) in enumerate(zip(route, manifests, strict=True))]


def expected_base(store: Store, manifests: list[Manifest], i: int) -> Manifest:
    """The manifest of the version inverse step i arrives at (its delta's base).

    Any representation of a version records that version's digests and root: the next
    inverse step's delta usually is one; otherwise the base's primary manifest. It must
    have the root the delta names as its base, and the same tensor table.
    """
    m = manifests[i]
    base = m.base
    if base is None:  # catalog.plan never routes so
        raise UsageError(f"{store.url}: a full representation of version {m.version} "
                         "cannot be applied inversely")
    found = next((o for o in manifests if o.version == base), None)
    if found is None:
        found = catalog.primary_manifest(store, base)
    where = f"version {base} in {store.url}"
    if found.root != m.base_root:
        raise BaseMismatch(f"{where} has root {found.root[:12]}…, but delta {m.version} names "
                           f"its base's root {(m.base_root or '')[:12]}…: the store's history "
                           "is inconsistent; nothing applied")
    check_same_model(m.specs(), found.specs(), where)
    return found


def held_digests(store: Store, target: Target, held: Held, first: Manifest,
                 committed: tuple[str, dict[str, bytes]] | None) -> dict[str, bytes]:
    """Tensor digests of the version the target holds, for incremental verification.

    Runs before the pause. From the receiver's last commit (`committed`: root, digests); else
    the held version's manifest, bound to the held root; else (deleted by retention, or a
    target from another process) the digest of the held bits, read while the target still
    serves: refused unless they make the held root.
    """
    if committed is not None and committed[0] == held.root:
        return committed[1]
    specs = first.specs()
    try:
        m = catalog.primary_manifest(store, held.version)
        if m.root == held.root:
            return {e.name: bytes.fromhex(e.digest) for e in m.tensors}
    except (ObjectNotFound, VersionNotFound, FormatError):
        pass  # deleted by retention, or unreadable: read the held bits instead
    peek = target.peek()
    digests = {s.name: digest_words(peek[s.name]) for s in specs
               if s.name in peek and words_numel(peek[s.name]) == s.numel}
    if len(digests) == len(specs):
        got = root_digest((s, digests[s.name]) for s in specs).hex()
        if got != held.root:
            raise modified_outside(got, held.root)
    return digests


def check_binding(step: Step, state_root: str | None) -> None:
    """Refuse a step the state it would apply to does not bind (nothing of it touched).

    A forward delta needs its base's root; a delta applied inversely needs its own version's
    root. A full representation binds to nothing: it rewrites everything it covers.
    """
    m = step.manifest
    if step.inverse and m.root != state_root:
        raise BaseMismatch(f"delta {m.version} applied inversely needs version "
                           f"{m.version} ({m.root[:12]}…) but the target holds "
                           f"{(state_root or 'nothing')[:12]}…; refusing to apply")
    if not step.inverse and m.base is not None and m.base_root != state_root:
        raise BaseMismatch(f"delta {m.version} has base {m.base} "
                           f"({(m.base_root or '')[:12]}…) but the target holds "
                           f"{(state_root or 'nothing')[:12]}…; refusing to apply")
