"""Chunk frames: a self-describing, checksummed container of segments (see spec.md).

    header   32 bytes   magic, format version, flags, segment count, table and body lengths
    table    version 2: one varint record per segment (~10-14 bytes); version 1: 48 bytes each
    body     zstd-1 (or raw) of: every segment's position stream, then every value stream
    trailer  8 bytes    xxh3-64 of everything before it

Everything declared in the header and table is checked against limits and against each other
before any buffer of that size is allocated or decompressed. The decompressed size is capped by
the caller's `max_body`: a receiver passes `body_bound`, what the chunk's coverage in its
manifest admits, so a frame declaring a 1 GiB body for a few KiB of words is refused
(LimitError) before anything is allocated for it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash
import zstandard

from ..codec.coding import CONTEXT_CODINGS, Op, Positions, Values, check_coding, parse_enum
from ..codec.segment import Segment
from ..errors import ChecksumError, FormatError, FormatVersionError, LimitError, UsageError
from . import table_kernel

MAGIC = b"WHCK"
FORMAT_VERSION = 2  # what writers emit unless told otherwise
READ_VERSIONS = (1, 2)
FLAG_ZSTD = 1

# magic, version, flags, nseg, table_len (version 2; reserved in version 1), raw_len, stored_len
_HEADER = struct.Struct("<4sHHIIQQ")
# version 1 record: tensor, op, pos, val, reserved, start, stop, count, plen, vlen
_SEGMENT = struct.Struct("<IBBBBQQQQQ")
_TRAILER = struct.Struct("<Q")
assert _HEADER.size == 32 and _SEGMENT.size == 48
# version 2 record: varint tensor, one coding byte, varints start, n − 1, count, plen, vlen
_V2_FIELDS = 6
MIN_RECORD_V2 = 1 + _V2_FIELDS  # every varint at its shortest
MAX_RECORD_V2 = 1 + 10 * _V2_FIELDS

MAX_SEGMENTS = 1 << 20
MAX_BODY_BYTES = 4 << 30  # decompressed body of one chunk
ZSTD_LEVEL = 1
MAX_VARINT_BYTES = 10  # readers refuse a longer varint (spec §2)


def body_bound(words: list[tuple[int, int]], frame_size: int, *, full: bool) -> int:
    """The largest decompressed body a reader accepts for a chunk covering `words`:
    (elements, bytes per element) pairs, one per covered range or box, of a frame of
    `frame_size` bytes (its manifest's size). Capped at MAX_BODY_BYTES.

    A full representation's chunk holds dense words only, exactly its coverage: Σ n·W (plus
    frame_size, so a body only slightly off is left to the segment checks, which say precisely
    what is wrong). A delta's segment spends, per element of its range at most, one position
    varint, one value (a W-byte word or a varint) and, with exponent-grouped positions, one
    (key, count) pair of varints (a group holds at least one element), plus one varint (the
    group count) per segment, of which the frame's table holds at most frame_size / 7 (the
    shortest version-2 record).
    """
    if full:
        total = sum(n * w for n, w in words) + frame_size
    else:
        total = sum(n * (3 * MAX_VARINT_BYTES + max(w, MAX_VARINT_BYTES)) for n, w in words)
        total += MAX_VARINT_BYTES * (frame_size // MIN_RECORD_V2)
    return min(total, MAX_BODY_BYTES)


@dataclass(frozen=True, slots=True)
class ChunkFrame:
    segments: tuple[Segment, ...]
    # a decoded frame's body and where each segment's streams lie in it (int64 [n, 2]: the
    # position and value streams' byte offsets), for kernels that reach the streams of many
    # segments through one address (reading each array's costs ~1.4 µs); None when built
    body: np.ndarray | None = None
    stream_offsets: np.ndarray | None = None


def encode_chunk(segments: list[Segment], *, compress: bool | None = None,
                 version: int = FORMAT_VERSION) -> bytes:
    """Serialize segments into one chunk frame.

    compress: zstd the body; None (the default) does unless nearly all of it is context-coded
    streams, which are already at their entropy and would only cost zstd's time.
    version: 2 (varint segment records, the default) or 1, for receivers older than version 2
    during a rolling upgrade (records of 48 bytes: 5% of a delta of a model with many small
    tensors at a low change rate).
    """
    if version not in READ_VERSIONS:
        raise UsageError(f"chunk frame version {version!r}: writers emit {READ_VERSIONS}")
    table = _table_v2(segments) if version == 2 else b"".join(
        _SEGMENT.pack(s.tensor, s.op, s.positions, s.values, 0, s.start, s.stop, s.count,
                      s.pos_bytes.size, s.val_bytes.size) for s in segments)
    streams = [s.pos_bytes for s in segments] + [s.val_bytes for s in segments]
    raw_len = sum(x.size for x in streams)
    if raw_len > MAX_BODY_BYTES:
        raise LimitError(f"chunk body of {raw_len} bytes exceeds the {MAX_BODY_BYTES} limit; "
                         "use a smaller chunk span")
    if compress is None:
        coded = sum(s.pos_bytes.size + s.val_bytes.size for s in segments
                    if s.positions in CONTEXT_CODINGS)
        compress = coded == 0 or coded * 8 < raw_len * 7
    if compress:
        cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
        chunker = cctx.chunker(size=raw_len)
        parts = [bytes(p) for x in streams if x.size for p in chunker.compress(x.data)]
        parts += [bytes(p) for p in chunker.finish()]
        body = b"".join(parts)
    else:
        body = b"".join(x.tobytes() for x in streams)
    header = _HEADER.pack(MAGIC, version, FLAG_ZSTD if compress else 0, len(segments),
                          len(table) if version == 2 else 0, raw_len, len(body))
    out = b"".join((header, table, body))
    return out + _TRAILER.pack(xxhash.xxh3_64_intdigest(out))


def _table_v2(segments: list[Segment]) -> bytes:
    out = bytearray()
    for s in segments:
        values = (s.start, s.stop - s.start - 1, s.count, s.pos_bytes.size, s.val_bytes.size)
        if not (0 <= s.tensor < 1 << 32 and s.stop < 1 << 64 and min(values) >= 0
                and 1 <= s.op <= 4 and 0 <= s.positions < 8 and 0 <= s.values < 8):
            raise OverflowError(f"segment of tensor {s.tensor} [{s.start}, {s.stop}) count "
                                f"{s.count} coding {s.op}/{s.positions}/{s.values}: a field "
                                "outside what a version-2 record holds")
        _put_varint(out, s.tensor)
        out.append((s.op - 1) | s.positions << 2 | s.values << 5)
        for v in values:
            _put_varint(out, v)
    return bytes(out)


def _put_varint(out: bytearray, v: int) -> None:
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def _records_v1(mv: memoryview, nseg: int) -> list[tuple[int, ...]]:
    return [_SEGMENT.unpack_from(mv, _HEADER.size + i * _SEGMENT.size) for i in range(nseg)]


def _records_v2(table: bytes, nseg: int, where: str) -> list[tuple[int, ...]]:
    """The version-2 table as version-1 record tuples; strict (spec §1 "Segment table, v2")."""
    fields = np.empty((nseg, table_kernel.FIELDS), np.uint64)
    done, error, off = table_kernel.parse_records(np.frombuffer(table, np.uint8), nseg, fields)
    if error == table_kernel.OUT_OF_RANGE:
        tensor, _coding, start, n_minus_1 = fields[done, :4].tolist()
        raise FormatError(f"{where} segment {done}: tensor {tensor} or range end "
                          f"{start + n_minus_1 + 1} out of the format's range (u32, u64)")
    if error:
        raise FormatError(f"{where} segment {done}: " + _TABLE_ERRORS[error])
    out: list[tuple[int, ...]] = []
    for tensor, coding, start, n_minus_1, count, plen, vlen in fields.tolist():
        out.append((tensor, (coding & 3) + 1, (coding >> 2) & 7, coding >> 5, 0, start,
                    start + n_minus_1 + 1, count, plen, vlen))
    if off != len(table):
        raise FormatError(f"{where}: {len(table) - off} bytes left in the segment table after "
                          f"{nseg} records")
    return out


_TABLE_ERRORS = {
    table_kernel.ENDS_IN_RECORD: "the segment table ends inside the record",
    table_kernel.ENDS_IN_VARINT: "the segment table ends inside a varint",
    table_kernel.NOT_SHORTEST: "a varint in the segment table is not in its shortest form",
    table_kernel.TOO_LONG: "a varint in the segment table is over 10 bytes or above 2^64 − 1",
}


def _accepted_codings() -> dict[tuple[int, int, int], tuple[Op, Positions, Values]]:
    """Every (op, positions, values) id triple `check_coding` accepts, as enums."""
    out = {}
    for op in Op:
        for pos in Positions:
            for val in Values:
                try:
                    check_coding(op, pos, val, "")
                except FormatError:
                    continue
                out[(int(op), int(pos), int(val))] = (op, pos, val)
    return out


_CODINGS = _accepted_codings()


def _check_record(op: Op, positions: Positions, values: Values, n: int, count: int, plen: int,
                  where: str) -> None:
    """Spec §1 step 8: the coding is one readers accept, and its stream lengths fit the range."""
    check_coding(op, positions, values, where)
    if op == Op.DENSE and (count != n or plen != 0):
        raise FormatError(f"{where}: a dense segment of {n} elements with count {count} and "
                          f"{plen} position bytes (must be {n} and 0)")
    if positions == Positions.BITMAP and plen != (n + 7) // 8:
        raise FormatError(f"{where}: bitmap of {plen} bytes for {n} elements")


def declared_body(buf: bytes | memoryview) -> int:
    """The decompressed body size a frame's header declares (0 for a buffer too short to
    hold a header: `decode_chunk` says what is wrong with it)."""
    if len(buf) < _HEADER.size:
        return 0
    return int(_HEADER.unpack_from(buf, 0)[5])


def decode_chunk(buf: bytes | memoryview, *, where: str, max_body: int = MAX_BODY_BYTES) -> ChunkFrame:
    """Parse and validate a chunk frame. Raises FormatError subclasses naming `where`.

    Stream contents (varints, positions) are validated later, by the kernels that apply them.
    Readers are strict: what spec.md §1–§2 forbids is refused here, never tolerated.
    """
    mv = memoryview(buf)
    if mv.nbytes < _HEADER.size + _TRAILER.size:
        raise FormatError(f"{where}: truncated chunk ({mv.nbytes} bytes, header needs "
                          f"{_HEADER.size + _TRAILER.size})")
    magic, version, flags, nseg, table_len, raw_len, stored_len = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise FormatError(f"{where}: not a weighthub chunk (magic {bytes(magic)!r})")
    if version not in READ_VERSIONS:
        raise FormatVersionError(f"{where}: chunk format version {version}; this build reads "
                                 f"{', '.join(map(str, READ_VERSIONS))}: upgrade weighthub")
    (stored_sum,) = _TRAILER.unpack_from(mv, mv.nbytes - _TRAILER.size)
    computed = xxhash.xxh3_64_intdigest(mv[: mv.nbytes - _TRAILER.size])
    if stored_sum != computed:
        raise ChecksumError(f"{where}: chunk checksum stored {stored_sum:016x}, computed "
                            f"{computed:016x}: the chunk is corrupt")
    if flags & ~FLAG_ZSTD:
        raise FormatError(f"{where}: unknown chunk flags {flags:#x}")
    if nseg > MAX_SEGMENTS:
        raise LimitError(f"{where}: {nseg} segments, limit {MAX_SEGMENTS}")
    if version == 1:
        table_len = nseg * _SEGMENT.size  # the field is reserved (ignored) in version 1
    elif not MIN_RECORD_V2 * nseg <= table_len <= MAX_RECORD_V2 * nseg:
        raise FormatError(f"{where}: a segment table of {table_len} bytes cannot hold {nseg} "
                          f"records ({MIN_RECORD_V2}..{MAX_RECORD_V2} bytes each)")
    table_end = _HEADER.size + table_len
    if table_end + stored_len + _TRAILER.size != mv.nbytes:
        raise FormatError(f"{where}: lengths do not add up: header {_HEADER.size} + table "
                          f"{table_len} + body {stored_len} + trailer != {mv.nbytes}")
    if raw_len > max_body:
        raise LimitError(f"{where}: body of {raw_len} bytes exceeds the limit {max_body} (the "
                         "format's, or what the chunk's coverage in its manifest admits); "
                         "refused before decompressing: the chunk is hostile or corrupt, "
                         "republish it")
    records = (_records_v1(mv, nseg) if version == 1
               else _records_v2(bytes(mv[_HEADER.size: table_end]), nseg, where))
    heads = []
    total = 0
    for i, f in enumerate(records):
        tensor, op, pos, val, _r, start, stop, count, plen, vlen = f
        coding = _CODINGS.get((op, pos, val))  # a combination readers accept, known
        if coding is None:  # or not: say which field is wrong
            seg_where = f"{where} segment {i}"
            coding = (Op(parse_enum(Op, op, seg_where)),
                      Positions(parse_enum(Positions, pos, seg_where)),
                      Values(parse_enum(Values, val, seg_where)))
            check_coding(*coding, seg_where)
        op_e, pos_e, val_e = coding
        if not start < stop or count > stop - start:
            raise FormatError(f"{where} segment {i}: bad range [{start}, {stop}) with count {count}")
        if (op_e == Op.DENSE and (count != stop - start or plen != 0)) \
                or (pos_e == Positions.BITMAP and plen != (stop - start + 7) // 8):
            _check_record(op_e, pos_e, val_e, stop - start, count, plen, f"{where} segment {i}")
        total += plen + vlen
        heads.append((tensor, op_e, pos_e, val_e, start, stop, count, plen, vlen))
    if total != raw_len:
        raise FormatError(f"{where}: segment streams total {total} bytes, header says {raw_len}")
    body = mv[table_end: table_end + stored_len]
    if flags & FLAG_ZSTD:
        try:
            params = zstandard.get_frame_parameters(body)
            if params.content_size != raw_len:
                raise FormatError(f"{where}: compressed body declares {params.content_size} "
                                  f"bytes, header says {raw_len}")
            raw: bytes | memoryview = zstandard.ZstdDecompressor().decompress(
                body, max_output_size=raw_len)
        except zstandard.ZstdError as exc:
            raise FormatError(f"{where}: body does not decompress: {exc}") from exc
        if len(raw) != raw_len:
            raise FormatError(f"{where}: body decompressed to {len(raw)} bytes, expected {raw_len}")
    else:
        if stored_len != raw_len:
            raise FormatError(f"{where}: raw body of {stored_len} bytes, header says {raw_len}")
        raw = body
    arr = np.frombuffer(raw, np.uint8)
    segments = []
    offsets = []
    off_pos = 0
    off_val = sum(h[7] for h in heads)
    for tensor, op_e, pos_e, val_e, start, stop, count, plen, vlen in heads:
        segments.append(Segment(tensor, start, stop, op_e, pos_e, val_e, count,
                                arr[off_pos: off_pos + plen], arr[off_val: off_val + vlen]))
        offsets.append((off_pos, off_val))
        off_pos += plen
        off_val += vlen
    return ChunkFrame(tuple(segments), arr, np.array(offsets, np.int64).reshape(-1, 2))
