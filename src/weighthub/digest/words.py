"""Digests of a target's words wherever they live: host numpy words by the numba kernels
(`digest.linear`), torch word views by torch ops on their own device (`digest.device`). Both
give the same bytes (format/spec.md §4); the receiver calls these on whatever its target hands
out, so a model with some tensors on a GPU and some on the host verifies in one pass.
"""

from __future__ import annotations

import numpy as np

from ..tensors import Words
from . import linear


def digest_words(words: Words, *, threads: int = 2) -> bytes:
    """The digest of a whole tensor's words, flat in row-major order (`linear.digest_bits`)."""
    if isinstance(words, np.ndarray):
        return linear.digest_bits(words, threads=threads)
    from . import device

    return device.tensor_digest(words)  # row-major, whatever the strides (no copy)


def digest_words_affine(words: Words, first: int, strides: tuple[int, ...]) -> bytes:
    """The digest contribution of a block of words placed by an affine map
    (`linear.digest_affine`), one thread on the host."""
    if isinstance(words, np.ndarray):
        return linear.digest_affine(words, first, strides, threads=1)
    from . import device

    return device.digest_affine(words, first, strides)
