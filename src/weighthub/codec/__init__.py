"""Delta codec: change detection, position and value encodings, per-segment op choice."""

from .segment import (
    EncodePolicy,
    Op,
    Positions,
    Segment,
    UndoLog,
    Values,
    apply_segment,
    changed_positions,
    encode_segment,
    regap_segment,
)

__all__ = [
    "EncodePolicy",
    "Op",
    "Positions",
    "Segment",
    "UndoLog",
    "Values",
    "apply_segment",
    "changed_positions",
    "encode_segment",
    "regap_segment",
]
