"""Canonical tensors: dtype table, integer bit views and digests.

Canonical space is the trainer's checkpoint layout: tensor names, dtypes and shapes as in the
Hugging Face checkpoint, elements flat in row-major order. Everything that compares or encodes
values goes through an unsigned integer view of the same width, never through float equality
(NaN payloads, -0.0 and +0.0 must stay distinct).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from .errors import ModelMismatch, UnknownCodecError, UsageError

if TYPE_CHECKING:
    # torch is imported where a tensor is first handled, not here: manifests (and so `weighthub
    # inspect`, `--help`) use the dtype table, and importing torch costs seconds per process
    import torch


@dataclass(frozen=True, slots=True)
class DType:
    """One canonical dtype.

    `exponent_shift`/`exponent_mask` locate the exponent field in the bit pattern of float
    dtypes (used as a coding context for change positions); 0/0 for integer dtypes.
    """

    name: str  # the name written into manifests (safetensors' spelling)
    code: int  # the id written into chunk frames
    torch_name: str  # the torch dtype's attribute name (torch.bfloat16 → "bfloat16")
    width: int  # bytes per element
    exponent_shift: int = 0
    exponent_mask: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.torch_name)

    @property
    def uint(self) -> type[np.unsignedinteger]:
        """The numpy unsigned integer type used for this dtype's bit patterns."""
        return _UINT_BY_WIDTH[self.width]

    @property
    def is_float(self) -> bool:
        return self.exponent_mask != 0


_UINT_BY_WIDTH: dict[int, type[np.unsignedinteger]] = {
    1: np.uint8,
    2: np.uint16,
    4: np.uint32,
    8: np.uint64,
}
# the signed torch type a bit view of each width uses (torch lacks unsigned 16/32/64 views)
_TORCH_INT_BY_WIDTH = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}

DTYPES: tuple[DType, ...] = (
    DType("BF16", 1, "bfloat16", 2, 7, 0xFF),
    DType("F16", 2, "float16", 2, 10, 0x1F),
    DType("F32", 3, "float32", 4, 23, 0xFF),
    DType("F64", 4, "float64", 8, 52, 0x7FF),
    DType("F8_E4M3", 5, "float8_e4m3fn", 1, 3, 0xF),
    DType("F8_E5M2", 6, "float8_e5m2", 1, 2, 0x1F),
    DType("I8", 7, "int8", 1),
    DType("I16", 8, "int16", 2),
    DType("I32", 9, "int32", 4),
    DType("I64", 10, "int64", 8),
    DType("U8", 11, "uint8", 1),
    DType("BOOL", 12, "bool", 1),
)
DTYPE_BY_NAME = {d.name: d for d in DTYPES}
DTYPE_BY_CODE = {d.code: d for d in DTYPES}


@functools.cache
def _by_torch() -> dict[torch.dtype, DType]:
    return {d.torch_dtype: d for d in DTYPES}


def dtype_of(t: torch.Tensor) -> DType:
    """The canonical dtype of a tensor, or UsageError if weighthub does not carry it."""
    try:
        return _by_torch()[t.dtype]
    except KeyError:
        known = ", ".join(f"torch.{d.torch_name}" for d in DTYPES)
        raise UsageError(f"dtype {t.dtype} is not supported; supported: {known}") from None


def dtype_named(name: str) -> DType:
    try:
        return DTYPE_BY_NAME[name]
    except KeyError:
        raise UnknownCodecError(
            f"unknown dtype {name!r}; known: {sorted(DTYPE_BY_NAME)}"
        ) from None


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, dtype and shape of one canonical tensor."""

    name: str
    dtype: DType
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.width

    @staticmethod
    def of(name: str, t: torch.Tensor) -> TensorSpec:
        return TensorSpec(name, dtype_of(t), tuple(t.shape))


def bits(t: torch.Tensor) -> np.ndarray:
    """Flat unsigned-integer numpy view of a CPU tensor's bit patterns (no copy if contiguous).

    Writes through the view change the tensor: this is how receivers apply in place.
    """
    d = dtype_of(t)
    if t.device.type != "cpu":
        raise UsageError(f"bits() needs a CPU tensor, got one on {t.device}")
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():  # reshape of a non-viewable tensor copies; make that explicit
        flat = flat.contiguous()
    import torch  # loaded already (t is a tensor); imported here only to keep this module light

    as_int = flat.view(getattr(torch, _TORCH_INT_BY_WIDTH[d.width]))
    return as_int.numpy().view(d.uint)


def tensor_digest(t: torch.Tensor) -> bytes:
    """The linear digest of a tensor's canonical bits (see `digest_bits`)."""
    return digest_bits(bits(t))


# --- linear digests (format/spec.md §4) ------------------------------------------------------
# A digest is 16 bytes: two little-endian u64 lanes, S0 then S1, each Σ_i mix(i, w_i) mod 2^64
# over the tensor's elements (canonical flat index i, bit pattern w_i). Sums compose, so shards
# are digested where they live and added, and an update costs O(changed).

DIGEST_BYTES = 16
ZERO_DIGEST = bytes(DIGEST_BYTES)  # the digest of nothing; the start of every sum
_PARALLEL_MIN = 1 << 22  # elements: below this a second thread costs more than it saves
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _kernels() -> ModuleType:
    # imported on first use: codec imports this module (DType), so a top-level import would cycle
    from .codec import digest_kernels

    return digest_kernels


def _two_threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(2, thread_name_prefix="weighthub-digest")
        return _pool


def _as_uint(words: np.ndarray) -> np.ndarray:
    """The same memory as unsigned words (a view, whatever the strides)."""
    if words.dtype.kind == "u":
        return words
    try:
        return words.view(_UINT_BY_WIDTH[words.dtype.itemsize])
    except KeyError:
        raise UsageError(f"cannot digest {words.dtype} words: element width must be 1, 2, 4 "
                         "or 8 bytes") from None


def _lanes(out: np.ndarray) -> bytes:
    return out.astype("<u8").tobytes()


def _unpack(d: bytes) -> tuple[int, int]:
    if len(d) != DIGEST_BYTES:
        raise UsageError(f"a digest is {DIGEST_BYTES} bytes, got {len(d)}")
    return int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little")


def digest_add(a: bytes, b: bytes) -> bytes:
    """a + b, lane-wise mod 2^64: the digest of two disjoint sets of elements together."""
    (a0, a1), (b0, b1) = _unpack(a), _unpack(b)
    m = (1 << 64) - 1
    return ((a0 + b0) & m).to_bytes(8, "little") + ((a1 + b1) & m).to_bytes(8, "little")


def digest_sub(a: bytes, b: bytes) -> bytes:
    """a − b, lane-wise mod 2^64: remove the contribution b from a."""
    (a0, a1), (b0, b1) = _unpack(a), _unpack(b)
    m = (1 << 64) - 1
    return ((a0 - b0) & m).to_bytes(8, "little") + ((a1 - b1) & m).to_bytes(8, "little")


def digest_bits(b: np.ndarray, *, threads: int = 2) -> bytes:
    """Digest of a whole tensor from its bit patterns, flat in row-major order.

    `b` may be any shape (read row-major) and any integer or float dtype of width 1/2/4/8
    (its bits are what count). Large arrays are split across `threads` threads (≤ 2).
    """
    return digest_affine(b, 0, _c_strides(b.shape), threads=threads)


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


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
    w = _as_uint(words)
    shape, mem, canon = _coalesce(w.shape, w.strides, tuple(int(s) for s in strides))
    w = np.lib.stride_tricks.as_strided(w, shape, mem, writeable=False)  # same memory, merged dims
    k = _kernels()
    jobs: list[tuple[np.ndarray, int, int, int]] = []  # 2-D blocks: (words, first, rs, cs)
    if len(shape) <= 2:
        w2 = w.reshape((1,) * (2 - len(shape)) + shape)  # adding unit dims never copies
        rs, cs = ((0,) * (2 - len(canon)) + canon)
        jobs.append((w2, first, rs, cs))
    else:
        for idx in np.ndindex(*shape[:-2]):
            jobs.append((w[idx], first + sum(i * s for i, s in zip(idx, canon[:-2], strict=True)),
                         canon[-2], canon[-1]))
    if threads > 1 and w.size >= _PARALLEL_MIN:
        jobs = [part for job in jobs for part in _halves(job)]
    out = np.zeros(2, np.uint64)
    if len(jobs) > 1 and threads > 1 and w.size >= _PARALLEL_MIN:
        parts = list(_two_threads().map(lambda j: _block(k, *j), jobs))
        for p in parts:
            out += p
    else:
        for job in jobs:
            out += _block(k, *job)
    return _lanes(out)


def _block(k: ModuleType, w2: np.ndarray, first: int, rs: int, cs: int) -> np.ndarray:
    out = np.zeros(2, np.uint64)
    if w2.shape[0] == 1 and cs == 1 and w2.strides[1] == w2.itemsize:
        k.sum_run(w2[0], first, out)
    elif w2.size:
        k.sum_block2(w2, first, rs, cs, out)
    return out


def _halves(job: tuple[np.ndarray, int, int, int]) -> list[tuple[np.ndarray, int, int, int]]:
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


def _coalesce(shape: tuple[int, ...], mem: tuple[int, ...], canon: tuple[int, ...]
              ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Drop unit dims and merge neighbours that are contiguous in memory and in canonical space."""
    if 0 in shape:
        return (0,), (1,), (1,)
    dims = [(n, m, c) for n, m, c in zip(shape, mem, canon, strict=True) if n != 1]
    merged: list[tuple[int, int, int]] = []
    for n, m, c in dims:
        if merged:
            pn, pm, pc = merged[-1]
            if pm == n * m and pc == n * c:
                merged[-1] = (pn * n, m, c)
                continue
        merged.append((n, m, c))
    if not merged:
        return (1,), (1,), (1,)
    return (tuple(d[0] for d in merged), tuple(d[1] for d in merged),
            tuple(d[2] for d in merged))


def digest_change(index: np.ndarray, old_words: np.ndarray, new_words: np.ndarray, *,
                  first: int = 0) -> bytes:
    """Σ_t mix(first + index[t], new[t]) − mix(first + index[t], old[t]): an update's effect.

    digest_bits(new) == digest_add(digest_bits(old), digest_change(positions, old[positions],
    new[positions])) for any set of distinct positions that covers every changed element.
    """
    if not index.shape == old_words.shape == new_words.shape or index.ndim != 1:
        raise UsageError(f"digest_change: index {index.shape}, old {old_words.shape} and new "
                         f"{new_words.shape} must be equal 1-D shapes")
    out = np.zeros(2, np.uint64)
    if index.size:
        _kernels().sum_change(index.astype(np.int64, copy=False), _as_uint(old_words),
                              _as_uint(new_words), first, out)
    return _lanes(out)


def root_digest(entries: Iterable[tuple[TensorSpec, bytes]]) -> bytes:
    """Digest over (name, dtype, shape, tensor digest) of every tensor, in name order."""
    h = xxhash.xxh3_128()
    for spec, dig in sorted(entries, key=lambda e: e[0].name):
        h.update(spec.name.encode())
        h.update(b"\0" + spec.dtype.name.encode() + b"\0")
        h.update(np.asarray(spec.shape, dtype="<i8").tobytes())
        h.update(dig)
    return h.digest()


def specs_of(state: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """Canonical specs of a state dict, sorted by name (the canonical tensor order)."""
    return [TensorSpec.of(name, state[name]) for name in sorted(state)]


@dataclass(frozen=True, slots=True)
class ModelDiff:
    """How a tensor table (`got`) differs from the one expected, each list sorted by name."""

    missing: list[str]  # expected, but not in got
    unexpected: list[str]  # in got, but not expected
    changed: list[tuple[TensorSpec, TensorSpec]]  # (expected, got): same name, dtype or shape differ

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.changed)

    def phrases(self, got: str, expected: str, *, limit: int = 5) -> list[str]:
        """The differences in words, one phrase per kind and per changed tensor, e.g. "missing
        from CKPT: ['a']", "not in version 3: ['b']", "'c': dtype F32, version 3 has BF16"."""
        out = []
        if self.missing:
            out.append(f"missing from {got}: {_names(self.missing, limit)}")
        if self.unexpected:
            out.append(f"not in {expected}: {_names(self.unexpected, limit)}")
        for e, g in self.changed[:limit]:
            if e.shape == g.shape:
                out.append(f"{e.name!r}: dtype {g.dtype.name}, {expected} has {e.dtype.name}")
            elif e.dtype == g.dtype:
                out.append(f"{e.name!r}: shape {list(g.shape)}, {expected} has {list(e.shape)}")
            else:
                out.append(f"{e.name!r}: {g.dtype.name}{list(g.shape)}, {expected} has "
                           f"{e.dtype.name}{list(e.shape)}")
        if len(self.changed) > limit:
            out.append(f"{len(self.changed) - limit} more with another dtype or shape")
        return out


def _names(names: list[str], limit: int) -> str:
    return f"{names[:limit]}{' …' if len(names) > limit else ''}"


def model_diff(expected: Iterable[TensorSpec], got: Iterable[TensorSpec]) -> ModelDiff:
    """Compare two tensor tables by name: which are missing, unexpected, or of another dtype or
    shape (bits are not compared)."""
    exp = {s.name: s for s in expected}
    have = {s.name: s for s in got}
    return ModelDiff(sorted(set(exp) - set(have)), sorted(set(have) - set(exp)),
                     [(exp[n], have[n]) for n in sorted(set(exp) & set(have)) if exp[n] != have[n]])


def check_same_model(expected: list[TensorSpec], got: list[TensorSpec], where: str) -> None:
    """Raise ModelMismatch naming the first differences between two tensor tables."""
    if expected == got:
        return
    # equal tables by name can still differ in order or repeat a name: indices would not match
    problems = model_diff(expected, got).phrases(where, "the model") or [
        "the same names in another order, or repeated"]
    raise ModelMismatch(f"{where} does not match the store's model: " + "; ".join(problems))
