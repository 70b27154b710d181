"""The version-2 segment table parsed by one kernel call (`format.table_kernel`) must accept and
refuse exactly what the reference reader below accepts and refuses (spec §1 "Segment table, v2":
varints of at most 10 bytes, below 2^64, in their shortest form, inside the table), with the
same records, on random tables, mutated tables and every boundary of a varint."""

from __future__ import annotations

import numpy as np
import pytest

from reference_codec import leb128
from weighthub.errors import FormatError
from weighthub.format.chunk import _records_v2


def _reference(table: bytes, nseg: int) -> list[tuple[int, ...]] | str:
    """The reader as it was in Python, a varint at a time: the records, or the error's text."""
    def varint(off: int, i: int) -> tuple[int, int]:
        v = shift = 0
        for k in range(10):
            if off + k >= len(table):
                raise FormatError(f"x segment {i}: the segment table ends inside a varint")
            b = table[off + k]
            if k and b == 0:
                raise FormatError(f"x segment {i}: a varint in the segment table is not in its "
                                  "shortest form")
            v |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                if v >= 1 << 64:
                    break
                return v, off + k + 1
        raise FormatError(f"x segment {i}: a varint in the segment table is over 10 bytes or "
                          "above 2^64 − 1")

    out: list[tuple[int, ...]] = []
    off = 0
    try:
        for i in range(nseg):
            tensor, off = varint(off, i)
            if off >= len(table):
                raise FormatError(f"x segment {i}: the segment table ends inside the record")
            coding = table[off]
            off += 1
            start, off = varint(off, i)
            n1, off = varint(off, i)
            count, off = varint(off, i)
            plen, off = varint(off, i)
            vlen, off = varint(off, i)
            if start + n1 + 1 >= 1 << 64 or tensor >= 1 << 32:
                raise FormatError(f"x segment {i}: tensor {tensor} or range end {start + n1 + 1} "
                                  "out of the format's range (u32, u64)")
            out.append((tensor, (coding & 3) + 1, (coding >> 2) & 7, coding >> 5, 0, start,
                        start + n1 + 1, count, plen, vlen))
        if off != len(table):
            raise FormatError(f"x: {len(table) - off} bytes left in the segment table after "
                              f"{nseg} records")
    except FormatError as exc:
        return str(exc)
    return out


def _agree(table: bytes, nseg: int) -> None:
    want = _reference(table, nseg)
    try:
        got: list[tuple[int, ...]] | str = _records_v2(table, nseg, "x")
    except FormatError as exc:
        got = str(exc)
    assert got == want, (table.hex(), nseg)


def _random_table(rng: np.random.Generator, nseg: int) -> bytes:
    big = [0, 1, 127, 128, 16383, 16384, (1 << 32) - 1, 1 << 32, (1 << 63), (1 << 64) - 1]
    out = bytearray()
    for _ in range(nseg):
        vals = [int(rng.choice(big)) if rng.random() < 0.3 else int(rng.integers(0, 1 << 20))
                for _ in range(6)]
        out += leb128(vals[0]) + bytes([int(rng.integers(0, 256))])
        for v in vals[1:]:
            out += leb128(v)
    return bytes(out)


@pytest.mark.parametrize("seed", range(40))
def test_random_and_mutated_tables_parse_as_the_reference_reader_does(seed: int) -> None:
    rng = np.random.default_rng(seed)
    nseg = int(rng.integers(1, 30))
    table = _random_table(rng, nseg)
    _agree(table, nseg)
    for _ in range(30):  # a byte changed, dropped or added; a count off by one
        t = bytearray(table)
        at = int(rng.integers(0, len(t)))
        kind = rng.integers(0, 4)
        if kind == 0:
            t[at] = int(rng.integers(0, 256))
        elif kind == 1:
            del t[at]
        elif kind == 2:
            t.insert(at, int(rng.choice([0, 0x80, 0xFF, 1])))
        _agree(bytes(t), nseg + (int(rng.integers(-1, 2)) if kind == 3 else 0) or 1)


@pytest.mark.parametrize("varint", [
    b"\xff" * 9 + b"\x01",  # 2^64 − 1: the largest
    b"\xff" * 9 + b"\x02",  # 2^64: above
    b"\xff" * 9 + b"\x81",  # an eleventh byte announced
    b"\x80" * 9 + b"\x00",  # not the shortest form
    b"\x80\x00",
    b"\x00",
    b"\x80",  # ends inside
    b"",
])
@pytest.mark.parametrize("field", range(6))
def test_every_varint_boundary_in_every_field(varint: bytes, field: int) -> None:
    fields = [leb128(3), b"\x44", leb128(10), leb128(5), leb128(2), leb128(4), leb128(6)]
    fields[field if field == 0 else field + 1] = varint
    _agree(b"".join(fields), 1)
    _agree(b"".join(fields) + b"".join([leb128(3), b"\x44", leb128(1)] + [leb128(1)] * 4), 2)
