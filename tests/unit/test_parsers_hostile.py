"""Every parser of untrusted bytes maps every failure into weighthub's error tree (issue #17 item 3).

One table of hostile inputs per parser: manifests, wire request/response headers and peer
addresses, auth tokens and secret files, exponent-group tables of segment streams, safetensors
headers and the compact LoGRA payload. Deep nesting, integers past 64 bits, over-long varints,
wrong types, lone surrogates (undecodable bytes), truncation and non-regular files each raise
the named tree error (`type(...) is`), never RecursionError, OverflowError, ValueError,
struct.error or UnicodeError, and never block.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import xxhash

from weighthub.codec import Op, Positions, Segment, UndoLog, Values, apply_segment, regap_segment
from weighthub.errors import AuthError, FormatError, LimitError, UsageError, WeighthubError
from weighthub.format.manifest import decode_manifest
from weighthub.net import auth, wire
from weighthub.targets.safetensors_header import read_header
from weighthub.tensors import DTYPE_BY_NAME
from weighthub.train.compact import MAGIC, parse_update

DEEP = 100_000  # nesting levels: far past any recursion limit


def deep(opening: bytes, closing: bytes, inner: bytes = b"1") -> bytes:
    return opening * DEEP + inner + closing * DEEP


# --- manifests -----------------------------------------------------------------------------

MANIFEST: dict[str, Any] = {
    "format": 2, "kind": "weighthub.manifest", "model": "0" * 32, "version": 1, "base": None,
    "base_root": None, "root": "1" * 32,
    "tensors": [{"name": "a", "dtype": "BF16", "shape": [4], "digest": "2" * 32, "changed": 4}],
    "chunks": [{"key": "v1/c.whc", "size": 10, "checksum": "3" * 64, "covers": [[0, 0, 4]]}],
    "dense_bytes": 8, "payload_bytes": 10, "changed": 4}


def _manifest(**fields: object) -> bytes:
    return msgspec.json.encode({**MANIFEST, **fields})


def _tensor(**fields: object) -> bytes:
    return _manifest(tensors=[{**MANIFEST["tensors"][0], **fields}])


def _chunk(**fields: object) -> bytes:
    return _manifest(chunks=[{**MANIFEST["chunks"][0], **fields}])


HOSTILE_MANIFESTS: dict[str, tuple[bytes, type[WeighthubError], str]] = {
    # the head is read alone first, as an object: an array is not a manifest, however deep
    "nested arrays": (deep(b"[", b"]"), FormatError, "not a weighthub manifest"),
    "nested objects": (deep(b'{"a":', b"}"), FormatError, "nested too deeply"),
    "nested inside a manifest": (_manifest()[:-1] + b',"x":' + deep(b"[", b"]") + b"}", FormatError,
                                 "nested too deeply"),
    "version past int64": (_manifest(version=1 << 70), FormatError, "version 1180591620717411303424"),
    "chunk size past int64": (_chunk(size=1 << 64), FormatError, "bad size or checksum"),
    "payload bytes past int64": (_manifest(payload_bytes=1 << 63), LimitError, "payload_bytes"),
    "changed more than numel": (_tensor(changed=5), FormatError, "5 changed of 4"),
    "a dim past int64 of an empty tensor": (_manifest(
        tensors=[{**MANIFEST["tensors"][0], "shape": [0, 1 << 70], "changed": 0}], chunks=[],
        dense_bytes=0, payload_bytes=0, changed=0), LimitError, "no dim over"),
    "digest with a newline": (_tensor(digest="2" * 32 + "\n"), FormatError, "digest"),
    "key with a newline": (_chunk(key="v1/c.whc\n"), FormatError, "chunk key"),
    "not UTF-8": (_manifest()[:-1] + b',"publisher":"\xff"}', FormatError, "not valid JSON"),
    "truncated": (_manifest()[:40], FormatError, "not valid JSON"),
    "infinity": (_manifest()[:-1] + b',"created":1e999}', FormatError,
                 r"invalid manifest: Number out of range - at `\$\.created`"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_MANIFESTS))
def test_hostile_manifests_raise_tree_errors(name: str) -> None:
    buf, cls, match = HOSTILE_MANIFESTS[name]
    with pytest.raises(cls, match=match) as info:
        decode_manifest(buf, where="store/v1/manifest.json")
    assert type(info.value) is cls and "store/v1/manifest.json" in str(info.value)


def test_the_base_manifest_of_the_table_is_valid() -> None:
    assert decode_manifest(_manifest(), where="t").version == 1


# --- wire headers and addresses ----------------------------------------------------------------

def _chain(depth: int) -> bytes:
    """A push request whose relay tree is a chain of `depth` hops (a fan-out-1 tree)."""
    hop = b'{"addr":"a:1","children":['
    return b'{"op":"push","tree":[' + hop * depth + b"]}" * depth + b"]}"


HOSTILE_REQUESTS = {
    "nested past the recursion limit": (_chain(2500), "nested too deeply"),
    "a chain deeper than the limit": (_chain(wire.MAX_TREE_DEPTH + 1), "deeper than"),
    "start past int64": (b'{"op":"get","start":%d,"stop":%d}' % (1 << 64, 1 << 65), "bad size"),
    "version past int64": (b'{"op":"dense","version":%d}' % (1 << 63), "bad size"),
    "not UTF-8": (b'{"op":"\xff"}', "bad request header"),
    "empty": (b"", "bad request header"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_REQUESTS))
def test_hostile_request_headers_raise_limit_error(name: str) -> None:
    raw, match = HOSTILE_REQUESTS[name]
    assert len(raw) <= wire.MAX_HEADER or name.startswith("nested")
    with pytest.raises(LimitError, match=match) as info:
        wire.decode_request(raw, "peer 1.2.3.4:5")
    assert type(info.value) is LimitError


def test_a_chain_at_the_depth_limit_is_a_valid_tree() -> None:
    req = wire.decode_request(_chain(wire.MAX_TREE_DEPTH), "t")
    assert wire.tree_depth(req.tree) == wire.tree_size(req.tree) == wire.MAX_TREE_DEPTH
    assert len(wire.addresses(req.tree[0])) == wire.MAX_TREE_DEPTH


@pytest.mark.parametrize("raw", [b'{"status":"ok","size":-1}', b'{"status":"ok","size":%d}' % (1 << 64),
                                 b'{"status":"ok","failed":' + deep(b"[", b"]", b"") + b"}"])
def test_hostile_response_headers_raise_limit_error(raw: bytes) -> None:
    with pytest.raises(LimitError):
        wire.decode_response(raw, "peer")


@pytest.mark.parametrize("prefix", [b"", b"WHQ1", b"WHQ1\x00\x00\x00"])
def test_short_frame_prefixes_raise_limit_error(prefix: bytes) -> None:
    with pytest.raises(LimitError, match="frame prefix"):
        wire.header_length(prefix, wire.REQUEST_MAGIC, "peer")


@pytest.mark.parametrize("addr", ["a:\u00b2", "a:\u0661\u0662", "a:" + "9" * 5000, "a:0009999"])
def test_hostile_peer_addresses_raise_limit_error(addr: str) -> None:
    with pytest.raises(LimitError, match="is not 'host:port'"):
        wire.parse_addr(addr)


# --- auth tokens and secret files --------------------------------------------------------------

SECRET = b"0123456789abcdef0123456789abcdef"
SIG = "0f" * 32


@pytest.mark.parametrize("token", [
    f"WH1 --5 abcd {SIG}", f"WH1 \u00b2 abcd {SIG}", f"WH1 \u0661 abcd {SIG}", f"WH1 1 ab\udcffcd {SIG}",
    f"WH1 1 abcd {SIG[:-1]}\udcff", f"WH1 1 abcd {SIG[:-1]}\u00e9", f"WH1 {'9' * 30} abcd {SIG}",
    f"WH1 1 abcd {SIG} ", f"WH1  1 abcd {SIG}", f"WH1 1 ABCD {SIG}", f"WH1 1 abcd {SIG.upper()}"])
def test_malformed_tokens_raise_auth_error(token: str) -> None:
    with pytest.raises(AuthError, match="malformed auth token") as info:
        auth.verify(SECRET, token, "GET", "/v1/latest")
    assert type(info.value) is AuthError


def test_a_path_from_undecodable_bytes_signs_and_verifies_without_unicode_errors() -> None:
    path = "/v1/\udcff"  # how a server may hand over a path whose bytes are not UTF-8
    auth.verify(SECRET, auth.sign(SECRET, "GET", path), "GET", path)
    with pytest.raises(AuthError, match="bad signature"):
        auth.verify(SECRET, auth.sign(SECRET, "GET", "/v1/x"), "GET", path)


def _unblocks(fifo: Path) -> Callable[[], None]:
    """Open `fifo` for writing if a reader waits on it (lets a blocked open return)."""
    def release() -> None:
        with contextlib.suppress(OSError):  # ENXIO: no reader waiting, nothing to release
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    return release


def _bounded(fn: Callable[[], object], release: Callable[[], None]) -> BaseException | None:
    """Run fn in a thread; what it raised. Fails (after releasing it) if it blocks."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as exc:  # the test inspects it
            out.append(exc)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10.0)  # a hang guard: these calls return in milliseconds
    if t.is_alive():
        release()
        t.join(10.0)
        pytest.fail("the call blocked on a non-regular file")
    return out[0]


def test_secret_files_that_are_not_regular_files_are_usage_errors(tmp_path: Path) -> None:
    fifo = tmp_path / "secret.fifo"
    os.mkfifo(fifo)
    exc = _bounded(lambda: auth.load_secret(fifo), _unblocks(fifo))
    assert type(exc) is UsageError and "not a regular file" in str(exc)
    with pytest.raises(UsageError, match="not a regular file"):
        auth.load_secret(tmp_path)
    with pytest.raises(UsageError, match="not a regular file"):
        auth.load_secret("/dev/zero")  # endless


def test_secret_files_with_bad_names_or_sizes_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read the weighthub secret file"):
        auth.load_secret("secret\0file")
    big = tmp_path / "big"
    big.write_bytes(b"s" * (1 << 20))
    with pytest.raises(UsageError, match="over 65536 bytes"):
        auth.load_secret(big)


def test_an_undecodable_secret_variable_is_used_as_its_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = b"\xff" * 20  # what os.environ holds for a variable whose bytes are not UTF-8
    monkeypatch.setenv(auth.SECRET_ENV, os.fsdecode(raw))
    assert auth.load_secret() == raw


# --- exponent-group tables of segment position streams -----------------------------------------

BF16 = DTYPE_BY_NAME["BF16"]
N = 64


def _varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    return bytes(out + bytes([v]))


GROUP_TABLES = {  # ngroups, then (key, count) pairs; the segment's count is 1
    "key 2^63": (b"\x01" + _varint(1 << 63) + b"\x01", "keys out of range"),
    "key 2^64-1": (b"\x01" + _varint((1 << 64) - 1) + b"\x01", "keys out of range"),
    "count 2^63": (b"\x01\x00" + _varint(1 << 63), "counts sum to 9223372036854775808"),
    "counts that overflow int64 together": (b"\x02\x00" + _varint((1 << 63) - 1) + b"\x01"
                                            + _varint((1 << 63) - 1), "counts sum to"),
    "a varint over 2^64-1": (b"\x01\x00" + b"\xff" * 9 + b"\x7f", r"over 2\^64-1"),
    "an 11-byte varint": (b"\x01\x00" + b"\x80" * 10 + b"\x01", "longer than 10 bytes"),
    "ngroups 2^64-1": (_varint((1 << 64) - 1), "position groups"),
    "empty": (b"", "ends inside a varint"),
    "truncated": (b"\x01\x80", "ends inside a varint"),
}


def _grouped(pos: bytes) -> Segment:
    return Segment(0, 0, N, Op.XOR, Positions.GROUPS, Values.VARINT, 1,
                   np.frombuffer(pos, np.uint8), np.frombuffer(b"\x01", np.uint8))


@pytest.mark.parametrize("name", sorted(GROUP_TABLES))
def test_hostile_group_tables_raise_format_error(name: str) -> None:
    pos, match = GROUP_TABLES[name]
    base = np.zeros(N, np.uint16)
    with pytest.raises(FormatError, match=match):
        regap_segment(_grouped(pos), base, BF16, "chunk c0 segment 0")
    undo = UndoLog()
    with pytest.raises(FormatError, match=match):
        apply_segment(_grouped(pos), base, BF16, undo, "chunk c0 segment 0")
    undo.rollback()
    assert not base.any()


# --- safetensors headers -------------------------------------------------------------------------

def _safetensors(tmp_path: Path, header: bytes, data: bytes = b"\0" * 16) -> Path:
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


HOSTILE_SAFETENSORS = {
    "nested arrays": (b'{"a":' + deep(b"[", b"]") + b"}", FormatError, "nested too deeply"),
    "nested metadata": (b'{"__metadata__":' + deep(b'{"a":', b"}") + b"}", FormatError, "nested too deeply"),
    "a dim past 2^48 of an empty tensor": (json.dumps({"a": {"dtype": "F32", "shape": [0, 1 << 80],
                                                             "data_offsets": [0, 0]}}).encode(),
                                           LimitError, "a dim over"),
    "too many dims": (json.dumps({"a": {"dtype": "F32", "shape": [1] * 17,
                                        "data_offsets": [0, 4]}}).encode(), LimitError, "over 16 dims"),
    "an integer of 5000 digits": (b'{"a":{"dtype":"F32","shape":[' + b"9" * 5000
                                  + b'],"data_offsets":[0,4]}}', FormatError, "not JSON"),
    "a dtype that is a list": (json.dumps({"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}
                                           }).encode(), FormatError, "bad header"),
    "not UTF-8": (b'{"\xff":1}', FormatError, "not JSON"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_SAFETENSORS))
def test_hostile_safetensors_headers_raise_tree_errors(tmp_path: Path, name: str) -> None:
    header, cls, match = HOSTILE_SAFETENSORS[name]
    path = _safetensors(tmp_path, header)
    with pytest.raises(cls, match=match) as info:
        read_header(path)
    assert type(info.value) is cls and str(path) in str(info.value)


def test_a_fifo_checkpoint_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    exc = _bounded(lambda: read_header(fifo), _unblocks(fifo))
    assert type(exc) is UsageError and "not a regular file" in str(exc)


# --- the compact LoGRA payload (spec §6) ----------------------------------------------------------

ENTRY = {"name": "w", "kind": "sketch", "shape": [4, 4], "dtype": "float32", "offset": 0,
         "nbytes": 16, "base": "0" * 32, "digest": "1" * 32, "seed": 0, "epoch": 0, "rank": 1,
         "coef": 1.0, "decay": 1.0}


def _update(header: bytes, body: bytes = b"\0" * 16) -> bytes:
    frame = MAGIC + struct.pack("<I", len(header)) + header + body
    return frame + xxhash.xxh3_128_digest(frame)


def _entry(**fields: object) -> bytes:
    return _update(json.dumps({"step": 1, "entries": [{**ENTRY, **fields}]}).encode())


HOSTILE_UPDATES = {
    "nested header": (_update(deep(b"[", b"]")), "bad header"),
    "negative epoch": (_entry(epoch=-1), "epoch -1 outside"),
    "epoch past 64 bits": (_entry(epoch=1 << 64), "outside 0..2"),
    "a name with a lone surrogate": (_update(json.dumps({"step": 1, "entries": [
        {**ENTRY, "name": "w\udcff"}]}).encode()), "surrogates not allowed"),
    "a digest of spaces": (_entry(base=" " * 32), "hex digest"),
    "an upper-case digest": (_entry(digest="A" * 32), "hex digest"),
    "a digest of non-ASCII digits": (_entry(base="\u0661" * 32), "hex digest"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_UPDATES))
def test_hostile_compact_updates_raise_format_error(name: str) -> None:
    buf, match = HOSTILE_UPDATES[name]
    with pytest.raises(FormatError, match=match) as info:
        parse_update(buf)
    assert type(info.value) is FormatError


def test_the_base_entry_of_the_compact_table_is_valid() -> None:
    step, entries = parse_update(_entry())
    assert step == 1 and entries[0].base == bytes(16)
