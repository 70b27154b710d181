"""The root digest of a version: one hash over its tensor table and tensor digests (spec §4)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import xxhash

from ..tensors import TensorSpec


def root_digest(entries: Iterable[tuple[TensorSpec, bytes]]) -> bytes:
    """xxh3-128 over (name, dtype, shape, tensor digest) of every tensor, in name order."""
    h = xxhash.xxh3_128()
    for spec, dig in sorted(entries, key=lambda e: e[0].name):
        h.update(spec.name.encode())
        h.update(b"\0" + spec.dtype.name.encode() + b"\0")
        h.update(np.asarray(spec.shape, dtype="<i8").tobytes())
        h.update(dig)
    return h.digest()
