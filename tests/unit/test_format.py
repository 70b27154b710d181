"""Chunk frames and manifests: golden bytes pin the wire format; hostile input gets a clear error.

Every hostile case must raise the most specific FormatError subclass, and name the place.
Checks that come after the checksum are reached by re-sealing the mutated frame.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
import tracemalloc

import msgspec
import numpy as np
import pytest
import xxhash
import zstandard

from weighthub.codec import Op, Positions, Segment, Values
from weighthub.errors import ChecksumError, FormatError, FormatVersionError, LimitError, UnknownCodecError
from weighthub.format import (
    ChunkRef,
    Manifest,
    TensorEntry,
    chunk_checksum,
    decode_chunk,
    decode_manifest,
    encode_chunk,
)
from weighthub.format import chunk as chunk_mod
from weighthub.format import manifest as manifest_mod
from weighthub.format.manifest import encode_manifest

WHERE = "memory://t/v000000000001/c000007.whc"
HEADER = struct.Struct("<4sHHIIQQ")
RECORD = struct.Struct("<IBBBBQQQQQ")


def golden_segments() -> list[Segment]:
    dense = np.array([1, 2, 0x8000, 0xFFFF], "<u2").view(np.uint8).copy()
    return [
        Segment(0, 0, 4, Op.DENSE, Positions.ALL, Values.RAW, 4, np.empty(0, np.uint8), dense),
        Segment(1, 8, 16, Op.XOR, Positions.GAPS, Values.VARINT, 2,
                np.array([1, 3], np.uint8), np.array([0x01, 0x80, 0x01], np.uint8)),
    ]


# GOLDEN is a version-1 frame: writers emit it with encode_chunk(version=1), every reader reads
# it, and the hostile cases below edit its fixed-size records; version 2 (varint records) is
# pinned and attacked in test_format_v2.py
GOLDEN = bytes.fromhex(
    # header: magic, version 1, flags 0, 2 segments, reserved, raw 13, stored 13
    "5748434b" "0100" "0000" "02000000" "00000000" "0d00000000000000" "0d00000000000000"
    # segment 0: tensor 0, dense/all/raw, [0, 4), count 4, pos_len 0, val_len 8
    "00000000" "04" "00" "01" "00" "0000000000000000" "0400000000000000" "0400000000000000"
    "0000000000000000" "0800000000000000"
    # segment 1: tensor 1, xor/gaps/varint, [8, 16), count 2, pos_len 2, val_len 3
    "01000000" "01" "01" "02" "00" "0800000000000000" "1000000000000000" "0200000000000000"
    "0200000000000000" "0300000000000000"
    # body: positions of seg 1 (gaps 1, 3 → elements 9, 13), then values of seg 0, seg 1
    "0103" "010002000080ffff" "018001"
    # trailer: xxh3-64 of everything above, little-endian
    "73d630eeaa72f366"
)
# the manifest's checksum of this frame (format 2: SHA-256), computed with hashlib
GOLDEN_SHA256 = "c05776ff0b0ae8480c30ea94f366e51586830676b1274b0fa3a70219a2bf2bcc"


def reseal(frame: bytes) -> bytes:
    """Recompute the trailer so a mutation reaches the checks after the checksum."""
    body = frame[:-8]
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def with_header(frame: bytes, **fields: int | bytes) -> bytes:
    names = ["magic", "version", "flags", "nseg", "reserved", "raw_len", "stored_len"]
    vals = dict(zip(names, HEADER.unpack_from(frame, 0), strict=True))
    vals.update(fields)
    return reseal(HEADER.pack(*(vals[n] for n in names)) + frame[HEADER.size:])


def with_record(frame: bytes, i: int, **fields: int) -> bytes:
    names = ["tensor", "op", "pos", "val", "reserved", "start", "stop", "count", "plen", "vlen"]
    off = HEADER.size + i * RECORD.size
    vals = dict(zip(names, RECORD.unpack_from(frame, off), strict=True))
    vals.update(fields)
    return reseal(frame[:off] + RECORD.pack(*(vals[n] for n in names)) + frame[off + RECORD.size:])


# --- golden bytes ----------------------------------------------------------------------------


def test_golden_chunk_bytes() -> None:
    frame = encode_chunk(golden_segments(), compress=False, version=1)
    assert frame.hex() == GOLDEN.hex()
    assert chunk_checksum(frame) == GOLDEN_SHA256 == hashlib.sha256(GOLDEN).hexdigest()


def test_golden_chunk_decodes() -> None:
    frame = decode_chunk(GOLDEN, where=WHERE)
    want = golden_segments()
    assert len(frame.segments) == 2
    for got, exp in zip(frame.segments, want, strict=True):
        assert (got.tensor, got.start, got.stop, got.op, got.positions, got.values, got.count) == (
            exp.tensor, exp.start, exp.stop, exp.op, exp.positions, exp.values, exp.count)
        assert got.pos_bytes.tobytes() == exp.pos_bytes.tobytes()
        assert got.val_bytes.tobytes() == exp.val_bytes.tobytes()


def test_compressed_roundtrip() -> None:
    segs = golden_segments()
    frame = encode_chunk(segs, compress=True, version=1)
    magic, version, flags, nseg, _r, raw_len, stored_len = HEADER.unpack_from(frame, 0)
    assert (magic, version, flags, nseg, raw_len) == (b"WHCK", 1, 1, 2, 13)
    body = frame[HEADER.size + 2 * RECORD.size: -8]
    assert len(body) == stored_len
    assert zstandard.get_frame_parameters(body).content_size == 13
    assert zstandard.ZstdDecompressor().decompress(body) == GOLDEN[HEADER.size + 2 * RECORD.size: -8]
    decoded = decode_chunk(frame, where=WHERE)
    assert [s.val_bytes.tobytes() for s in decoded.segments] == [s.val_bytes.tobytes() for s in segs]
    assert [s.pos_bytes.tobytes() for s in decoded.segments] == [s.pos_bytes.tobytes() for s in segs]


@pytest.mark.parametrize("compress", [False, True])
def test_empty_chunk_roundtrip(compress: bool) -> None:
    assert decode_chunk(encode_chunk([], compress=compress), where=WHERE).segments == ()


# --- hostile chunk frames --------------------------------------------------------------------


def test_truncated_frames_are_rejected() -> None:
    for cut in (0, 1, 39, len(GOLDEN) - 1, len(GOLDEN) - 9):
        with pytest.raises(FormatError, match=WHERE):
            decode_chunk(GOLDEN[:cut], where=WHERE)
    # truncated but re-sealed: the lengths no longer add up
    with pytest.raises(FormatError, match="do not add up"):
        decode_chunk(reseal(GOLDEN[:-9] + GOLDEN[-8:]), where=WHERE)


def test_bad_magic() -> None:
    with pytest.raises(FormatError, match=f"{WHERE}.*not a weighthub chunk"):
        decode_chunk(with_header(GOLDEN, magic=b"WHCX"), where=WHERE)


def test_unknown_format_version() -> None:
    for frame in (with_header(GOLDEN, version=3), GOLDEN[:4] + b"\x03\x00" + GOLDEN[6:]):
        with pytest.raises(FormatVersionError, match=f"{WHERE}.*version 3; this build reads 1, 2"):
            decode_chunk(frame, where=WHERE)


@pytest.mark.parametrize("offset", [0 + 12, 40, 100, len(GOLDEN) - 10, len(GOLDEN) - 1])
def test_checksum_flip(offset: int) -> None:
    bad = bytearray(GOLDEN)
    bad[offset] ^= 0x10
    with pytest.raises(ChecksumError, match=f"{WHERE}.*checksum"):
        decode_chunk(bytes(bad), where=WHERE)


@pytest.mark.parametrize(("field", "value", "kind"), [
    ("op", 0, "Op"), ("op", 9, "Op"), ("pos", 6, "Positions"), ("val", 0, "Values"), ("val", 200, "Values"),
])
def test_unknown_codec_ids(field: str, value: int, kind: str) -> None:
    with pytest.raises(UnknownCodecError, match=f"{WHERE} segment 1: unknown {kind} id {value}"):
        decode_chunk(with_record(GOLDEN, 1, **{field: value}), where=WHERE)


def test_unknown_flags() -> None:
    with pytest.raises(FormatError, match="flags"):
        decode_chunk(with_header(GOLDEN, flags=0x4), where=WHERE)


def _peak_alloc(fn) -> int:
    tracemalloc.start()
    with contextlib.suppress(FormatError):
        fn()
    _cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


@pytest.mark.parametrize("nseg", [chunk_mod.MAX_SEGMENTS + 1, 2**32 - 1])
def test_segment_count_over_limit_is_refused_before_allocation(nseg: int) -> None:
    frame = with_header(GOLDEN, nseg=nseg)
    with pytest.raises(LimitError, match=f"{WHERE}: {nseg} segments"):
        decode_chunk(frame, where=WHERE)
    assert _peak_alloc(lambda: decode_chunk(frame, where=WHERE)) < 1 << 20


def test_raw_length_over_limit_is_refused_before_decompression() -> None:
    compressed = encode_chunk(golden_segments(), compress=True, version=1)
    for raw_len in (2**40, 2**64 - 1):
        frame = with_header(compressed, raw_len=raw_len)
        with pytest.raises(LimitError, match=f"{WHERE}: body of {raw_len} bytes"):
            decode_chunk(frame, where=WHERE)
        assert _peak_alloc(lambda f=frame: decode_chunk(f, where=WHERE)) < 1 << 20
    with pytest.raises(LimitError, match="exceeds the limit 12"):
        decode_chunk(compressed, where=WHERE, max_body=12)
    assert len(decode_chunk(compressed, where=WHERE, max_body=13).segments) == 2


def test_lengths_that_do_not_add_up() -> None:
    cases = {
        "stored_len too large": with_header(GOLDEN, stored_len=14),
        "stored_len too small": with_header(GOLDEN, stored_len=12),
        "stored_len huge": with_header(GOLDEN, stored_len=2**64 - 1),
        "nseg too small": with_header(GOLDEN, nseg=1),
        "extra byte": reseal(GOLDEN[:-8] + b"\x00" + GOLDEN[-8:]),
    }
    for name, frame in cases.items():
        with pytest.raises(FormatError, match="do not add up"):
            decode_chunk(frame, where=WHERE)
        del name
    # streams vs header raw length
    for frame in (with_record(GOLDEN, 1, vlen=4), with_record(GOLDEN, 1, plen=2**63),
                  with_header(GOLDEN, raw_len=12)):
        with pytest.raises(FormatError, match=f"{WHERE}: segment streams total"):
            decode_chunk(frame, where=WHERE)
    # raw body whose stored length is not its raw length
    moved = with_record(with_record(with_header(GOLDEN, raw_len=14), 1, vlen=4), 0, plen=0)
    with pytest.raises(FormatError, match=WHERE):
        decode_chunk(moved, where=WHERE)


@pytest.mark.parametrize(("fields", "match"), [
    ({"start": 16, "stop": 16}, "bad range"),
    ({"start": 17, "stop": 16}, "bad range"),
    ({"count": 9}, "bad range"),
])
def test_bad_segment_ranges(fields: dict[str, int], match: str) -> None:
    with pytest.raises(FormatError, match=f"{WHERE} segment 1: {match}"):
        decode_chunk(with_record(GOLDEN, 1, **fields), where=WHERE)


# Codings no writer emits and the spec (§1 step 8, §2) forbids: refused by decode_chunk, each
# naming the segment. Record 0 of GOLDEN is dense/all/raw [0, 4); record 1 xor/gaps/varint [8, 16).
FORBIDDEN_RECORDS = {
    "all positions on a sparse op": (1, {"pos": 0}, "positions 'all' with op xor"),
    "dense with gaps positions": (0, {"pos": 1}, "must be coded dense/all/raw"),
    "dense with varint values": (0, {"val": 2}, "must be coded dense/all/raw"),
    "xor with zigzag values": (1, {"val": 3}, "op xor with zigzag values"),
    "add with varint values": (1, {"op": 2}, "op add with varint values"),
    "overwrite with varint values": (1, {"op": 3}, "op overwrite with varint values"),
    "dense with a short count": (0, {"count": 3}, "a dense segment of 4 elements with count 3"),
    "dense with position bytes": (0, {"plen": 2}, "a dense segment of 4 elements with count 4 "
                                  "and 2 position bytes"),
    "bitmap of the wrong size": (1, {"pos": 3}, "bitmap of 2 bytes for 8 elements"),
}


@pytest.mark.parametrize("name", sorted(FORBIDDEN_RECORDS))
def test_codings_the_spec_forbids_are_refused(name: str) -> None:
    i, fields, match = FORBIDDEN_RECORDS[name]
    frame = with_record(GOLDEN, i, **fields)
    if "plen" in fields:  # keep the streams' total consistent so the record check is what fails
        frame = with_record(frame, 1, plen=0)
    with pytest.raises(FormatError, match=f"{WHERE} segment {i}: .*{match}"):
        decode_chunk(frame, where=WHERE)


@pytest.mark.parametrize(("op", "values"), [(Op.XOR, Values.RAW), (Op.ADD, Values.RAW)])
def test_raw_values_on_xor_and_add_are_a_stated_leniency(op: Op, values: Values) -> None:
    frame = with_record(GOLDEN, 1, op=op, val=values)
    seg = decode_chunk(frame, where=WHERE).segments[1]
    assert (seg.op, seg.values) == (op, values)


def test_reserved_fields_are_ignored_on_read() -> None:
    frame = with_record(with_header(GOLDEN, reserved=7), 1, reserved=9)
    assert [s.pos_bytes.tobytes() for s in decode_chunk(frame, where=WHERE).segments] == \
        [s.pos_bytes.tobytes() for s in decode_chunk(GOLDEN, where=WHERE).segments]


def _compressed_with_body(body: bytes, raw_len: int = 13) -> bytes:
    table = GOLDEN[HEADER.size: HEADER.size + 2 * RECORD.size]
    head = HEADER.pack(b"WHCK", 1, 1, 2, 0, raw_len, len(body))
    return reseal(head + table + body + b"\0" * 8)


def test_zstd_body_whose_content_size_disagrees() -> None:
    raw = GOLDEN[HEADER.size + 2 * RECORD.size: -8]
    assert decode_chunk(_compressed_with_body(zstandard.compress(raw, 1)), where=WHERE).segments
    longer = zstandard.ZstdCompressor(level=1).compress(raw + b"\0")
    with pytest.raises(FormatError, match=f"{WHERE}: compressed body declares 14 bytes, header says 13"):
        decode_chunk(_compressed_with_body(longer), where=WHERE)
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(raw)
    with pytest.raises(FormatError, match=f"{WHERE}: compressed body declares"):
        decode_chunk(_compressed_with_body(unsized), where=WHERE)
    with pytest.raises(FormatError, match=f"{WHERE}: body does not decompress"):
        decode_chunk(_compressed_with_body(b"\x01" * 20), where=WHERE)
    # a frame header that promises 13 bytes but whose block holds fewer
    lying = bytearray(zstandard.compress(raw, 1))
    truncated = bytes(lying[:-3])
    with pytest.raises(FormatError, match=WHERE):
        decode_chunk(_compressed_with_body(truncated), where=WHERE)


# --- manifests -------------------------------------------------------------------------------

MANIFEST = Manifest(
    format=2, kind="weighthub.manifest", model="0" * 32, version=3, base=2, base_root="1" * 32,
    root="2" * 32,
    tensors=[TensorEntry("a", "BF16", [2, 2], "3" * 32, 1, ["xor/gaps/varint"]),
             TensorEntry("b", "I64", [3], "4" * 32)],
    chunks=[ChunkRef("v000000000003/from-000000000002-abc/c000000.whc", 123, "5" * 64,
                     [(0, 0, 4), (1, 0, 3)])],
    dense_bytes=32, payload_bytes=123, changed=1, publisher="p", created=1.5,
)
MANIFEST_JSON = (
    b'{"format":2,"kind":"weighthub.manifest","model":"00000000000000000000000000000000",'
    b'"version":3,"base":2,"base_root":"11111111111111111111111111111111",'
    b'"root":"22222222222222222222222222222222","tensors":[{"name":"a","dtype":"BF16",'
    b'"shape":[2,2],"digest":"33333333333333333333333333333333","changed":1,'
    b'"ops":["xor/gaps/varint"]},{"name":"b","dtype":"I64","shape":[3],'
    b'"digest":"44444444444444444444444444444444","changed":0,"ops":[]}],'
    b'"chunks":[{"key":"v000000000003/from-000000000002-abc/c000000.whc","size":123,'
    b'"checksum":"5555555555555555555555555555555555555555555555555555555555555555",'
    b'"covers":[[0,0,4],[1,0,3]]}],'
    b'"dense_bytes":32,"payload_bytes":123,"changed":1,"publisher":"p","created":1.5}'
)
MWHERE = "memory://t/v000000000003/manifest.json"


def test_manifest_golden_json_and_roundtrip() -> None:
    assert encode_manifest(MANIFEST) == MANIFEST_JSON
    assert decode_manifest(MANIFEST_JSON, where=MWHERE) == MANIFEST
    full = msgspec.structs.replace(MANIFEST, base=None, base_root=None)
    assert decode_manifest(encode_manifest(full), where=MWHERE).is_full


def _with_chunks(*covers: list[tuple[int, int, int]]) -> Manifest:
    return msgspec.structs.replace(MANIFEST, chunks=[
        ChunkRef(f"v3/c{i}.whc", 10, "5" * 64, list(c)) for i, c in enumerate(covers)])


def _with_tensor(**fields) -> Manifest:
    return msgspec.structs.replace(MANIFEST, tensors=[
        msgspec.structs.replace(MANIFEST.tensors[0], **fields), MANIFEST.tensors[1]])


def _json(m: Manifest) -> bytes:
    return encode_manifest(m)


def _edit(**fields) -> bytes:
    obj = msgspec.json.decode(MANIFEST_JSON)
    obj.update(fields)
    return msgspec.json.encode(obj)


HOSTILE_MANIFESTS = {
    "not json": (b"{not json", FormatError, "not valid JSON"),
    "empty": (b"", FormatError, "not valid JSON"),
    "a list": (b"[1, 2]", FormatError, "not a weighthub manifest"),
    "wrong kind": (_edit(kind="weighthub.chunk"), FormatError, "not a weighthub manifest"),
    "unknown format": (_edit(format=3), FormatVersionError, "manifest format 3.*upgrade"),
    "format 1 (xxh3 digests)": (_edit(format=1), FormatVersionError, "format 1 was written by an older"),
    "unknown field": (_edit(extra=1), FormatError, "invalid manifest"),
    "wrong type": (_edit(version="3"), FormatError, "invalid manifest"),
    "bad root hex": (_json(msgspec.structs.replace(MANIFEST, root="Z" * 32)), FormatError, "128-bit hex"),
    "short model": (_json(msgspec.structs.replace(MANIFEST, model="0" * 31)), FormatError, "128-bit hex"),
    "bad base_root": (_json(msgspec.structs.replace(MANIFEST, base_root="x")), FormatError, "128-bit hex"),
    "bad tensor digest": (_json(_with_tensor(digest="3" * 31 + "G")), FormatError, "digest"),
    "upper-case digest": (_json(_with_tensor(digest="A" * 32)), FormatError, "digest"),
    "bad chunk checksum": (_json(msgspec.structs.replace(MANIFEST, chunks=[msgspec.structs.replace(
        MANIFEST.chunks[0], checksum="5" * 16)])), FormatError, "bad size or checksum"),
    "xxh3-sized chunk checksum": (_json(msgspec.structs.replace(MANIFEST, chunks=[
        msgspec.structs.replace(MANIFEST.chunks[0], checksum="5" * 32)])), FormatError,
        "bad size or checksum"),
    "zero chunk size": (_json(msgspec.structs.replace(MANIFEST, chunks=[msgspec.structs.replace(
        MANIFEST.chunks[0], size=0)])), FormatError, "bad size or checksum"),
    "coverage gap": (_json(_with_chunks([(0, 0, 3), (1, 0, 3)])), FormatError, "cover 3 of 4"),
    "coverage missing tensor": (_json(_with_chunks([(0, 0, 4)])), FormatError, "cover 0 of 3"),
    "coverage overlap": (_json(_with_chunks([(0, 0, 2), (1, 0, 3)], [(0, 1, 3)])), FormatError, "overlaps"),
    "coverage double": (_json(_with_chunks([(0, 0, 4), (1, 0, 3)], [(0, 0, 4)])), FormatError,
                        "cover 8 of 4"),
    "cover past end": (_json(_with_chunks([(0, 0, 5), (1, 0, 3)])), FormatError, "bad range"),
    "cover empty": (_json(_with_chunks([(0, 2, 2), (0, 0, 4), (1, 0, 3)])), FormatError, "bad range"),
    "cover bad tensor": (_json(_with_chunks([(0, 0, 4), (1, 0, 3), (2, 0, 1)])), FormatError, "bad range"),
    "cover negative": (_json(_with_chunks([(0, -1, 4), (1, 0, 3)])), FormatError, "bad range"),
    "key with ..": (_json(msgspec.structs.replace(MANIFEST, chunks=[msgspec.structs.replace(
        MANIFEST.chunks[0], key="v3/../../etc/passwd")])), FormatError, "chunk key"),
    "absolute key": (_json(msgspec.structs.replace(MANIFEST, chunks=[msgspec.structs.replace(
        MANIFEST.chunks[0], key="/etc/passwd")])), FormatError, "chunk key"),
    "empty key segment": (_json(msgspec.structs.replace(MANIFEST, chunks=[msgspec.structs.replace(
        MANIFEST.chunks[0], key="v3//c.whc")])), FormatError, "chunk key"),
    "dot key segment": (_json(msgspec.structs.replace(MANIFEST, chunks=[msgspec.structs.replace(
        MANIFEST.chunks[0], key="./c.whc")])), FormatError, "chunk key"),
    "repeated key": (_json(msgspec.structs.replace(MANIFEST, chunks=[
        ChunkRef("v3/c.whc", 10, "5" * 64, [(0, 0, 4)]), ChunkRef("v3/c.whc", 10, "5" * 64, [(1, 0, 3)])])),
        FormatError, "chunk key"),
    "negative shape": (_json(_with_tensor(shape=[-2, -2])), FormatError, "bad shape"),
    "too many dims": (_json(_with_tensor(shape=[1] * 17)), FormatError, "bad shape"),
    "too many elements": (_json(_with_tensor(shape=[1 << 25, 1 << 24])), LimitError, "elements"),
    "unknown dtype": (_json(_with_tensor(dtype="F4")), UnknownCodecError, "unknown dtype 'F4'"),
    "repeated name": (_json(_with_tensor(name="b")), FormatError, "empty or repeated"),
    "empty name": (_json(_with_tensor(name="")), FormatError, "empty or repeated"),
    "base not before version": (_json(msgspec.structs.replace(MANIFEST, base=3)), FormatError, "base 3"),
    "negative version": (_json(msgspec.structs.replace(MANIFEST, version=-1, base=None, base_root=None)),
                         FormatError, "version -1"),
    "base without base_root": (_json(msgspec.structs.replace(MANIFEST, base_root=None)), FormatError,
                               "base_root"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_MANIFESTS))
def test_hostile_manifest(name: str) -> None:
    buf, cls, match = HOSTILE_MANIFESTS[name]
    with pytest.raises(cls, match=match) as info:
        decode_manifest(buf, where=MWHERE)
    assert type(info.value) is cls
    if name != "unknown dtype":
        assert MWHERE in str(info.value)


def test_unknown_dtype_error_names_the_manifest() -> None:
    with pytest.raises(UnknownCodecError, match=MWHERE):
        decode_manifest(HOSTILE_MANIFESTS["unknown dtype"][0], where=MWHERE)


def test_manifest_too_large(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", len(MANIFEST_JSON) - 1)
    with pytest.raises(LimitError, match=f"{MWHERE}: manifest of {len(MANIFEST_JSON)} bytes"):
        decode_manifest(MANIFEST_JSON, where=MWHERE)


def test_manifest_too_many_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest_mod, "MAX_TENSORS", 1)
    with pytest.raises(LimitError, match=MWHERE):
        decode_manifest(MANIFEST_JSON, where=MWHERE)


# --- box coverage (a trainer rank's strided shard) ----------------------------------------------

def _with_boxes(*chunks: tuple[list[tuple[int, int, int]], list[tuple[int, list[int], list[int]]]]
                ) -> Manifest:
    """MANIFEST whose chunks cover (ranges, boxes); tensor 'a' is [2, 2], 'b' is [3]."""
    return msgspec.structs.replace(MANIFEST, chunks=[
        ChunkRef(f"v3/c{i}.whc", 10, "5" * 64, list(r), list(b)) for i, (r, b) in enumerate(chunks)])


COLUMNS = _with_boxes(([(1, 0, 3)], [(0, [0, 0], [2, 1])]), ([], [(0, [0, 1], [2, 1])]))


def test_box_coverage_roundtrips_and_box_free_json_has_no_boxes_field() -> None:
    buf = encode_manifest(COLUMNS)
    assert b'"covers":[[1,0,3]],"boxes":[[0,[0,0],[2,1]]]}' in buf
    assert b'"covers":[],"boxes":[[0,[0,1],[2,1]]]}' in buf
    assert decode_manifest(buf, where=MWHERE) == COLUMNS
    assert b"boxes" not in MANIFEST_JSON  # pinned by the golden bytes above


HOSTILE_BOXES = {
    "box past the end": (_with_boxes(([(1, 0, 3)], [(0, [0, 1], [2, 2])])), FormatError, "bad box"),
    "box negative offset": (_with_boxes(([(1, 0, 3)], [(0, [-1, 0], [2, 2])])), FormatError, "bad box"),
    "box empty dim": (_with_boxes(([(1, 0, 3)], [(0, [0, 0], [0, 2]), (0, [0, 0], [2, 2])])),
                      FormatError, "bad box"),
    "box wrong rank": (_with_boxes(([(1, 0, 3)], [(0, [0], [4])])), FormatError, "bad box"),
    "box bad tensor": (_with_boxes(([(1, 0, 3)], [(0, [0, 0], [2, 2]), (2, [0], [1])])),
                       FormatError, "bad box"),
    "box gap": (_with_boxes(([(1, 0, 3)], [(0, [0, 0], [2, 1])])), FormatError, "cover 2 of 4"),
    "box double": (_with_boxes(([(1, 0, 3)], [(0, [0, 0], [2, 2])]), ([], [(0, [0, 0], [2, 2])])),
                   FormatError, "cover 8 of 4"),
    # same volume as the tensor: one element twice, another never
    "box overlap": (_with_boxes(([(1, 0, 3)], [(0, [0, 0], [1, 2])]), ([], [(0, [0, 1], [2, 1])])),
                    FormatError, "overlap in tensor 'a'"),
    "ranges and boxes mixed": (_with_boxes(([(1, 0, 3), (0, 1, 2), (0, 3, 4)], [(0, [0, 0], [2, 1])])),
                               FormatError, "both ranges and boxes"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_BOXES))
def test_hostile_box_coverage(name: str) -> None:
    m, cls, match = HOSTILE_BOXES[name]
    with pytest.raises(cls, match=match) as info:
        decode_manifest(_json(m), where=MWHERE)
    assert type(info.value) is cls and MWHERE in str(info.value)


def test_malformed_boxes_are_refused() -> None:
    obj = msgspec.json.decode(encode_manifest(COLUMNS))
    obj["chunks"][0]["boxes"] = [[0, 0, 2]]  # a range where a box belongs
    with pytest.raises(FormatError, match="invalid manifest"):
        decode_manifest(msgspec.json.encode(obj), where=MWHERE)


def _grid_manifest(boxes: list[tuple[list[int], list[int]]]) -> bytes:
    tensors = [TensorEntry("g", "BF16", [6, 8, 10], "3" * 32)]
    chunks = [ChunkRef(f"v3/c{i}.whc", 10, "5" * 64, [], [(0, o, s)]) for i, (o, s) in enumerate(boxes)]
    return _json(msgspec.structs.replace(MANIFEST, tensors=tensors, chunks=chunks))


def test_a_grid_of_boxes_tiles_and_a_moved_box_overlaps() -> None:
    grid = [([a, b, c], [2, 4, 5]) for a in (0, 2, 4) for b in (0, 4) for c in (0, 5)]
    assert len(decode_manifest(_grid_manifest(grid), where=MWHERE).chunks) == 12
    moved = list(grid)
    moved[7] = ([4, 4, 5], [2, 4, 5])  # onto the last box: same volume, one hole left behind
    with pytest.raises(FormatError, match=r"overlap in tensor 'g'"):
        decode_manifest(_grid_manifest(moved), where=MWHERE)
