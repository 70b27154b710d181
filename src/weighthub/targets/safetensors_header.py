"""The safetensors header: parsed and validated before anything is mapped or allocated.

A header is hostile input like any other: its declared length is bounded (MAX_HEADER_BYTES)
and checked against the file's size, every entry's dtype, shape and offsets must be integers
consistent with each other and the file, and no two tensors may overlap (an in-place update of
one would corrupt the other).
"""

from __future__ import annotations

import itertools
import json
import math
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import FormatError, LimitError, UnknownCodecError, UsageError
from ..format.manifest import MAX_DIMS, MAX_ELEMENTS
from ..tensors import TensorSpec, dtype_named

MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True, slots=True)
class Entry:
    spec: TensorSpec
    file: Path
    offset: int  # absolute byte offset of the tensor's data in the file


def read_header(path: Path) -> list[Entry]:
    """Parse and validate a safetensors header (before mapping anything).

    Raises:
        UsageError: the file cannot be read.
        LimitError, FormatError: it is not a safetensors file, or a corrupt one.
    """
    header, data_start, size = header_object(path)
    return entries(path, header, data_start, size)


def header_object(path: Path) -> tuple[dict[str, Any], int, int]:
    """The header's JSON object, where the data starts, and the file's size."""
    try:
        st = path.stat()
        size = st.st_size
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block the open; a device may never end
            raise UsageError(f"{path} is not a regular file; a checkpoint is a .safetensors file")
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FormatError(f"{path}: {size} bytes, too short for a safetensors file (its "
                                  "first 8 bytes are the header's length)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise LimitError(f"{path}: its first 8 bytes declare a safetensors header of {n} "
                                 f"bytes, in a {size}-byte file")
            raw = f.read(n)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        header = json.loads(raw)
    except ValueError as exc:  # UnicodeDecodeError and over-long integers included
        raise FormatError(f"{path}: safetensors header is not JSON: {exc}") from exc
    except RecursionError:  # json recurses per nesting level; a real header nests 3 deep
        raise FormatError(f"{path}: safetensors header is JSON nested too deeply: a corrupt or "
                          "hostile file") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: safetensors header is not an object")
    return header, 8 + n, size


def entries(path: Path, header: dict[str, Any], data_start: int, size: int) -> list[Entry]:
    entries = []
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = dtype_named(info["dtype"])
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{path}: bad header entry for {name!r}: {exc}") from exc
        except UnknownCodecError as exc:  # name the file: it is the user's input
            raise UnknownCodecError(f"{path}: tensor {name!r}: {exc}") from None
        if not all(type(x) is int for x in (*shape, begin, end)):  # not 2.5, "3" or true
            raise FormatError(f"{path}: tensor {name!r} has non-integer shape or offsets")
        if len(shape) > MAX_DIMS or any(d > MAX_ELEMENTS for d in shape):
            raise LimitError(f"{path}: tensor {name!r} has shape {shape}: over {MAX_DIMS} dims "
                             f"or a dim over {MAX_ELEMENTS} elements")
        numel = math.prod(shape)
        if any(d < 0 for d in shape) or end - begin != numel * dtype.width or begin < 0 \
                or data_start + end > size:
            raise FormatError(f"{path}: tensor {name!r} has inconsistent offsets/shape")
        entries.append(Entry(TensorSpec(name, dtype, shape), path, data_start + begin))
        spans.append((begin, end, name))
    # overlapping tensors would alias each other: an in-place update of one corrupts the other
    spans.sort()
    for (_b0, e0, n0), (b1, _e1, n1) in itertools.pairwise(spans):
        if b1 < e0:
            raise FormatError(f"{path}: tensors {n0!r} and {n1!r} overlap in the file")
    return entries
