"""One function per fuzz target: bytes in, the parser's contract asserted (see contract.py).

Each target takes any bytes and returns the parser's result (or raises a WeighthubError, which
`check` counts as a refusal). What a target checks beyond contract.py's three points, it says.
Targets whose input is checksummed come twice: as is, and `*_resum` with the checksum
recomputed over the (mutated) bytes, so that byte-level fuzzers (atheris) reach the code behind
the checksum.

TARGETS maps a target's name (its corpus directory) to (function, memory bound for an input of
n bytes). The bounds are what the parser may allocate on the Python side: a small multiple of
the input (JSON trees and decoded lists), plus the decompressed body the caller allows.
"""

from __future__ import annotations

import contextlib
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

# Imported here, not in the targets: a first import inside the measured region would count
# against the memory bound and the deadline (torch alone takes seconds and hundreds of MB).
from weighthub.codec.apply import apply_segment, regap_segment
from weighthub.codec.coding import Op, Positions, Values, check_coding
from weighthub.codec.prepared import prepare_segment
from weighthub.codec.segment import Segment, UndoLog
from weighthub.errors import WeighthubError
from weighthub.format.chunk import decode_chunk
from weighthub.format.manifest import decode_manifest
from weighthub.net import auth, wire
from weighthub.net.server import key_version
from weighthub.targets.safetensors_header import read_header
from weighthub.tensors import DTYPES, DType, readonly
from weighthub.train.compact import parse_update

from .contract import ContractViolation, run_target

SECRET = b"fuzz-secret-0123456789abcdef"  # auth: what the server side of the targets holds
NOW = 1_800_000_000.0  # auth: the verifier's clock; strategies sign with it
MAX_BODY = 1 << 20  # the decompressed body a chunk caller allows (what its coverage implies)
MAX_SEGMENT_ELEMENTS = 1 << 16  # segments target: larger ranges are decoded, not applied
FLOAT_DTYPES = [d for d in DTYPES if d.is_float]
_SLACK = 8 << 20  # interpreter noise: imports on first use, caches, hypothesis bookkeeping
_JSON_EXPANSION = 64  # Python objects per byte of JSON, generously ("[]" is a 56-byte list)


def resum64(data: bytes) -> bytes:
    """`data` with its last 8 bytes replaced by the xxh3-64 of the rest (chunk trailer)."""
    if len(data) < 8:
        return data
    head = data[:-8]
    return head + xxhash.xxh3_64_intdigest(head).to_bytes(8, "little")


def resum128(data: bytes) -> bytes:
    """`data` with its last 16 bytes replaced by the xxh3-128 of the rest (LoGRA trailer)."""
    if len(data) < 16:
        return data
    return data[:-16] + xxhash.xxh3_128_digest(data[:-16])


def chunk(data: bytes) -> object:
    frame = decode_chunk(data, where="fuzz chunk", max_body=MAX_BODY)
    for s in frame.segments:  # what decode_chunk promises its callers
        if not (s.start < s.stop and s.count <= s.stop - s.start):
            raise ContractViolation(f"chunk: accepted segment range [{s.start}, {s.stop}) "
                                    f"count {s.count}")
    return frame


def chunk_resum(data: bytes) -> object:
    return chunk(resum64(data))


def base_words(n: int, dtype: DType) -> np.ndarray:
    """The words a segments-target segment of n elements applies to (strategies encode
    against the same words, so unmutated segments apply)."""
    rng = np.random.default_rng(0x5EED + n)
    return np.frombuffer(rng.bytes(n * dtype.width), dtype.uint).copy()


def segments(data: bytes) -> object:
    """[dtype index][flags][chunk frame, trailer recomputed]: every segment of the frame is
    regapped and applied (flags bit 0: inversely, bit 1: with digest lanes) to `base_words`.

    Beyond the contract: regap never writes its base; after a refusal the undo log restores
    the destination bit for bit (that is how apply refuses: `apply_segment`'s docstring), and
    after a success too; a segment that applied forwards and is invertible undoes exactly.
    """
    if len(data) < 2:
        return None
    dtype, flags = DTYPES[data[0] % len(DTYPES)], data[1]
    frame = decode_chunk(resum64(data[2:]), where="fuzz segments", max_body=MAX_BODY)
    applied = 0
    for i, seg in enumerate(frame.segments):
        if seg.stop - seg.start > MAX_SEGMENT_ELEMENTS:
            continue
        where = f"fuzz segment {i}"
        base = base_words(seg.stop - seg.start, dtype)
        held = readonly(base.copy())
        with contextlib.suppress(WeighthubError):
            regap_segment(seg, held, dtype, where)
        _same(held, base, "regap_segment wrote its base")
        dst, undo = base.copy(), UndoLog()
        lanes = {"dnew": np.zeros(2, np.uint64), "dold": np.zeros(2, np.uint64)} if flags & 2 else {}
        try:
            apply_segment(seg, dst, dtype, undo, where, inverse=bool(flags & 1), **lanes)
        except WeighthubError:
            undo.rollback()
            _same(dst, base, "refused apply_segment, then rollback, left changed bits")
            continue
        applied += 1
        if seg.invertible and not flags & 1:
            back = dst.copy()
            try:
                apply_segment(seg, back, dtype, UndoLog(), where, inverse=True)
            except WeighthubError as exc:
                raise ContractViolation(f"segments: {where} applied forwards, refused "
                                        f"inversely: {exc}", "segments: inverse refused") from exc
            _same(back, base, "an invertible segment applied forwards then inversely")
        undo.rollback()
        _same(dst, base, "apply_segment then rollback")
    return applied


CTX_HEADER = struct.Struct("<BBIHH")  # dtype (float index), op | coding, count, n, pos_len
CTX_ADD, CTX_ANS = 1, 2  # the op byte's bits: add (else xor); the ans coding (else ctx)


def ctx(data: bytes) -> object:
    """[CTX_HEADER][positions stream][values stream]: a context-coded segment (ctx or ans) of n
    elements prepared against `base_words` (codec.prepared.prepare_segment, what staging runs:
    codec.ctx.decode_changes), then applied from the prepared words and, decoded in the pause
    (codec.ctx.decode_ctx), from the segment, each rolled back. Beyond the contract: staging
    never writes its base, and whatever decodes applies and rolls back bit for bit.
    """
    if len(data) < CTX_HEADER.size:
        return None
    di, op, count, n, pos_len = CTX_HEADER.unpack_from(data)
    dtype = FLOAT_DTYPES[di % len(FLOAT_DTYPES)]
    streams = np.frombuffer(data[CTX_HEADER.size:], np.uint8).copy()
    n = max(n, 1)
    coding = Positions.ANS if op & CTX_ANS else Positions.CTX
    seg = Segment(0, 0, n, Op.ADD if op & CTX_ADD else Op.XOR, coding, Values[coding.name], count,
                  streams[:pos_len], streams[pos_len:])
    check_coding(seg.op, seg.positions, seg.values, "fuzz ctx", is_float=True)
    if count > n:
        return None  # decode_chunk refuses this before any segment reaches a decoder
    base = base_words(n, dtype)
    held = readonly(base.copy())
    try:
        prep = prepare_segment(seg, held, dtype, "fuzz ctx")
    finally:
        _same(held, base, "staging wrote its base")
    for prepared in (prep, None):
        dst, undo = base.copy(), UndoLog()
        try:
            apply_segment(seg, dst, dtype, undo, "fuzz ctx", prepared=prepared)
        finally:
            undo.rollback()
            _same(dst, base, "a ctx segment applied (or refused), then rolled back")
    return count


def _same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
        bad = int(np.flatnonzero(got.view(np.uint8) != want.view(np.uint8))[0])
        raise ContractViolation(f"segments: {what} (first differing byte {bad})", f"segments: {what}")


def manifest(data: bytes) -> object:
    return decode_manifest(data, where="fuzz manifest")


def wire_request(data: bytes) -> object:
    """A request as the chunk server reads it: prefix, header, token, then what it parses of
    the fields (the version of a key, the relay tree's addresses)."""
    where = "fuzz request"
    if len(data) < wire.PREFIX.size:
        return None  # the peer hung up inside the prefix: nothing to parse
    hlen = wire.header_length(data[:wire.PREFIX.size], wire.REQUEST_MAGIC, where)
    raw = data[wire.PREFIX.size: wire.PREFIX.size + hlen]
    if len(raw) < hlen:
        return None  # hung up inside the header
    req = wire.decode_request(raw, where)
    auth.verify(SECRET, req.auth, *wire.auth_subject(req), replay=auth.ReplayGuard(), now=NOW)
    for hop in req.tree:
        for addr in wire.addresses(hop):
            wire.parse_addr(addr)
    if req.op in ("push", "get", "range"):
        key_version(req.key)
    return req


def wire_response(data: bytes) -> object:
    where = "fuzz response"
    if len(data) < wire.PREFIX.size:
        return None
    hlen = wire.header_length(data[:wire.PREFIX.size], wire.RESPONSE_MAGIC, where)
    raw = data[wire.PREFIX.size: wire.PREFIX.size + hlen]
    return None if len(raw) < hlen else wire.decode_response(raw, where)


def auth_token(data: bytes) -> object:
    """method NUL path NUL body_digest NUL token, each decoded as an HTTP server decodes
    header bytes (UTF-8 with surrogateescape); missing parts are a fixed request's."""
    parts = data.split(b"\0", 3)
    if len(parts) != 4:
        parts = [b"get", b"v000000000001/c0000.whc", b"", data]
    method, path, digest, token = (p.decode("utf-8", "surrogateescape") for p in parts)
    auth.verify(SECRET, token, method, path, digest, replay=auth.ReplayGuard(), now=NOW)
    return token


def logra(data: bytes) -> object:
    return parse_update(data)


def logra_resum(data: bytes) -> object:
    return logra(resum128(data))


def safetensors_header(data: bytes) -> object:
    with tempfile.TemporaryDirectory(prefix="wh-fuzz-") as d:
        path = Path(d) / "model.safetensors"
        path.write_bytes(data)
        return read_header(path)


def _json_bound(n: int) -> int:
    return _JSON_EXPANSION * n + _SLACK


TARGETS: dict[str, tuple[Callable[[bytes], object], Callable[[int], int]]] = {
    "chunk": (chunk, lambda n: 4 * n + MAX_BODY + _SLACK),
    "chunk_resum": (chunk_resum, lambda n: 4 * n + MAX_BODY + _SLACK),
    # base, destination, undo positions and words, decoded positions: ~8 arrays of 8-byte words
    "segments": (segments, lambda n: 4 * n + MAX_BODY + 64 * MAX_SEGMENT_ELEMENTS + _SLACK),
    # decoded positions and entries, re-coded gaps and varints, undo: ~64 bytes per element
    "ctx": (ctx, lambda n: 4 * n + 64 * (1 << 16) + _SLACK),
    "manifest": (manifest, _json_bound),
    "wire_request": (wire_request, _json_bound),
    "wire_response": (wire_response, _json_bound),
    "auth_token": (auth_token, _json_bound),
    "logra": (logra, _json_bound),
    "logra_resum": (logra_resum, _json_bound),
    "safetensors_header": (safetensors_header, _json_bound),
}


def check(name: str, data: bytes) -> object:
    """Run target `name` on `data` under the contract; raises ContractViolation."""
    fn, bound = TARGETS[name]
    return run_target(name, fn, data, memory_bound=bound(len(data)))
