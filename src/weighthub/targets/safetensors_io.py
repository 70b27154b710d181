"""Reading a safetensors checkpoint whole, and writing an empty one to materialize a target."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import torch

from ..errors import FormatError, UsageError
from ..tensors import TensorSpec
from .safetensors_header import entries, header_object
from .sidecar import data_files


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read a .safetensors file or a directory of them into CPU tensors (copies, not maps:
    a later in-place pull into the same file must not change tensors already loaded)."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"checkpoint {p} does not exist")
    files = data_files(p)
    if not files:
        raise UsageError(f"{p} holds no .safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            header = header_object(f)
        except FormatError as exc:  # a .bin, a .pt, a text file: the caller named the wrong file
            detail = str(exc).removeprefix(f"{f}: ")
            raise UsageError(f"{f} is not a safetensors file ({detail}); give a .safetensors file "
                             "or a directory of them") from None
        for e in entries(f, *header):
            if e.spec.name in state:
                raise FormatError(f"{f}: tensor {e.spec.name!r} appears in two files")
            words = np.fromfile(f, dtype=e.spec.dtype.uint, count=e.spec.numel, offset=e.offset)
            t = torch.from_numpy(words.view(np.uint8))
            state[e.spec.name] = t.view(e.spec.dtype.torch_dtype).reshape(e.spec.shape)
    return state


def write_empty_safetensors(path: Path, specs: list[TensorSpec]) -> None:
    """A safetensors file with the given tensors, zero-filled (sparse).

    Tensors are laid out widest dtype first: safetensors wants contiguous data, and this order
    keeps every tensor aligned to its width so it can be updated through integer views.
    """
    header: dict[str, object] = {}
    offset = 0
    for s in sorted(specs, key=lambda s: (-s.dtype.width, s.name)):
        header[s.name] = {"dtype": s.dtype.name, "shape": list(s.shape),
                          "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)


__all__ = ["load_checkpoint", "write_empty_safetensors"]
