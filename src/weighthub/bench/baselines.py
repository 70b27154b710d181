"""What users would otherwise run, implemented faithfully enough to compare payload sizes.

Each baseline maps (old, new) bit arrays of one tensor (flat unsigned integer views) to the
number of bytes it would put on the wire for that tensor; `baseline_bytes` sums them over a state.

    dense          every bf16 word, raw
    dense_zstd     every word, zstd level 1 (one frame per tensor)
    sparserl       SparseRL-Sync style: int32 index + raw new value of every changed element
    sparserl_zstd  the same two streams, each zstd-1
    nemo           NeMo-RL sparse refit style: uint16 gaps between changed positions (a gap
                   ≥ 65535 writes 65535 and the full gap as uint32 in an escape stream) + the
                   XOR of old and new words, each stream zstd-1

Framing (tensor names, stream lengths) is not counted for the baselines: it only flatters them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import zstandard

_ZSTD = zstandard.ZstdCompressor(level=1)
_INT32_MAX = (1 << 31) - 1


def _z(b: bytes | memoryview) -> int:
    return len(_ZSTD.compress(b)) if len(b) else 0


def _changed(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"baseline: {old.dtype}{old.shape} vs {new.dtype}{new.shape}")
    return np.flatnonzero(old != new)


def dense_bytes(old: np.ndarray | None, new: np.ndarray) -> int:
    return new.nbytes


def dense_zstd_bytes(old: np.ndarray | None, new: np.ndarray) -> int:
    return _z(np.ascontiguousarray(new).view(np.uint8).data)


def sparserl_bytes(old: np.ndarray, new: np.ndarray, *, compress: bool = False) -> int:
    """SparseRL-Sync style: int32 index + raw value of every changed element."""
    if new.size > _INT32_MAX:
        raise ValueError(f"sparserl: {new.size} elements do not fit int32 indices")
    pos = _changed(old, new)
    idx = pos.astype(np.int32).tobytes()
    vals = new[pos].tobytes()
    return (_z(idx) + _z(vals)) if compress else len(idx) + len(vals)


def sparserl_zstd_bytes(old: np.ndarray, new: np.ndarray) -> int:
    return sparserl_bytes(old, new, compress=True)


def nemo_bytes(old: np.ndarray, new: np.ndarray) -> int:
    """NeMo-RL sparse refit style: uint16 gaps (65535 escapes to a uint32) + XOR values, zstd-1."""
    pos = _changed(old, new)
    if pos.size == 0:
        return 0
    x = old[pos] ^ new[pos]
    gaps = np.diff(pos, prepend=0)
    esc = gaps >= 0xFFFF
    g16 = np.where(esc, 0xFFFF, gaps).astype(np.uint16).tobytes()
    escapes = gaps[esc].astype(np.uint32).tobytes()
    return _z(g16) + _z(escapes) + _z(x.tobytes())


BASELINES: dict[str, Callable[[np.ndarray, np.ndarray], int]] = {
    "dense": dense_bytes,
    "dense_zstd": dense_zstd_bytes,
    "sparserl": sparserl_bytes,
    "sparserl_zstd": sparserl_zstd_bytes,
    "nemo": nemo_bytes,
}


def baseline_bytes(old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray],
                   names: list[str] | None = None) -> dict[str, int]:
    """Payload bytes of every baseline for the delta old → new, summed over tensors.

    Args:
        old, new: tensor name → flat bit view, same names, shapes and dtypes.
        names: baselines to run (default: all of BASELINES).
    Returns:
        baseline name → bytes on the wire.
    """
    chosen = {n: BASELINES[n] for n in (names or BASELINES)}
    totals = dict.fromkeys(chosen, 0)
    for tensor in sorted(new):
        for name, fn in chosen.items():
            totals[name] += fn(old[tensor], new[tensor])
    return totals
