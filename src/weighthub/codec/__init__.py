"""Delta codec: change detection, position and value encodings, per-segment op choice.

The codings' names, ids and policies (`coding`) load with the package; the segment encoder
and its numba kernels on first use of one of their names: manifests name codings, and reading
them (as `weighthub inspect` does) must not pay numba's import (about a second).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports
from .coding import EncodePolicy, Op, Positions, Values, coding_invertible, invertible

if TYPE_CHECKING:
    from .segment import (
        Segment,
        UndoEntry,
        UndoLog,
        apply_segment,
        changed_positions,
        encode_segment,
        encode_segment_tracked,
        regap_segment,
    )

_FROM_SEGMENT = frozenset({
    "Segment", "UndoEntry", "UndoLog", "apply_segment", "changed_positions",
    "encode_segment", "encode_segment_tracked", "regap_segment",
})


__getattr__ = lazy_exports(globals(), "segment", _FROM_SEGMENT)


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
    "coding_invertible",
    "encode_segment",
    "encode_segment_tracked",
    "invertible",
    "regap_segment",
]
