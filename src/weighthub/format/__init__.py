"""Wire formats: chunk frames and manifests. Parse and validate at the edge; see spec.md.

Manifests load with the package; chunk frames on first use of one of their names: a frame
decodes into codec segments (numba kernels), and reading manifests alone (`weighthub inspect`)
must not pay numba's import (about a second).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports
from .manifest import (
    ChunkRef,
    Manifest,
    TensorEntry,
    chunk_checksum,
    decode_manifest,
    encode_manifest,
)

if TYPE_CHECKING:
    from .chunk import FORMAT_VERSION, ChunkFrame, decode_chunk, encode_chunk

_FROM_CHUNK = frozenset({"FORMAT_VERSION", "ChunkFrame", "decode_chunk", "encode_chunk"})


__getattr__ = lazy_exports(globals(), {"chunk": _FROM_CHUNK})


__all__ = [
    "FORMAT_VERSION",
    "ChunkFrame",
    "ChunkRef",
    "Manifest",
    "TensorEntry",
    "chunk_checksum",
    "decode_chunk",
    "decode_manifest",
    "encode_chunk",
    "encode_manifest",
]
