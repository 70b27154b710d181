"""The version-2 segment table parsed in one kernel call (spec §1 "Segment table, v2").

A chunk of a model with thousands of small tensors (MoE experts) has thousands of records; read
a varint at a time in Python they took ~5 µs a record (40 ms of a staging of 8000 tensors). The
kernel checks exactly what the reader requires of every varint (at most 10 bytes, below 2^64,
shortest form, inside the table) and stops at the first violation, which `chunk._records_v2`
reports as before.
"""

from __future__ import annotations

import numpy as np

from ..kernel_cache import njit

FIELDS = 7  # tensor, coding byte, start, n − 1, count, position bytes, value bytes
ENDS_IN_RECORD, ENDS_IN_VARINT, NOT_SHORTEST, TOO_LONG, OUT_OF_RANGE = 1, 2, 3, 4, 5
_U32_MAX = np.uint64((1 << 32) - 1)
_U64_MAX = np.uint64((1 << 64) - 1)


@njit(cache=True, nogil=True, boundscheck=False)
def parse_records(table, nseg, out):
    """Fill out[i, :] (uint64[nseg, FIELDS]) from the table; (records done, error code, end
    offset): error 0 and done == nseg when the whole table parsed."""
    n = table.shape[0]
    off = 0
    for i in range(nseg):
        for f in range(FIELDS):
            if f == 1:  # the coding byte
                if off >= n:
                    return i, ENDS_IN_RECORD, off
                out[i, 1] = np.uint64(table[off])
                off += 1
                continue
            v = np.uint64(0)
            shift = np.uint64(0)
            k = 0
            while True:  # ends by the tenth byte: see below
                if off + k >= n:
                    return i, ENDS_IN_VARINT, off
                b = table[off + k]
                if k > 0 and b == 0:
                    return i, NOT_SHORTEST, off
                if k == 9 and b > 1:  # a tenth byte holds bit 63 only, and ends the varint
                    return i, TOO_LONG, off
                v |= np.uint64(b & 0x7F) << shift
                shift += np.uint64(7)
                k += 1
                if b < 0x80:
                    break
            out[i, f] = v
            off += k
        # the tensor a u32, the range's end start + n below 2^64 (as the reader reports it:
        # record by record, before the next record's varints)
        if out[i, 0] > _U32_MAX or out[i, 3] >= _U64_MAX - out[i, 2]:
            return i, OUT_OF_RANGE, off
    return nseg, 0, off
