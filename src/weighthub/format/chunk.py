"""Chunk frames: a self-describing, checksummed container of segments (see spec.md).

    header   32 bytes   magic, format version, flags, segment count, body lengths
    table    48 bytes × segment count
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

from ..codec.coding import Op, Positions, Values, check_coding, parse_enum
from ..codec.segment import Segment
from ..errors import ChecksumError, FormatError, FormatVersionError, LimitError

MAGIC = b"WHCK"
FORMAT_VERSION = 1
FLAG_ZSTD = 1

_HEADER = struct.Struct("<4sHHIIQQ")  # magic, version, flags, nseg, reserved, raw_len, stored_len
_SEGMENT = struct.Struct("<IBBBBQQQQQ")  # tensor, op, pos, val, reserved, start, stop, count, plen, vlen
_TRAILER = struct.Struct("<Q")
assert _HEADER.size == 32 and _SEGMENT.size == 48

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
    group count) per segment, of which the frame's table holds at most frame_size / 48.
    """
    if full:
        total = sum(n * w for n, w in words) + frame_size
    else:
        total = sum(n * (3 * MAX_VARINT_BYTES + max(w, MAX_VARINT_BYTES)) for n, w in words)
        total += MAX_VARINT_BYTES * (frame_size // _SEGMENT.size)
    return min(total, MAX_BODY_BYTES)


@dataclass(frozen=True, slots=True)
class ChunkFrame:
    segments: tuple[Segment, ...]


def encode_chunk(segments: list[Segment], *, compress: bool | None = None) -> bytes:
    """Serialize segments into one chunk frame.

    compress: zstd the body; None (the default) does unless nearly all of it is context-coded
    streams, which are already at their entropy and would only cost zstd's time.
    """
    table = bytearray()
    for s in segments:
        table += _SEGMENT.pack(s.tensor, s.op, s.positions, s.values, 0, s.start, s.stop,
                               s.count, s.pos_bytes.size, s.val_bytes.size)
    streams = [s.pos_bytes for s in segments] + [s.val_bytes for s in segments]
    raw_len = sum(x.size for x in streams)
    if raw_len > MAX_BODY_BYTES:
        raise LimitError(f"chunk body of {raw_len} bytes exceeds the {MAX_BODY_BYTES} limit; "
                         "use a smaller chunk span")
    if compress is None:
        coded = sum(s.pos_bytes.size + s.val_bytes.size for s in segments
                    if s.positions == Positions.CTX)
        compress = coded == 0 or coded * 8 < raw_len * 7
    if compress:
        cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
        chunker = cctx.chunker(size=raw_len)
        parts = [bytes(p) for x in streams if x.size for p in chunker.compress(x.data)]
        parts += [bytes(p) for p in chunker.finish()]
        body = b"".join(parts)
    else:
        body = b"".join(x.tobytes() for x in streams)
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, FLAG_ZSTD if compress else 0, len(segments), 0,
                          raw_len, len(body))
    out = b"".join((header, bytes(table), body))
    return out + _TRAILER.pack(xxhash.xxh3_64_intdigest(out))


def _check_record(op: Op, positions: Positions, values: Values, n: int, count: int, plen: int,
                  where: str) -> None:
    """Spec §1 step 8: the coding is one readers accept, and its stream lengths fit the range."""
    check_coding(op, positions, values, where)
    if op == Op.DENSE and (count != n or plen != 0):
        raise FormatError(f"{where}: a dense segment of {n} elements with count {count} and "
                          f"{plen} position bytes (must be {n} and 0)")
    if positions == Positions.BITMAP and plen != (n + 7) // 8:
        raise FormatError(f"{where}: bitmap of {plen} bytes for {n} elements")


def decode_chunk(buf: bytes | memoryview, *, where: str, max_body: int = MAX_BODY_BYTES) -> ChunkFrame:
    """Parse and validate a chunk frame. Raises FormatError subclasses naming `where`.

    Stream contents (varints, positions) are validated later, by the kernels that apply them.
    Readers are strict: what spec.md §1–§2 forbids is refused here, never tolerated.
    """
    mv = memoryview(buf)
    if mv.nbytes < _HEADER.size + _TRAILER.size:
        raise FormatError(f"{where}: truncated chunk ({mv.nbytes} bytes, header needs "
                          f"{_HEADER.size + _TRAILER.size})")
    magic, version, flags, nseg, _reserved, raw_len, stored_len = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise FormatError(f"{where}: not a weighthub chunk (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise FormatVersionError(f"{where}: chunk format version {version}; this build reads "
                                 f"{FORMAT_VERSION}: upgrade weighthub")
    (stored_sum,) = _TRAILER.unpack_from(mv, mv.nbytes - _TRAILER.size)
    computed = xxhash.xxh3_64_intdigest(mv[: mv.nbytes - _TRAILER.size])
    if stored_sum != computed:
        raise ChecksumError(f"{where}: chunk checksum stored {stored_sum:016x}, computed "
                            f"{computed:016x}: the chunk is corrupt")
    if flags & ~FLAG_ZSTD:
        raise FormatError(f"{where}: unknown chunk flags {flags:#x}")
    if nseg > MAX_SEGMENTS:
        raise LimitError(f"{where}: {nseg} segments, limit {MAX_SEGMENTS}")
    table_end = _HEADER.size + nseg * _SEGMENT.size
    if table_end + stored_len + _TRAILER.size != mv.nbytes:
        raise FormatError(f"{where}: lengths do not add up: header {_HEADER.size} + table "
                          f"{nseg}×{_SEGMENT.size} + body {stored_len} + trailer != {mv.nbytes}")
    if raw_len > max_body:
        raise LimitError(f"{where}: body of {raw_len} bytes exceeds the limit {max_body} (the "
                         "format's, or what the chunk's coverage in its manifest admits); "
                         "refused before decompressing: the chunk is hostile or corrupt, "
                         "republish it")
    heads = []
    total = 0
    for i in range(nseg):
        f = _SEGMENT.unpack_from(mv, _HEADER.size + i * _SEGMENT.size)
        tensor, op, pos, val, _r, start, stop, count, plen, vlen = f
        seg_where = f"{where} segment {i}"
        op_e = Op(parse_enum(Op, op, seg_where))
        pos_e = Positions(parse_enum(Positions, pos, seg_where))
        val_e = Values(parse_enum(Values, val, seg_where))
        if not start < stop or count > stop - start:
            raise FormatError(f"{seg_where}: bad range [{start}, {stop}) with count {count}")
        _check_record(op_e, pos_e, val_e, stop - start, count, plen, seg_where)
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
    off_pos = 0
    off_val = sum(h[7] for h in heads)
    for tensor, op_e, pos_e, val_e, start, stop, count, plen, vlen in heads:
        segments.append(Segment(tensor, start, stop, op_e, pos_e, val_e, count,
                                arr[off_pos: off_pos + plen], arr[off_val: off_val + vlen]))
        off_pos += plen
        off_val += vlen
    return ChunkFrame(tuple(segments))
