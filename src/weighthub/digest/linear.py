"""Linear tensor digests of host words (format/spec.md §4): whole tensors, affine shards, changes.

Shards are digested where they live and added (`digest_add`), and an update costs O(changed)
(`digest_change`). The loops are `digest.kernels`; this module shapes any n-D block of words into
the 1-D runs and 2-D blocks they take, without copying, and splits large ones over two threads.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from ..errors import UsageError
from ..tensors import bits, readonly
from . import kernels as DK
from .blocks import c_strides, coalesce
from .sums import lanes_digest

if TYPE_CHECKING:
    import torch

_PARALLEL_MIN = 1 << 22  # elements: below this a second thread costs more than it saves
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_Job = tuple[np.ndarray, int, int, int]  # a 2-D block: (words, first, row stride, col stride)


def _two_threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(2, thread_name_prefix="weighthub-digest")
        return _pool


def as_words(words: np.ndarray) -> np.ndarray:
    """The same memory as unsigned words, read-only (a view, whatever the strides).

    Every kernel sees read-only unsigned words, so it compiles once per word width rather than
    once per (width, signed/float/unsigned, writable/read-only) combination.

    Raises UsageError for an element width other than 1, 2, 4 or 8 bytes.
    """
    if words.dtype.itemsize not in (1, 2, 4, 8):
        raise UsageError(f"cannot digest {words.dtype} words: element width must be 1, 2, 4 "
                         "or 8 bytes")
    out = words.view(f"=u{words.dtype.itemsize}") if words.dtype.kind != "u" else words.view()
    out.flags.writeable = False
    return out


def tensor_digest(t: torch.Tensor) -> bytes:
    """The linear digest of a CPU tensor's canonical bits (see `digest_bits`)."""
    return digest_bits(bits(t))


def digest_bits(b: np.ndarray, *, threads: int = 2) -> bytes:
    """Digest of a whole tensor from its bit patterns, flat in row-major order.

    `b` may be any shape (read row-major) and any integer or float dtype of width 1/2/4/8
    (its bits are what count). Large arrays are split across `threads` threads (≤ 2).
    """
    return digest_affine(b, 0, c_strides(b.shape), threads=threads)


def digest_affine(words: np.ndarray, first: int, strides: tuple[int, ...], *,
                  threads: int = 2) -> bytes:
    """Digest contribution of an n-D block of words placed by an affine map (no copy).

    Element (a0, …, ak) of `words` is the canonical element first + Σ a_j·strides[j]. A rank
    holding a shard of a tensor (dim-0 rows, a column block, any DTensor placement) calls this
    on its local bits; the digests of the pieces of a tiling add up (`digest_add`) to
    `digest_bits` of the whole tensor.

    Raises UsageError if `strides` does not match `words.ndim` or a width is not 1/2/4/8.
    """
    if len(strides) != words.ndim:
        raise UsageError(f"digest_affine: {len(strides)} strides for a {words.ndim}-D block")
    w = as_words(words)
    shape, mem, canon = coalesce(w.shape, w.strides, tuple(int(s) for s in strides))
    w = np.lib.stride_tricks.as_strided(w, shape, mem, writeable=False)  # same memory, merged dims
    jobs: list[_Job] = []
    if len(shape) <= 2:
        w2 = w.reshape((1,) * (2 - len(shape)) + shape)  # adding unit dims never copies
        rs, cs = ((0,) * (2 - len(canon)) + canon)
        jobs.append((w2, first, rs, cs))
    else:
        for idx in np.ndindex(*shape[:-2]):
            jobs.append((w[idx], first + sum(i * s for i, s in zip(idx, canon[:-2], strict=True)),
                         canon[-2], canon[-1]))
    parallel = threads > 1 and w.size >= _PARALLEL_MIN
    if parallel:
        jobs = [part for job in jobs for part in _halves(job)]
    out = np.zeros(2, np.uint64)
    if parallel and len(jobs) > 1:
        for p in _two_threads().map(lambda j: _block(*j), jobs):
            out += p
    else:
        for job in jobs:
            out += _block(*job)
    return lanes_digest(out)


def _block(w2: np.ndarray, first: int, rs: int, cs: int) -> np.ndarray:
    out = np.zeros(2, np.uint64)
    if w2.shape[0] == 1 and cs == 1 and w2.strides[1] == w2.itemsize:
        DK.sum_run(_run(w2[0]), first, out)
    elif w2.size:
        DK.sum_block2(*_span(w2, first, rs, cs), out)
    return out


def _span(w2: np.ndarray, first: int, rs: int, cs: int
          ) -> tuple[np.ndarray, int, int, int, int, int, int, int]:
    """sum_block2's arguments for a strided 2-D block: its memory span as one contiguous run
    (no copy), the block's shape and memory strides in elements (made ≥ 0 by walking a dim
    backwards: first and the canonical stride follow), and its canonical placement."""
    size = w2.itemsize
    if any(s % size for s in w2.strides) or not w2.flags.aligned:
        w2 = np.ascontiguousarray(w2)  # strides that are not whole words: rare, copy
    rows, cols = w2.shape
    if w2.strides[0] < 0:
        w2, first, rs = w2[::-1], first + (rows - 1) * rs, -rs
    if w2.strides[1] < 0:
        w2, first, cs = w2[:, ::-1], first + (cols - 1) * cs, -cs
    mr, mc = w2.strides[0] // size, w2.strides[1] // size
    span = (rows - 1) * mr + (cols - 1) * mc + 1  # element (0, 0) is now the lowest address
    flat = np.lib.stride_tricks.as_strided(w2, (span,), (size,), writeable=False)
    return _run(flat), rows, cols, mr, mc, first, rs, cs


def _halves(job: _Job) -> list[_Job]:
    """Split a 2-D block in two (by rows, or by columns for one row) for two threads."""
    w2, first, rs, cs = job
    rows, cols = w2.shape
    if rows > 1:
        h = rows // 2
        return [(w2[:h], first, rs, cs), (w2[h:], first + h * rs, rs, cs)]
    if cols > 1:
        h = cols // 2
        return [(w2[:, :h], first, rs, cs), (w2[:, h:], first + h * cs, rs, cs)]
    return [job]


def digest_change(index: np.ndarray, old_words: np.ndarray, new_words: np.ndarray, *,
                  first: int = 0) -> bytes:
    """Σ_t mix(first + index[t], new[t]) − mix(first + index[t], old[t]): an update's effect.

    digest_bits(new) == digest_add(digest_bits(old), digest_change(positions, old[positions],
    new[positions])) for any set of distinct positions that covers every changed element.

    Raises UsageError unless index, old and new are 1-D arrays of one length.
    """
    if not index.shape == old_words.shape == new_words.shape or index.ndim != 1:
        raise UsageError(f"digest_change: index {index.shape}, old {old_words.shape} and new "
                         f"{new_words.shape} must be equal 1-D shapes")
    out = np.zeros(2, np.uint64)
    if index.size:
        DK.sum_change(_run(index.astype(np.int64, copy=False)), _run(as_words(old_words)),
                      _run(as_words(new_words)), first, out)
    return lanes_digest(out)


def digest_at(words: np.ndarray, positions: np.ndarray, first: int) -> bytes:
    """Σ_t mix(first + positions[t], words[positions[t]]): the digest of some elements of a run.

    `positions` are indexes into the 1-D `words` (first is the canonical index of words[0]).

    Raises UsageError for a position outside `words`.
    """
    pos = _run(positions.astype(np.int64, copy=False))
    if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= words.shape[0]):
        raise UsageError(f"digest_at: positions outside [0, {words.shape[0]})")
    out = np.zeros(2, np.uint64)
    DK.sum_at(_run(as_words(words)), pos, pos.size, first, out)
    return lanes_digest(out)


def _run(a: np.ndarray) -> np.ndarray:
    """The one form kernels see: read-only, C-contiguous, aligned (`tensors.readonly`)."""
    return readonly(a)
