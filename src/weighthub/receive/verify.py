"""Prove what a transaction wrote: tensor digests against the manifest, before the commit.

    incremental   held digests + the changes the apply folded (O(changed)): `check_step`
    full          every touched tensor digested again (O(touched tensors)): `check_touched`
    base          every tensor of the held version against its root (`verify_base`): `check_root`

Tensor digests are linear (format/spec.md §4), so a tensor's digest after a delta is its
digest before plus Σ mix(new) − mix(old) over the words the apply rewrote.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from ..digest import ZERO_DIGEST, add_digests, root_digest
from ..digest.words import digest_words
from ..errors import BaseMismatch, IntegrityError
from ..format import Manifest
from ..tensors import TensorSpec, Words


def check_step(views: Mapping[str, Words], alias: dict[str, str], m: Manifest,
               specs: list[TensorSpec], changes: list[tuple[int, bytes]],
               digests: dict[str, bytes] | None, *, from_nothing: bool) -> dict[str, bytes]:
    """Digests after a step (held digests + changes), checked against m's, the manifest of
    the version the step arrived at, whose tensor table is `specs` (the step's). Returns them.

    A full representation starts from nothing (`from_nothing`). Tensors without a held
    digest (none known) are digested in full; a tied name takes its first name's digest
    (the same words).
    """
    if from_nothing:
        new = {s.name: ZERO_DIGEST for s in specs}
    else:
        new = dict(digests) if digests is not None else {}
    touched = {ti for ti, _ in changes}
    missing = {ti for ti in touched if specs[ti].name not in new}
    for ti in missing:
        new[specs[ti].name] = digest_words(views[specs[ti].name])
    add_digests(new, [(specs[ti].name, c) for ti, c in changes if ti not in missing])
    check = set(touched)
    for i, s in enumerate(specs):
        if alias[s.name] != s.name:  # a tied name holds the very same words as its first
            first = alias[s.name]
            new[s.name] = new[first] if first in new else digest_words(views[first])
            check.add(i)
    bad = [specs[i].name for i in sorted(check)
           if new[specs[i].name].hex() != m.tensors[i].digest]
    if bad:
        raise IntegrityError(f"after applying version {m.version}, {len(bad)} tensor(s) differ "
                             f"from the manifest's digests: {bad[:5]}; rolled back")
    return new


def check_touched(views: Mapping[str, Words], m: Manifest, touched: set[int]) -> None:
    """Digests of every tensor the transaction changed must equal the manifest's (full pass).

    Untouched tensors still hold bits that were verified when their version committed.
    """
    entries = [m.tensors[i] for i in sorted(touched)]
    digests = digests_hex(views, [e.name for e in entries])
    bad = [e.name for e in entries if digests[e.name] != e.digest]
    if bad:
        raise IntegrityError(f"after applying version {m.version}, {len(bad)} tensor(s) differ "
                             f"from the manifest's digests: {bad[:5]}; rolled back")


def check_root(views: Mapping[str, Words], specs: list[TensorSpec],
               root: str) -> dict[str, bytes]:
    """Digest every tensor; refuse unless they make the held root. Returns the digests."""
    digests = digests_hex(views, [s.name for s in specs])
    got = root_digest((s, bytes.fromhex(digests[s.name])) for s in specs).hex()
    if got != root:
        raise modified_outside(got, root)
    return {n: bytes.fromhex(d) for n, d in digests.items()}


def modified_outside(got: str, claimed: str) -> BaseMismatch:
    return BaseMismatch(f"the target's bits (root {got[:12]}…) are not the version it claims to "
                        f"hold (root {claimed[:12]}…): it was modified outside weighthub; pull it "
                        "afresh (`weighthub pull --force`, or into an empty path)")


def digests_hex(views: Mapping[str, Words], names: list[str]) -> dict[str, str]:
    with ThreadPoolExecutor(2) as pool:  # the digest kernels release the GIL
        return dict(zip(names, pool.map(lambda n: digest_words(views[n], threads=1).hex(), names),
                        strict=True))
