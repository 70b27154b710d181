"""Structure-aware hypothesis strategies: real inputs from the encoders, then mutated.

Each strategy builds what a writer emits (encode_chunk, encode_manifest, wire.pack + auth.sign,
encode_update, a safetensors header) and then edits one layer of it: a field of a struct (a
length, a count, an enum id), a stream (varints, truncation), the JSON tree (types, huge
numbers, deep nesting, missing or unknown keys) or the bytes. Checksums are recomputed after
most edits (so the edit reaches the code behind them) and left stale in the rest.
"""

from __future__ import annotations

import copy
import json
import struct
from typing import Any

import msgspec
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from weighthub.codec.coding import Op, Positions, Values
from weighthub.tensors import DTYPES

from .mutate import DEEP, DEEP_HOPS, INTERESTING_INTS, apply_edits, dump_json, paths, replace_varint, set_path
from .targets import NOW, SECRET, base_words, resum64, resum128

ints = st.one_of(st.sampled_from(INTERESTING_INTS), st.integers(0, 1 << 64))
edits = st.lists(st.tuples(
    st.sampled_from(["flip", "set", "truncate", "insert", "delete", "int", "varint"]),
    st.integers(0, 1 << 20), ints,
    st.one_of(st.sampled_from([b"\x00", b"\xff" * 11, b"\x80" * 10 + b"\x01", b"\xff\xff"]),
              st.binary(max_size=9))), max_size=3)
depths = st.sampled_from([2, 64, 1000, 5000, 100_000])
json_values: st.SearchStrategy[Any] = st.one_of(
    st.sampled_from(INTERESTING_INTS), st.integers(-(1 << 70), 1 << 70),
    st.sampled_from([-1, 10**30, -(10**30), 1.5, 1e308, float("nan"), float("inf"), True, None,
                     "", "..", "../../etc/passwd", "v000000000001/../x", "\u00b2", "\udc80",
                     [], {}, [[]], {"": {}}, DEEP, "x" * 70_000, [0] * 17, "0" * 64, "F" * 32]),
    st.text(max_size=12), st.lists(st.integers(-2, 1 << 16), max_size=4))
checksum_ok = st.sampled_from([True, True, True, False])  # mostly reach past the checksum


def ci_settings(max_examples: int) -> settings:
    """A CI budget: reproducible (derandomized), no example database, no per-example deadline
    (contract.py has its own hang guard, generous for a loaded machine)."""
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=False)


@st.composite
def json_mutation(draw: Any, tree: Any) -> bytes:
    """`tree` (freshly decoded, owned) with up to three edits, dumped as JSON."""
    for _ in range(draw(st.integers(0, 3))):
        every = paths(tree)
        path = every[draw(st.integers(0, len(every) - 1))]
        if path and draw(st.integers(0, 4)) == 0:
            tree = set_path(tree, path, None, delete=True)
            continue
        if draw(st.integers(0, 4)) == 0 and isinstance(tree, dict):
            key = draw(st.sampled_from(["extra", "__metadata__", "tree", "op"]))
            tree[key] = copy.deepcopy(draw(json_values))  # sampled values are shared objects
            continue
        tree = set_path(tree, path, copy.deepcopy(draw(json_values)))
    return dump_json(tree, draw(depths))


# -- chunk frames and segments ------------------------------------------------------------------

_CODINGS = [(Op.XOR, Values.VARINT), (Op.XOR, Values.RAW), (Op.ADD, Values.ZIGZAG),
            (Op.ADD, Values.RAW), (Op.OVERWRITE, Values.RAW)]


@st.composite
def segment(draw: Any, dtype_index: int) -> Any:
    """A segment a writer could emit against `base_words`, then maybe edited field by field."""
    from weighthub.codec.encode import _encode_groups, _encode_vals, encode_gaps
    from weighthub.codec.scan import Changes
    from weighthub.codec.segment import Segment

    dtype = DTYPES[dtype_index]
    n = draw(st.one_of(st.integers(1, 64), st.integers(1, 3000)))
    start = draw(st.sampled_from([0, 1, 4096, (1 << 40)]))
    old = base_words(n, dtype)
    if draw(st.integers(0, 5)) == 0:
        return Segment(0, start, start + n, Op.DENSE, Positions.ALL, Values.RAW, n,
                       np.empty(0, np.uint8), old[::-1].copy().view(np.uint8))
    # which elements change and how, from a seed: drawing thousands of booleans one by one
    # costs hypothesis more than the target's whole run
    rng = np.random.default_rng(draw(st.integers(0, (1 << 32) - 1)))
    mask = rng.random(n) < draw(st.sampled_from([0.002, 0.05, 0.3, 1.0]))
    if not mask.any():
        mask[draw(st.integers(0, n - 1))] = True
    pos = np.flatnonzero(mask).astype(np.int64)
    new = old.copy()
    flips = rng.integers(1, 1 << (8 * dtype.width), pos.size, dtype=np.uint64, endpoint=False) \
        if dtype.width < 8 else rng.integers(1, 1 << 63, pos.size, dtype=np.uint64)
    new[pos] ^= flips.astype(dtype.uint)
    op, values = draw(st.sampled_from(_CODINGS))
    choices = [Positions.GAPS, Positions.BITMAP] + ([Positions.GROUPS, Positions.CTX, Positions.ANS,
                                                     Positions.ANS] if dtype.is_float else [])
    positions = draw(st.sampled_from(choices))
    streams = None
    if positions in (Positions.CTX, Positions.ANS):  # both streams entropy-coded: xor or add only
        from weighthub.codec.ctx import ctx_streams

        context_values = Values[positions.name]
        op, values = (op, context_values) if op in (Op.XOR, Op.ADD) else (Op.XOR, context_values)
        streams = ctx_streams(old, pos, old[pos], new[pos], dtype, op, positions)
        if streams is None:  # more exponent groups than ctx models (f64): a writer codes groups
            positions, values = Positions.GROUPS, dict(_CODINGS)[op]
    if streams is not None:
        pos_bytes, val_bytes = streams
    else:
        if positions == Positions.GAPS:
            pos_bytes = encode_gaps(pos)
        elif positions == Positions.BITMAP:
            pos_bytes = np.packbits(mask, bitorder="little")
        else:
            pos_bytes = _encode_groups(old, pos, dtype)
        val_bytes = _encode_vals(Changes(pos, old[pos], new[pos]), values, dtype)
    fields = dict(tensor=0, start=start, stop=start + n, op=op, positions=positions,
                  values=values, count=int(pos.size), pos_bytes=pos_bytes, val_bytes=val_bytes)
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.sampled_from(["count", "stop", "start", "op", "positions", "values",
                                     "pos_bytes", "val_bytes", "pos_bytes", "val_bytes"]))
        if name in ("pos_bytes", "val_bytes"):
            raw = fields[name].tobytes()
            if draw(st.booleans()):  # one varint (a gap, group key or count, value) replaced
                raw = replace_varint(raw, draw(st.integers(0, 8)), draw(st.one_of(
                    ints, st.sampled_from([1 << 63, 1 << 64, (1 << 70) - 1]))))
            else:
                raw = apply_edits(raw, draw(edits))
            fields[name] = np.frombuffer(raw, np.uint8).copy()
        elif name in ("op", "positions", "values"):
            fields[name] = draw(st.integers(0, 5))
        else:
            fields[name] = draw(st.one_of(st.sampled_from(INTERESTING_INTS),
                                          st.integers(0, 2 * n + start + 2)))
    return Segment(**fields)


_HEADER = struct.Struct("<4sHHIIQQ")
_SEGMENT = struct.Struct("<IBBBBQQQQQ")


def _set_field(frame: bytes, layout: struct.Struct, offset: int, field: int, value: int) -> bytes:
    if offset + layout.size > len(frame):
        return frame
    vals = list(layout.unpack_from(frame, offset))
    field %= len(vals)
    if isinstance(vals[field], bytes):
        vals[field] = (value % (1 << 64)).to_bytes(8, "little")[:4]  # ints reach 2^64
    else:
        width = struct.calcsize("<" + layout.format.lstrip("<")[field])
        vals[field] = value % (1 << (8 * width))
    return frame[:offset] + layout.pack(*vals) + frame[offset + layout.size:]


@st.composite
def chunk_frame(draw: Any, dtype_index: int | None = None, *, resum: bool | None = None) -> bytes:
    """A chunk frame of 0-3 segments, with header/table fields, body or bytes edited."""
    from weighthub.format.chunk import encode_chunk

    di = draw(st.integers(0, len(DTYPES) - 1)) if dtype_index is None else dtype_index
    segs = draw(st.lists(segment(di), max_size=3))
    version = draw(st.sampled_from([1, 2]))
    try:
        frame = encode_chunk(segs, compress=draw(st.booleans()), version=version)
    except (struct.error, OverflowError):
        frame = encode_chunk([], compress=True)  # an edit the writer cannot even pack
    layer = draw(st.sampled_from(["none", "header", "table", "bytes", "bytes", "zstd"]))
    table_len = _HEADER.unpack_from(frame, 0)[4] if version == 2 else len(segs) * _SEGMENT.size
    if layer == "header":
        frame = _set_field(frame, _HEADER, 0, draw(st.integers(0, 6)), draw(ints))
    elif layer == "table" and segs and version == 1:
        i = draw(st.integers(0, len(segs) - 1))
        frame = _set_field(frame, _SEGMENT, _HEADER.size + i * _SEGMENT.size,
                           draw(st.integers(0, 9)), draw(ints))
    elif layer == "table" and table_len:  # varint records: any byte of the table, any value
        at = _HEADER.size + draw(st.integers(0, table_len - 1))
        frame = frame[:at] + bytes([draw(st.integers(0, 255))]) + frame[at + 1:]
    elif layer == "bytes":
        frame = apply_edits(frame, draw(edits))
    elif layer == "zstd":  # a body whose zstd header declares some size, then junk or nothing
        size = draw(st.sampled_from([0, 1, 4096, (1 << 20), (1 << 20) + 1, 1 << 30, 1 << 40]))
        frame = _zstd_claim(size, draw(st.binary(max_size=64)))
    keep = draw(checksum_ok) if resum is None else resum
    return resum64(frame) if keep else frame


def _zstd_claim(size: int, junk: bytes) -> bytes:
    """A frame of one dense segment whose compressed body claims `size` bytes decompressed."""
    import zstandard

    body = bytearray(zstandard.ZstdCompressor(write_content_size=True).compress(b"\0" * 16))
    fcs = zstandard.get_frame_parameters(bytes(body))
    assert fcs.content_size == 16  # single-byte frame content size field at offset 5
    body = body[:4] + bytes([0x20 | 0x80 | (body[4] & 0x07)]) + size.to_bytes(8, "little") + junk
    table = _SEGMENT.pack(0, int(Op.DENSE), int(Positions.ALL), int(Values.RAW), 0, 0,
                          max(1, size), max(1, size), 0, size)
    head = _HEADER.pack(b"WHCK", 1, 1, 1, 0, size, len(body))
    return head + table + bytes(body) + b"\0" * 8


@st.composite
def segments_input(draw: Any) -> bytes:
    """The segments target's input: dtype, flags, a frame of segments against base_words."""
    di = draw(st.integers(0, len(DTYPES) - 1))
    return bytes([di, draw(st.integers(0, 3))]) + draw(chunk_frame(di, resum=True))


# -- manifests ---------------------------------------------------------------------------------

def _hex(draw: Any, n: int) -> str:
    return draw(st.binary(min_size=n // 2, max_size=n // 2)).hex()


@st.composite
def manifest_tree(draw: Any) -> dict[str, Any]:
    """A valid manifest (as a JSON tree): 0-3 tensors covered by ranges or boxes."""
    from weighthub.format.manifest import ChunkRef, Manifest, TensorEntry, encode_manifest

    tensors, chunks = [], []
    for ti in range(draw(st.integers(0, 3))):
        shape = draw(st.lists(st.integers(1, 6), max_size=3))
        tensors.append(TensorEntry(f"t{ti}.weight", draw(st.sampled_from([d.name for d in DTYPES])),
                                   shape, _hex(draw, 32), changed=0, ops=["xor/gaps/varint"]))
        numel = int(np.prod(shape)) if shape else 1
        if len(shape) == 2 and draw(st.booleans()):
            cut = draw(st.integers(1, shape[0])) if shape[0] > 1 else shape[0]
            boxes = [(ti, [0, 0], [cut, shape[1]])]
            if cut < shape[0]:
                boxes.append((ti, [cut, 0], [shape[0] - cut, shape[1]]))
            covers: list[tuple[int, int, int]] = []
        else:
            cut = draw(st.integers(1, numel))
            covers = [(ti, 0, cut)] + ([(ti, cut, numel)] if cut < numel else [])
            boxes = []
        chunks.append(ChunkRef(f"v000000000002/c{ti:04d}.whc", draw(st.integers(1, 1 << 20)),
                               _hex(draw, 64), covers, boxes))
    full = draw(st.booleans())
    m = Manifest(2, "weighthub.manifest", _hex(draw, 32), 2, None if full else 1,
                 None if full else _hex(draw, 32), _hex(draw, 32), tensors, chunks, 0, 0, 0)
    tree: dict[str, Any] = json.loads(encode_manifest(m))
    return tree


@st.composite
def manifest_bytes(draw: Any) -> bytes:
    raw = draw(json_mutation(draw(manifest_tree())))
    return apply_edits(raw, draw(edits)) if draw(st.integers(0, 3)) == 0 else raw


# -- wire requests and auth tokens -------------------------------------------------------------

hops = st.recursive(st.fixed_dictionaries({"addr": st.sampled_from(["127.0.0.1:9000", "[::1]:1",
                                                                    "h:0", "h:99999", ":1", "x"])}),
                    lambda kids: st.fixed_dictionaries({"addr": st.just("10.0.0.1:7000"),
                                                        "children": st.lists(kids, max_size=3)}),
                    max_leaves=8)


@st.composite
def request_frame(draw: Any) -> bytes:
    """A signed request frame (wire.pack of a Request whose token signs auth_subject)."""
    from weighthub.net import auth, wire

    fields = {"op": draw(st.sampled_from([*wire.OPS, "GET", "", "püsh"])),
              "key": draw(st.sampled_from(["v000000000001/c0000.whc", "v1/x", "../v000000000001",
                                           "v999999999999/m.json", ""])),
              "start": draw(ints) % (1 << 63), "stop": draw(ints) % (1 << 63),
              "version": draw(st.sampled_from([-1, 0, 1, (1 << 63) - 1])),
              "tensor": draw(st.text(max_size=8)), "lease": draw(st.text(max_size=8)),
              "size": draw(st.sampled_from([0, 0, 1, 1 << 40])),
              "checksum": draw(st.sampled_from(["", "0" * 64])),
              "tree": draw(st.lists(hops, max_size=2))}
    try:
        req = msgspec.convert(fields, wire.Request)
        if draw(st.integers(0, 4)):
            token = auth.sign(SECRET, *wire.auth_subject(req), now=NOW)
            req = msgspec.structs.replace(req, auth=draw(edited_token(token)))
        tree = msgspec.to_builtins(req)
    except (msgspec.ValidationError, ValueError):
        tree = fields
    if draw(st.integers(0, 5)) == 0:
        tree["tree"] = [DEEP_HOPS]
        raw = dump_json(tree, draw(depths))
    elif draw(st.booleans()):
        raw = draw(json_mutation(tree))
    else:
        raw = dump_json(tree, 2)
    frame = wire.PREFIX.pack(wire.REQUEST_MAGIC, len(raw)) + raw
    if draw(st.integers(0, 3)) == 0:
        frame = apply_edits(frame, draw(edits))
    return frame


@st.composite
def response_frame(draw: Any) -> bytes:
    from weighthub.net import wire

    tree = {"status": draw(st.sampled_from(["ok", wire.AUTH, wire.REFUSED, "?"])), "size": 0,
            "versions": [1, 2], "failed": ["h:1"]}
    raw = draw(json_mutation(tree))
    return apply_edits(wire.PREFIX.pack(wire.RESPONSE_MAGIC, len(raw)) + raw, draw(edits))


_TOKEN_EDITS = st.sampled_from([
    ("ts", "-0"), ("ts", "\u00b2"), ("ts", "1" * 25), ("ts", "+1"), ("ts", "\u0663"), ("ts", ""),
    ("nonce", "A" * 24), ("nonce", "g"), ("nonce", "\udc80"), ("nonce", "0" * 300),
    ("sig", ""), ("sig", "é" * 64), ("sig", "\udcff" * 64), ("scheme", "wh1"), ("scheme", "WH2"),
    ("sep", "  "), ("sep", "\t"), ("sep", " \x00")])


@st.composite
def edited_token(draw: Any, token: str) -> str:
    """A token as `auth.sign` wrote it, with up to two of its fields or separators replaced."""
    parts, sep = token.split(" "), " "
    for field, value in draw(st.lists(_TOKEN_EDITS, max_size=2)):
        if field == "sep":
            sep = value
        else:
            parts[["scheme", "ts", "nonce", "sig"].index(field)] = value
    return sep.join(parts)


@st.composite
def auth_input(draw: Any) -> bytes:
    """method NUL path NUL digest NUL token: a real token, then a field or its bytes edited."""
    from weighthub.net import auth

    method = draw(st.sampled_from([b"get", b"push", b"GET", b"\xff", b""]))
    path = draw(st.sampled_from([b"v000000000001/c0000.whc", b"/versions", b"k\xc3(", b""]))
    digest = draw(st.sampled_from([b"", b"1:2:3", b"\x80"]))
    m, p, d = (x.decode("utf-8", "surrogateescape") for x in (method, path, digest))
    try:
        token = auth.sign(SECRET, m, p, d, now=NOW + draw(st.sampled_from([0, -3600, 1e12])))
    except UnicodeError:  # a signer that cannot sign undecodable paths: a well-formed token
        token = f"WH1 {int(NOW)} {'0' * 24} {'0' * 64}"
    raw = draw(edited_token(token)).encode("utf-8", "surrogateescape")
    if draw(st.integers(0, 3)) == 0:
        raw = apply_edits(raw, draw(edits))
    return b"\0".join([method, path, digest, raw])


# -- LoGRA compact payloads and safetensors headers ---------------------------------------------

@st.composite
def logra_frame(draw: Any) -> bytes:
    """An encode_update frame (sketches and dense entries), its header or bytes edited."""
    import torch

    from weighthub.train.compact import MAGIC, encode_update
    from weighthub.train.record import DenseRecord, SketchRecord, UpdateRecord

    rec = UpdateRecord(step=draw(st.integers(1, 5)))
    for i in range(draw(st.integers(0, 2))):
        m, n = draw(st.integers(1, 6)), draw(st.integers(1, 6))
        r = draw(st.integers(1, min(m, n)))
        dt = draw(st.sampled_from([torch.float32, torch.bfloat16]))
        rec.sketches.append(SketchRecord(f"s{i}", (m, n), torch.ones(m, r, dtype=dt), 7, 0,
                                         -1e-3, 1.0, b"\1" * 16, b"\2" * 16))
    for i in range(draw(st.integers(0, 2))):
        rec.dense.append(DenseRecord(f"d{i}", torch.zeros(draw(st.integers(1, 5))),
                                     b"\3" * 16, b"\4" * 16))
    frame = encode_update(rec)
    if draw(st.booleans()):
        (hlen,) = struct.unpack_from("<I", frame, 8)
        header = draw(json_mutation(json.loads(frame[12:12 + hlen])))
        frame = MAGIC + struct.pack("<I", len(header)) + header + frame[12 + hlen:]
    if draw(st.integers(0, 3)) == 0:
        frame = apply_edits(frame, draw(edits))
    return resum128(frame) if draw(checksum_ok) else frame


@st.composite
def safetensors_file(draw: Any) -> bytes:
    """A safetensors file (header + data) with its header tree, length prefix or bytes edited."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for i in range(draw(st.integers(0, 3))):
        dt = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        size = int(np.prod(shape)) * dt.width if shape else dt.width
        header[f"w{i}"] = {"dtype": dt.name, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = draw(json_mutation(header))
    out = struct.pack("<Q", len(raw)) + raw + b"\0" * offset
    if draw(st.integers(0, 3)) == 0:
        out = apply_edits(out, draw(edits))
    return out


def strategies() -> dict[str, Any]:
    """The strategy that feeds each target (the `*_resum` twins are for byte-level fuzzers)."""
    from .strategies_ctx import ctx_input  # it builds on this module's edits

    return {"chunk": chunk_frame(), "segments": segments_input(), "manifest": manifest_bytes(),
            "wire_request": request_frame(), "wire_response": response_frame(),
            "auth_token": auth_input(), "logra": logra_frame(),
            "safetensors_header": safetensors_file(), "ctx": ctx_input()}
