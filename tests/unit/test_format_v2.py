"""Chunk frame version 2 (varint segment records): golden bytes, equivalence with version 1, and
every hostile table refused with a FormatError naming the chunk and the segment.

Version 1's header, body and trailer rules, and the record checks both versions share, are
attacked in test_format.py; here only what version 2 changes: the table's length in the header
and the records' varints.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from test_format import golden_segments

from weighthub.codec import Op, Positions, Segment, Values
from weighthub.errors import FormatError, UnknownCodecError, UsageError
from weighthub.format import chunk as chunk_mod
from weighthub.format import decode_chunk, encode_chunk

WHERE = "memory://t/v000000000001/c000007.whc"
HEADER = struct.Struct("<4sHHIIQQ")


GOLDEN_V2 = bytes.fromhex(
    # header: magic, version 2, flags 0, 2 segments, table 14 bytes, raw 13, stored 13
    "5748434b" "0200" "0000" "02000000" "0e000000" "0d00000000000000" "0d00000000000000"
    # segment 0: tensor 0, coding (4−1) | 0<<2 | 1<<5 = 0x23 (dense/all/raw), start 0, n−1 3,
    # count 4, pos_len 0, val_len 8
    "00" "23" "00" "03" "04" "00" "08"
    # segment 1: tensor 1, coding (1−1) | 1<<2 | 2<<5 = 0x44 (xor/gaps/varint), start 8, n−1 7,
    # count 2, pos_len 2, val_len 3
    "01" "44" "08" "07" "02" "02" "03"
    # body, exactly as in version 1: positions of seg 1, then values of seg 0, seg 1
    "0103" "010002000080ffff" "018001"
    # trailer: xxh3-64 of everything above, little-endian
    "9c82367018e7586e"
)
TABLE = GOLDEN_V2[32:46]
BODY = GOLDEN_V2[46:-8]


def frame_of(table: bytes, *, nseg: int = 2, table_len: int | None = None, body: bytes = BODY) -> bytes:
    head = HEADER.pack(b"WHCK", 2, 0, nseg, len(table) if table_len is None else table_len,
                       len(body), len(body))
    out = head + table + body
    return out + struct.pack("<Q", xxhash.xxh3_64_intdigest(out))


def fields(seg: Segment) -> tuple[object, ...]:
    return (seg.tensor, seg.start, seg.stop, seg.op, seg.positions, seg.values, seg.count,
            seg.pos_bytes.tobytes(), seg.val_bytes.tobytes())


def test_golden_v2_bytes_and_decode() -> None:
    assert encode_chunk(golden_segments(), compress=False).hex() == GOLDEN_V2.hex()
    assert frame_of(TABLE) == GOLDEN_V2
    got = decode_chunk(GOLDEN_V2, where=WHERE).segments
    assert [fields(s) for s in got] == [fields(s) for s in golden_segments()]


def random_segments(rng: np.random.Generator, n: int) -> list[Segment]:
    out = []
    for i in range(n):
        start = int(rng.integers(0, 1 << int(rng.integers(1, 60))))
        size = int(rng.integers(1, 1 << int(rng.integers(1, 40))))
        count = int(rng.integers(0, min(size, 1 << 20) + 1))
        plen, vlen = (int(x) for x in rng.integers(0, 300, 2))
        out.append(Segment(int(rng.integers(0, 1 << 31)) if i % 3 else i, start, start + size,
                           Op.XOR, Positions.GAPS, Values.VARINT, count,
                           rng.integers(0, 256, plen).astype(np.uint8),
                           rng.integers(0, 256, vlen).astype(np.uint8)))
    return out


@pytest.mark.parametrize("compress", [False, True])
def test_both_versions_decode_to_the_same_segments_and_v2_tables_are_smaller(compress: bool) -> None:
    rng = np.random.default_rng(7)
    segs = random_segments(rng, 200)
    v1 = encode_chunk(segs, compress=compress, version=1)
    v2 = encode_chunk(segs, compress=compress)
    d1, d2 = (decode_chunk(f, where=WHERE).segments for f in (v1, v2))
    assert [fields(s) for s in d1] == [fields(s) for s in d2] == [fields(s) for s in segs]
    table_len = HEADER.unpack_from(v2, 0)[4]
    assert table_len < 200 * 48 / 2, table_len  # random 60-bit ranges: the worst case for varints
    assert len(v1) - len(v2) == 200 * 48 - table_len


def test_the_largest_values_a_record_holds_roundtrip() -> None:
    seg = Segment(2**32 - 1, 2**64 - 2, 2**64 - 1, Op.XOR, Positions.GAPS, Values.VARINT, 1,
                  np.array([0], np.uint8), np.array([1], np.uint8))
    (got,) = decode_chunk(encode_chunk([seg]), where=WHERE).segments
    assert fields(got) == fields(seg)


def test_empty_v2_chunk() -> None:
    frame = encode_chunk([], compress=False)
    assert HEADER.unpack_from(frame, 0)[3:5] == (0, 0)
    assert decode_chunk(frame, where=WHERE).segments == ()


def test_a_writer_refuses_an_unknown_version() -> None:
    with pytest.raises(UsageError, match="chunk frame version 3"):
        encode_chunk(golden_segments(), version=3)


# record 1 of TABLE, varint by varint: tensor, coding, start, n−1, count, pos_len, val_len
SEG1 = bytes.fromhex("01440807020203")
SEG0 = TABLE[:7]

HOSTILE_TABLES: dict[str, tuple[bytes, dict[str, int], str]] = {
    "table too short for its records": (TABLE[:13], {"table_len": 13},
                                        "table of 13 bytes cannot hold 2 records"),
    "table too long for its records": (TABLE + b"\0" * 109, {},
                                       "table of 123 bytes cannot hold 2 records"),
    "bytes left after the records": (TABLE + b"\0", {}, "1 bytes left in the segment table"),
    "table ends inside a varint": (SEG0 + bytes.fromhex("0144080702") + b"\x83" + b"\x80",
                                   {}, "segment 1: the segment table ends inside a varint"),
    "varint not in its shortest form": (SEG0 + bytes.fromhex("8100440807020203"), {},
                                        "segment 1: a varint .* not in its shortest form"),
    "varint over 10 bytes": (SEG0 + b"\x81" * 10 + bytes.fromhex("01440807020203")[1:], {},
                             "segment 1: a varint .* over 10 bytes"),
    "varint at 2^64": (SEG0 + b"\x80" * 9 + b"\x02" + bytes.fromhex("440807020203"), {},
                       "segment 1: a varint .* above 2"),
    "range end past 2^64 − 1": (SEG0 + bytes.fromhex("0144") + b"\xff" * 9 + b"\x01"
                                + bytes.fromhex("07020203"), {}, "segment 1: tensor 1 or range end"),
    "tensor past u32": (SEG0 + bytes.fromhex("8080808010") + SEG1[1:], {},
                        "segment 1: tensor 4294967296"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TABLES))
def test_hostile_v2_tables_are_refused(name: str) -> None:
    table, header, match = HOSTILE_TABLES[name]
    with pytest.raises(FormatError, match=f"{WHERE}.*{match}"):
        decode_chunk(frame_of(table, **header), where=WHERE)


@pytest.mark.parametrize(("coding", "kind", "value"), [
    (0x40 | 6 << 2, "Positions", 6),  # xor, positions id 6 (bits 2..4), varint values
    (0x04, "Values", 0),  # values id 0
    (0x04 | 7 << 5, "Values", 7),
])
def test_unknown_coding_ids_in_a_v2_record(coding: int, kind: str, value: int) -> None:
    table = SEG0 + bytes([1, coding]) + SEG1[2:]
    with pytest.raises(UnknownCodecError, match=f"{WHERE} segment 1: unknown {kind} id {value}"):
        decode_chunk(frame_of(table), where=WHERE)


def test_the_record_checks_both_versions_share_apply_to_v2() -> None:
    # start 16, n 1: [16, 17) with count 2 > 1
    with pytest.raises(FormatError, match=f"{WHERE} segment 1: bad range"):
        decode_chunk(frame_of(SEG0 + bytes.fromhex("01441000020203")), where=WHERE)
    # the streams no longer add up to the header's raw length
    with pytest.raises(FormatError, match="segment streams total 14"):
        decode_chunk(frame_of(SEG0 + bytes.fromhex("01440807020204")), where=WHERE)
    # a table length that leaves the frame's lengths unbalanced
    with pytest.raises(FormatError, match="do not add up"):
        decode_chunk(frame_of(TABLE, table_len=15), where=WHERE)


def test_hostile_segment_counts_are_refused_before_the_table_is_read() -> None:
    with pytest.raises(chunk_mod.LimitError, match="segments, limit"):
        decode_chunk(frame_of(TABLE, nseg=chunk_mod.MAX_SEGMENTS + 1), where=WHERE)
    with pytest.raises(FormatError, match="cannot hold 3 records"):
        decode_chunk(frame_of(TABLE, nseg=3), where=WHERE)


def test_a_publisher_refuses_an_unknown_frame_version_before_writing() -> None:
    from weighthub.codec import EncodePolicy
    from weighthub.publish import Publisher
    from weighthub.store import MemoryStore

    store = MemoryStore()
    with pytest.raises(UsageError, match=r"EncodePolicy\(frame_version=3\)"):
        Publisher(store, policy=EncodePolicy(frame_version=3))
    assert store.children("") == []
