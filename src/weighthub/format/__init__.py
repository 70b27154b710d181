"""Wire formats: chunk frames and manifests. Parse and validate at the edge; see spec.md."""

from .chunk import FORMAT_VERSION, ChunkFrame, decode_chunk, encode_chunk
from .manifest import (
    ChunkRef,
    Manifest,
    TensorEntry,
    chunk_checksum,
    decode_manifest,
    encode_manifest,
)

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
