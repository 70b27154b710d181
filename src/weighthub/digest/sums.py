"""Digest values and their algebra (format/spec.md §4), without numba: plain bytes arithmetic.

A digest is 16 bytes: two little-endian u64 lanes, S0 then S1, each Σ_i mix(i, w_i) mod 2^64
over a set of elements (canonical flat index i, bit pattern w_i). Sums compose: the digests of
disjoint sets of elements add lane-wise, and an update adds the difference of what it rewrote.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import UsageError

DIGEST_BYTES = 16
ZERO_DIGEST = bytes(DIGEST_BYTES)  # the digest of nothing; the start of every sum
_M64 = (1 << 64) - 1


def lanes_digest(lanes: np.ndarray) -> bytes:
    """The digest bytes of the two uint64 lane sums (S0, S1) a kernel accumulated."""
    return lanes.astype("<u8").tobytes()


def _unpack(d: bytes) -> tuple[int, int]:
    if len(d) != DIGEST_BYTES:
        raise UsageError(f"a digest is {DIGEST_BYTES} bytes, got {len(d)}")
    return int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little")


def _pack(s0: int, s1: int) -> bytes:
    return (s0 & _M64).to_bytes(8, "little") + (s1 & _M64).to_bytes(8, "little")


def digest_add(a: bytes, b: bytes) -> bytes:
    """a + b, lane-wise mod 2^64: the digest of two disjoint sets of elements together.

    Raises UsageError if either is not 16 bytes.
    """
    (a0, a1), (b0, b1) = _unpack(a), _unpack(b)
    return _pack(a0 + b0, a1 + b1)


def digest_sub(a: bytes, b: bytes) -> bytes:
    """a − b, lane-wise mod 2^64: remove the contribution b from a.

    Raises UsageError if either is not 16 bytes.
    """
    (a0, a1), (b0, b1) = _unpack(a), _unpack(b)
    return _pack(a0 - b0, a1 - b1)


def add_digests(into: dict[str, bytes], changes: Sequence[tuple[str, bytes]]) -> None:
    """into[name] += change for every (name, change), lane-wise mod 2^64 (`digest_add`), in one
    numpy pass: a model of thousands of small tensors has a change or more per tensor, and the
    bytes arithmetic costs ~5 µs each (tens of ms a version). Every name must be in `into`.

    Raises UsageError if a digest is not 16 bytes (nothing changed then).
    """
    if not changes:
        return
    names = list(dict.fromkeys(n for n, _ in changes))
    held = b"".join(into[n] for n in names)
    deltas = b"".join(c for _, c in changes)
    if len(held) != DIGEST_BYTES * len(names) or len(deltas) != DIGEST_BYTES * len(changes):
        bad = next(d for d in [*(into[n] for n in names), *(c for _, c in changes)]
                   if len(d) != DIGEST_BYTES)
        raise UsageError(f"a digest is {DIGEST_BYTES} bytes, got {len(bad)}")
    total = np.frombuffer(held, "<u8").reshape(-1, 2).copy()
    lanes = np.frombuffer(deltas, "<u8").reshape(-1, 2)
    if len(names) == len(changes):  # one change a name, in the names' order (the usual case)
        total += lanes  # uint64: wraps
    else:
        slot = {n: k for k, n in enumerate(names)}
        np.add.at(total, np.fromiter((slot[n] for n, _ in changes), np.int64, len(changes)),
                  lanes)
    out = total.tobytes()
    into.update(zip(names, [out[k: k + DIGEST_BYTES] for k in range(0, len(out), DIGEST_BYTES)],
                    strict=True))
