"""Delta codec: change detection, position and value encodings, per-segment op choice.

    coding.py   the codings' names and wire ids (format/spec.md §2), what readers accept,
                and the encoder policies: plain data, no numba
    segment.py  `Segment` and the `UndoLog` of applying segments
    encode.py   change scan and the smallest coding per segment
    apply.py    apply in place (forwards or inversely), regap grouped positions
    prepared.py a delta's words decoded against the held ones while staging; the pause scatters
    digest.py   the digest of the words a segment will rewrite (staged before the pause)
    kernels.py  the numba loops of all of the above
    ctx.py      the context codings (positions ranked in exponent groups, values in context of
                the old exponent): stream building, limits and decoding, for both coders
    ans.py, ans_kernels.py
                `ans` (the default): adaptive models under two interleaved rANS states
    rangecoder.py, ctx_kernels.py
                `ctx`: the same models under a binary-adaptive range coder (the older coder)
    device.py, device_groups.py, device_words.py
                the device kernels in torch (scan, group ranks and placement, sparse apply)
    device_encode.py  the encoder's device backend: scan on the device, code on the host

The codings load with the package; the rest on first use of one of their names: manifests name
codings, and reading them (as `weighthub inspect` does) must not pay numba's import (about a
second).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports
from .coding import EncodePolicy, Op, Positions, Values, check_coding, coding_invertible, invertible

if TYPE_CHECKING:
    from .apply import apply_segment, regap_segment
    from .encode import encode_changes, encode_segment, encode_segment_tracked
    from .scan import changed_positions
    from .segment import Segment, UndoEntry, UndoLog

__getattr__ = lazy_exports(globals(), {
    "segment": frozenset({"Segment", "UndoEntry", "UndoLog"}),
    "encode": frozenset({"encode_changes", "encode_segment", "encode_segment_tracked"}),
    "scan": frozenset({"changed_positions"}),
    "apply": frozenset({"apply_segment", "regap_segment"}),
})


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
    "check_coding",
    "coding_invertible",
    "encode_changes",
    "encode_segment",
    "encode_segment_tracked",
    "invertible",
    "regap_segment",
]
