"""Canonical tensors: dtype table, integer bit views, tensor specs.

Canonical space is the trainer's checkpoint layout: tensor names, dtypes and shapes as in the
Hugging Face checkpoint, elements flat in row-major order. Everything that compares or encodes
values goes through an unsigned integer view of the same width, never through float equality
(NaN payloads, -0.0 and +0.0 must stay distinct). Digests of these bits are `weighthub.digest`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

from .errors import ModelMismatch, UnknownCodecError, UsageError

if TYPE_CHECKING:
    # torch is imported where a tensor is first handled, not here: manifests (and so `weighthub
    # inspect`, `--help`) use the dtype table, and importing torch costs seconds per process
    import torch


# A tensor's bits as the code that reads or writes them sees them: host numpy unsigned words
# (`bits`, the numba kernels), or a torch signed-integer word view (`word_view`) on the tensor's
# own device (the device backend: codec/device.py, digest/device.py).
Words: TypeAlias = "np.ndarray | torch.Tensor"


@dataclass(frozen=True, slots=True)
class DType:
    """One canonical dtype.

    `exponent_shift`/`exponent_mask` locate the exponent field in the bit pattern of float
    dtypes (used as a coding context for change positions); 0/0 for integer dtypes.
    """

    name: str  # the name written into manifests (safetensors' spelling)
    torch_name: str  # the torch dtype's attribute name (torch.bfloat16 → "bfloat16")
    width: int  # bytes per element
    exponent_shift: int = 0
    exponent_mask: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.torch_name)

    @property
    def torch_words(self) -> torch.dtype:
        """The torch integer type of this dtype's bit views (`word_view`)."""
        import torch

        return getattr(torch, _TORCH_INT_BY_WIDTH[self.width])

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
    DType("BF16", "bfloat16", 2, 7, 0xFF),
    DType("F16", "float16", 2, 10, 0x1F),
    DType("F32", "float32", 4, 23, 0xFF),
    DType("F64", "float64", 8, 52, 0x7FF),
    DType("F8_E4M3", "float8_e4m3fn", 1, 3, 0xF),
    DType("F8_E5M2", "float8_e5m2", 1, 2, 0x1F),
    DType("I8", "int8", 1),
    DType("I16", "int16", 2),
    DType("I32", "int32", 4),
    DType("I64", "int64", 8),
    DType("U8", "uint8", 1),
    DType("BOOL", "bool", 1),
)
DTYPE_BY_NAME = {d.name: d for d in DTYPES}


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
    flat = t.detach() if t.requires_grad else t
    if flat.dim() != 1:  # (~1.4 µs a call: a model of thousands of tensors calls this per tensor)
        flat = flat.reshape(-1)
    if not flat.is_contiguous():  # reshape of a non-viewable tensor copies; make that explicit
        flat = flat.contiguous()
    return flat.view(d.torch_words).numpy().view(d.uint)


def word_view(t: torch.Tensor) -> torch.Tensor:
    """Flat signed-integer torch view of a tensor's bit patterns, on its own device (no copy if
    contiguous): int16 for 2-byte dtypes, int32, int64, uint8 (torch lacks unsigned 16/32/64
    views). The device backend's counterpart of `bits`; writes through it change the tensor.
    """
    d = dtype_of(t)
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(d.torch_words)


def words_numel(words: Words) -> int:
    """Elements of host numpy words or of a torch word view."""
    return words.size if isinstance(words, np.ndarray) else words.numel()


def readonly(a: np.ndarray) -> np.ndarray:
    """A read-only, C-contiguous, aligned view of `a` (a copy only if `a` is not already so).

    How arrays that a kernel only reads are passed to it: numba compiles a kernel once per
    argument type, and writability, memory layout and alignment are part of the type, so a
    single form keeps it to one compilation per word width. (Unaligned words occur when a
    frame's streams sit at odd offsets of its body; copying them costs less than a compile.)
    """
    flags = a.flags
    if not (flags.c_contiguous and flags.aligned):
        a = np.require(a, requirements=["C", "A"])
    elif not flags.writeable:
        return a  # already in that form (np.require costs ~3 µs a call, 11 calls a segment)
    out = a.view()
    out.flags.writeable = False
    return out


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


# --- names that moved to weighthub.digest --------------------------------------------------
