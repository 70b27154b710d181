"""Canonical tensors: dtype table, integer bit views and digests.

Canonical space is the trainer's checkpoint layout: tensor names, dtypes and shapes as in the
Hugging Face checkpoint, elements flat in row-major order. Everything that compares or encodes
values goes through an unsigned integer view of the same width, never through float equality
(NaN payloads, -0.0 and +0.0 must stay distinct).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from .errors import ModelMismatch, UnknownCodecError, UsageError


@dataclass(frozen=True, slots=True)
class DType:
    """One canonical dtype.

    `exponent_shift`/`exponent_mask` locate the exponent field in the bit pattern of float
    dtypes (used as a coding context for change positions); 0/0 for integer dtypes.
    """

    name: str  # the name written into manifests (safetensors' spelling)
    code: int  # the id written into chunk frames
    torch_dtype: torch.dtype
    width: int  # bytes per element
    exponent_shift: int = 0
    exponent_mask: int = 0

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
_TORCH_INT_BY_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

DTYPES: tuple[DType, ...] = (
    DType("BF16", 1, torch.bfloat16, 2, 7, 0xFF),
    DType("F16", 2, torch.float16, 2, 10, 0x1F),
    DType("F32", 3, torch.float32, 4, 23, 0xFF),
    DType("F64", 4, torch.float64, 8, 52, 0x7FF),
    DType("F8_E4M3", 5, torch.float8_e4m3fn, 1, 3, 0xF),
    DType("F8_E5M2", 6, torch.float8_e5m2, 1, 2, 0x1F),
    DType("I8", 7, torch.int8, 1),
    DType("I16", 8, torch.int16, 2),
    DType("I32", 9, torch.int32, 4),
    DType("I64", 10, torch.int64, 8),
    DType("U8", 11, torch.uint8, 1),
    DType("BOOL", 12, torch.bool, 1),
)
DTYPE_BY_NAME = {d.name: d for d in DTYPES}
DTYPE_BY_CODE = {d.code: d for d in DTYPES}
DTYPE_BY_TORCH = {d.torch_dtype: d for d in DTYPES}


def dtype_of(t: torch.Tensor) -> DType:
    """The canonical dtype of a tensor, or UsageError if weighthub does not carry it."""
    try:
        return DTYPE_BY_TORCH[t.dtype]
    except KeyError:
        known = ", ".join(str(d.torch_dtype) for d in DTYPES)
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
    as_int = flat.view(_TORCH_INT_BY_WIDTH[d.width]) if d.width > 1 else flat.view(torch.uint8)
    return as_int.numpy().view(d.uint)


def tensor_digest(t: torch.Tensor) -> bytes:
    """xxh3-128 of the tensor's canonical bytes (little-endian, row-major)."""
    return digest_bits(bits(t))


def digest_bits(b: np.ndarray) -> bytes:
    h = xxhash.xxh3_128()
    # memoryview of the contiguous array: no copy; xxhash releases the GIL on large buffers
    h.update(np.ascontiguousarray(b).view(np.uint8).data)
    return h.digest()


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


def check_same_model(expected: list[TensorSpec], got: list[TensorSpec], where: str) -> None:
    """Raise ModelMismatch naming the first differences between two tensor tables."""
    if expected == got:
        return
    exp = {s.name: s for s in expected}
    have = {s.name: s for s in got}
    problems: list[str] = []
    missing = sorted(set(exp) - set(have))
    extra = sorted(set(have) - set(exp))
    if missing:
        problems.append(f"missing {missing[:5]}{' …' if len(missing) > 5 else ''}")
    if extra:
        problems.append(f"unexpected {extra[:5]}{' …' if len(extra) > 5 else ''}")
    for name in sorted(set(exp) & set(have)):
        a, b = exp[name], have[name]
        if a != b:
            problems.append(
                f"{name!r}: expected {a.dtype.name}{list(a.shape)}, got {b.dtype.name}{list(b.shape)}"
            )
            if len(problems) > 6:
                break
    raise ModelMismatch(f"{where} does not match the store's model: " + "; ".join(problems))
