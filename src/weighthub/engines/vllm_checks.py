"""Checks the vLLM worker extension makes against the store: which version an engine's bits are,
and whether a manifest relayed to its host may plan a staging."""

from __future__ import annotations

import numpy as np
import torch

from .. import catalog
from ..cluster.relayed import RelayedManifests, vouched
from ..digest import digest_bits
from ..errors import BaseMismatch, NoSyncPath, VersionNotFound
from ..receive import Receiver, Staged
from ..store import Store
from ..tensors import bits


def find_version(store: Store, state: dict[str, torch.Tensor], what: str) -> int:
    """The newest committed version whose per-tensor digests are those of `state`."""
    digests = {n: digest_bits(bits(t)).hex() for n, t in state.items()}
    versions = catalog.list_versions(store)
    for v in reversed(versions):
        if digests_of(store, v) == digests:
            return v
    raise BaseMismatch(f"{what} is none of the {len(versions)} version(s) in {store.url}: no "
                       "manifest has its digests; start the engine from a published checkpoint")


def digests_of(store: Store, version: int) -> dict[str, str]:
    return {e.name: e.digest for e in catalog.primary_manifest(store, version).tensors}


def check_same_bits(have: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str,
                     version: str) -> None:
    differ = sorted(n for n in set(have) & set(want) if have[n].shape != want[n].shape
                    or have[n].dtype != want[n].dtype or not np.array_equal(bits(have[n]), bits(want[n])))
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    if differ or missing or extra:
        raise BaseMismatch(f"{what} is not {version}: differs in {differ[:5]}, lacks {missing[:5]}, "
                           f"has extra {extra[:5]}; start the engine from that version's checkpoint "
                           "or bind to the version it was started from")


def check_committed(state: dict[str, torch.Tensor], canonical: dict[str, torch.Tensor],
                    digests: dict[str, str], what: str, version: str) -> None:
    """`state` must be the committed version: the names, shapes and dtypes of the engine's
    canonical tensors (`canonical`) and the bits its manifest's `digests` name. Not compared
    with the engine's own bits: in place those are the engine's memory, which a state loaded to
    heal weights changed outside weighthub is meant to overwrite."""
    differ = sorted(n for n in set(canonical) & set(state)
                    if state[n].shape != canonical[n].shape or state[n].dtype != canonical[n].dtype
                    or digest_bits(bits(state[n])).hex() != digests.get(n))
    missing = sorted(set(canonical) - set(state))
    extra = sorted(set(state) - set(canonical))
    if differ or missing or extra:
        raise BaseMismatch(f"{what} is not {version}: differs in {differ[:5]}, lacks {missing[:5]}, "
                           f"has extra {extra[:5]}; load that version's own state")


def staged_relayed(receiver: Receiver, version: int | None, manifest: bytes | None,
                    digest: str | None) -> Staged | None:
    """`version` staged from a manifest relayed to this host (`weighthub_stage`); None when
    there is none, it is not the one the hub vouched for, or it is no delta from what the
    engine holds (the store then plans)."""
    manifests = receiver.store
    if version is None or manifest is None or not isinstance(manifests, RelayedManifests):
        return None
    raw = vouched(manifest, version, digest, where="vLLM worker")
    if raw is None:
        return None
    try:
        with manifests.trusted_route({version: raw}):
            return receiver.stage(version)
    except (NoSyncPath, VersionNotFound):  # not one step from the held version
        return None
