"""Delta codec: change detection, position and value encodings, per-segment op choice."""

from .segment import (
    EncodePolicy,
    Op,
    Positions,
    Segment,
    UndoEntry,
    UndoLog,
    Values,
    apply_segment,
    changed_positions,
    encode_segment,
    encode_segment_tracked,
    regap_segment,
)

__all__ = [
    "EncodePolicy",
    "Op",
    "Positions",
    "Segment",
    "UndoEntry",
    "UndoLog",
    "Values",
    "apply_segment",
    "changed_positions",
    "encode_segment",
    "encode_segment_tracked",
    "regap_segment",
]
