"""Baselines: the committed state the next delta is taken against.

A rank's baseline is a private copy of the bits of the shards it publishes at the last version
the group committed, with that version's root and its digest contributions (a single process
holds whole tensors, so its contributions are the tensors' digests). It advances only after a
commit, so a failed publish leaves the next one diffing against the last committed state. A
skip baseline is the same record for the last skip point (`skip_every`).

A donated state (`publish(state, donate=True)`) is kept instead of copied: the baseline then
borrows the caller's tensors (no second copy of the model, no copy after the commit), and
never writes into them: a later state that is not donated gets fresh copies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import catalog
from ..store import Store
from ..tensors import TensorSpec, Words, bits


@dataclass(slots=True)
class Baseline:
    version: int
    root: str
    specs: list[TensorSpec]  # the canonical tensor table of the version
    bits: dict[str, Words]  # private copies of this rank's committed primary shards
    digests: dict[str, bytes]  # this rank's digest contributions at `version`
    borrowed: set[str] = field(default_factory=set)  # bits that are a donated state's words

    @property
    def ref(self) -> tuple[int, str]:
        """(version, root): what a delta taken against this baseline names as its base."""
        return self.version, self.root


def advanced(baseline: Baseline | None, version: int, root: str, specs: list[TensorSpec],
             new_bits: Mapping[str, Words], digests: Mapping[str, bytes], *,
             on_host: bool = False, donated: bool = False) -> Baseline:
    """`baseline` moved to `version` (updated in place), or a fresh copy if there is none.

    A fresh copy lives where the shard does (a device shard's on its device), or on the host
    with `on_host`. An existing copy is refreshed where it is, except that a host baseline
    adopted from the store (`adopt`, read as a receiver reads it) moves to the device of a
    device shard after its first delta (which uploaded its old words chunk by chunk).
    `donated`: keep `new_bits` themselves as the baseline instead of a copy, and never write
    into them later; only a device shard's words with `on_host` are still copied (to the host).
    """
    if baseline is None:
        baseline = Baseline(version, root, specs, {}, dict(digests))
    for n, b in new_bits.items():
        if donated and (not on_host or isinstance(b, np.ndarray)):
            baseline.bits[n] = b
            baseline.borrowed.add(n)
        elif n not in baseline.bits or n in baseline.borrowed:
            baseline.bits[n] = _copy_of(b, on_host)
            baseline.borrowed.discard(n)
        else:
            _refresh(baseline, n, b, on_host)
    baseline.version, baseline.root, baseline.specs = version, root, specs
    baseline.digests = dict(digests)
    return baseline


def _refresh(baseline: Baseline, n: str, b: Words, on_host: bool) -> None:
    # One streaming copy of every tensor, on purpose: measured on 2 cores for 520 MiB at
    # 1.3-5% changed, np.copyto takes ~60 ms; scattering only the changed words (from the
    # scan's compacted changes, numpy or a numba kernel) takes 45-105 ms and 2 threads of
    # copyto 80-110 ms (at these rates a third to two thirds of all cache lines hold a
    # change, so a scatter touches most of memory anyway, without streaming), and applying
    # the encoded segments 80-400 ms (grouped positions rescan every element). The commit
    # is already visible, so receivers do not wait for this.
    have = baseline.bits[n]
    if isinstance(b, torch.Tensor) and isinstance(have, np.ndarray) and not on_host:
        baseline.bits[n] = b.clone()  # adopted from the store (a restart): onto the device
    else:
        copy_words(have, b)


def _copy_of(b: Words, on_host: bool) -> Words:
    if isinstance(b, np.ndarray):
        return b.copy()
    return b.detach().cpu().numpy().copy() if on_host else b.clone()


def copy_words(dst: Words, src: Words) -> None:
    """dst[:] = src, bit for bit, wherever either lives (host numpy or torch words of a width)."""
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src if isinstance(src, np.ndarray) else src.detach().cpu().numpy()
                  .view(dst.dtype))
    elif isinstance(src, np.ndarray):
        dst.copy_(torch.from_numpy(src.view(_signed(src.dtype))))
    else:
        dst.copy_(src)


def as_device_words(words: Words, like: torch.Tensor) -> torch.Tensor:
    """`words` as torch words on `like`'s device (an upload for host words)."""
    if isinstance(words, np.ndarray):
        return torch.from_numpy(words.view(_signed(words.dtype))).to(like.device, non_blocking=True)
    return words


def _signed(dtype: np.dtype) -> np.dtype:
    """The numpy type of a torch word view of this width (uint8 stays; others are signed)."""
    return np.dtype(np.uint8) if dtype.itemsize == 1 else np.dtype(f"<i{dtype.itemsize}")


def adopt(store: Store) -> Baseline | None:
    """The store's latest version as a whole-tensor baseline (a publisher restarting), or None
    for an empty store. Reads it as a receiver does: every chunk checked, digests verified."""
    latest = catalog.latest_version(store)
    if latest is None:
        return None
    from ..receive import Receiver  # the receiver sits beside the publisher: imported on use
    from ..targets import StateDictTarget

    target = StateDictTarget({})
    Receiver(store, target).sync(latest)
    m = catalog.primary_manifest(store, latest)
    return Baseline(latest, m.root, m.specs(), {n: bits(t) for n, t in target.state.items()},
                    {e.name: bytes.fromhex(e.digest) for e in m.tensors})
