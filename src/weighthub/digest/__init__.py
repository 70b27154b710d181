"""Linear tensor digests (format/spec.md §4), in one place.

    mix.py      the per-element mixers (numba, inlined into every kernel that digests words,
                the codec's apply kernels included)
    kernels.py  host loops: runs, strided blocks, changes, scattered positions
    linear.py   the public digest math on host words: whole tensors, affine shards, changes
    sums.py     digest values and their algebra (16 bytes: two u64 lanes), no numba
    root.py     the root digest over a version's tensor table
    blocks.py   placing a block of words in canonical space (shared by host and device)
    device.py   the same digests in torch ops, on the words' own device (CUDA), same bytes
    words.py    a target's words digested where they live (host numpy or torch views)

`sums` and `root` load with the package; `linear` (numba) on first use of one of its names, so
that reading manifests (`weighthub inspect`) does not pay numba's import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports
from .root import root_digest
from .sums import DIGEST_BYTES, ZERO_DIGEST, add_digests, digest_add, digest_sub, lanes_digest

if TYPE_CHECKING:
    from .linear import as_words, digest_affine, digest_at, digest_bits, digest_change, tensor_digest

_FROM_LINEAR = frozenset({
    "as_words", "digest_affine", "digest_at", "digest_bits", "digest_change", "tensor_digest",
})

__getattr__ = lazy_exports(globals(), {"linear": _FROM_LINEAR})

__all__ = [
    "DIGEST_BYTES",
    "ZERO_DIGEST",
    "as_words",
    "add_digests",
    "digest_add",
    "digest_affine",
    "digest_at",
    "digest_bits",
    "digest_change",
    "digest_sub",
    "lanes_digest",
    "root_digest",
    "tensor_digest",
]
