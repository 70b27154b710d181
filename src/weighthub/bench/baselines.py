"""What users would otherwise run, implemented faithfully enough to compare payload sizes.

Each baseline maps (old, new) bit arrays of one tensor to the bytes it would put on the wire.
"""

from __future__ import annotations

import numpy as np
import zstandard

_ZSTD = zstandard.ZstdCompressor(level=1)


def _z(b: bytes) -> int:
    return len(_ZSTD.compress(b)) if b else 0


def dense_bytes(old: np.ndarray | None, new: np.ndarray) -> int:
    return new.nbytes


def dense_zstd_bytes(old: np.ndarray | None, new: np.ndarray) -> int:
    return _z(new.tobytes())


def sparserl_bytes(old: np.ndarray, new: np.ndarray, *, compress: bool = False) -> int:
    """SparseRL-Sync style: int32 index + raw value of every changed element."""
    pos = np.flatnonzero(old != new)
    idx = pos.astype(np.int32).tobytes()
    vals = new[pos].tobytes()
    return (_z(idx) + _z(vals)) if compress else len(idx) + len(vals)


def nemo_bytes(old: np.ndarray, new: np.ndarray) -> int:
    """NeMo-RL sparse refit style: uint16 gaps (65535 escapes to a uint32) + XOR values, zstd-1."""
    x = old ^ new
    pos = np.flatnonzero(x)
    if pos.size == 0:
        return 0
    gaps = np.diff(pos, prepend=0)
    esc = gaps >= 0xFFFF
    g16 = np.where(esc, 0xFFFF, gaps).astype(np.uint16).tobytes() + gaps[esc].astype(np.uint32).tobytes()
    return _z(g16) + _z(x[pos].tobytes())
