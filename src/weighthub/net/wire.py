"""The chunk-server protocol: length-prefixed frames over TCP.

Chosen by measurement (`bench_transport`, 2 shared cores, one stream, best of 3): raw
non-blocking sockets (asyncio `sock_sendall` / `sock_recv_into` into a preallocated buffer) moved
1.1-1.3 GB/s with 32 MiB bodies and 2.1 GB/s with 16 MiB; aiohttp 0.2-0.6 GB/s; asyncio streams
0.14-0.25 GB/s (on Python 3.11 they copy every byte through a bytearray buffer).

A connection carries requests one after another. Each message is

    magic     4 bytes   b"WHQ1" (request) or b"WHS1" (response)
    hlen      4 bytes   big-endian length of the header, 1..MAX_HEADER
    header    hlen      JSON (msgspec): `Request` or `Response`
    body      size      raw bytes; `size` is a header field (0 for none), at most the server's
                        max_body; refused before any allocation when larger

Ops (Request.op):
    get      a store object by key                          -> body: the object
    range    bytes [start, stop) of a store object          -> body: the bytes
    dense    bytes [start, stop) of tensor `tensor`'s canonical bits at `version`
             (for newcomers), under read lease `lease`      -> body: the bytes
    release  end read lease `lease` (the newcomer is done)
    push     an object of a version (key, size, checksum) with its body: a chunk while the
             publisher encodes, the version's manifest after the commit; the node forwards it
             cut-through to `tree` (its children, each with their own subtree) and stages it
             after the checksum matches                      -> failed: descendants that failed
    versions what the server serves                         -> versions

Every request carries an auth token (see `auth`) signed over `auth_subject(request)`, which
binds every field that selects or describes content, so no field can be altered in flight.
"""

from __future__ import annotations

import struct
from typing import TypeVar

import msgspec

from ..errors import LimitError

REQUEST_MAGIC = b"WHQ1"
RESPONSE_MAGIC = b"WHS1"
PREFIX = struct.Struct("!4sI")
MAX_HEADER = 64 << 10
MAX_TREE_NODES = 4096
# A relay tree's depth: a fan-out-1 chain of this many hops already takes seconds per chunk
# (each hop adds a store-and-forward step); deeper nesting is refused so that nothing that
# walks a tree (decode, sign, forward) recurses without bound.
MAX_TREE_DEPTH = 256
_MAX_INT = (1 << 63) - 1  # offsets, sizes and versions travel as int64 on both sides
OPS = ("get", "range", "dense", "release", "push", "versions")

# Response.status values other than "ok", and what the client raises for each.
AUTH = "auth"            # AuthError
NOT_FOUND = "not_found"  # ObjectNotFound
REFUSED = "refused"      # PeerUnavailable: a version it does not serve, or busy
BAD_REQUEST = "bad_request"
FAILED = "failed"        # PeerUnavailable: the server failed (I/O, checksum of a push, …)


class Hop(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One node of a relay tree: its address ("host:port") and its own children."""

    addr: str
    children: list[Hop] = []


class Request(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    op: str
    auth: str = ""
    key: str = ""
    start: int = 0
    stop: int = 0
    version: int = -1
    tensor: str = ""
    lease: str = ""
    size: int = 0  # body bytes that follow (push only)
    checksum: str = ""  # SHA-256 hex of the pushed body (format.chunk_checksum)
    tree: list[Hop] = []


class Response(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    status: str
    message: str = ""
    size: int = 0  # body bytes that follow
    version: int = -1  # dense: the version the bytes are from
    versions: list[int] = []
    failed: list[str] = []  # push: addresses in the subtree that did not get the chunk


_T = TypeVar("_T")
_req_decoder = msgspec.json.Decoder(Request)
_resp_decoder = msgspec.json.Decoder(Response)
_encoder = msgspec.json.Encoder()


def tree_size(tree: list[Hop]) -> int:
    return len(_nodes(tree))


def tree_depth(tree: list[Hop]) -> int:
    """Hops on the longest path from the top of `tree` (0 for an empty tree)."""
    depth, level = 0, list(tree)
    while level:
        depth += 1
        level = [c for h in level for c in h.children]
    return depth


def _nodes(tree: list[Hop]) -> list[Hop]:
    """Every hop of `tree`, breadth first (iteratively: a tree's depth is the sender's choice)."""
    out, level = [], list(tree)
    while level:
        out += level
        level = [c for h in level for c in h.children]
    return out


def addresses(hop: Hop) -> list[str]:
    """Every address in the subtree rooted at `hop`, itself first."""
    return [hop.addr, *(a for c in hop.children for a in addresses(c))]


def auth_subject(req: Request) -> tuple[str, str, str]:
    """(method, path, body_digest) for `auth.sign`/`verify`: every content-selecting field."""
    tree = _encoder.encode(req.tree).decode() if req.tree else ""
    digest = f"{req.start}:{req.stop}:{req.version}:{req.tensor}:{req.lease}:{req.size}:" \
             f"{req.checksum}:{tree}"
    return req.op, req.key, digest


def pack(magic: bytes, header: msgspec.Struct) -> bytes:
    raw = _encoder.encode(header)
    if len(raw) > MAX_HEADER:
        raise LimitError(f"frame header of {len(raw)} bytes exceeds {MAX_HEADER}")
    return PREFIX.pack(magic, len(raw)) + raw


def header_length(prefix: bytes, magic: bytes, where: str) -> int:
    """Validate a frame prefix; the header length that follows. Raises LimitError."""
    if len(prefix) != PREFIX.size:
        raise LimitError(f"{where}: frame prefix of {len(prefix)} bytes, expected {PREFIX.size}")
    got, hlen = PREFIX.unpack(prefix)
    if got != magic:
        raise LimitError(f"{where}: not a weighthub frame (magic {got!r}, expected {magic!r})")
    if not 0 < hlen <= MAX_HEADER:
        raise LimitError(f"{where}: frame header length {hlen} outside 1..{MAX_HEADER}")
    return hlen


def decode_request(raw: bytes, where: str) -> Request:
    """Parse and validate a request header (sizes and ops) before anything is allocated."""
    req = _decode(_req_decoder, raw, where, "request")
    if req.op not in OPS:
        raise LimitError(f"{where}: unknown op {req.op!r}; known: {list(OPS)}")
    if not 0 <= req.start <= req.stop <= _MAX_INT or not 0 <= req.size <= _MAX_INT \
            or not -1 <= req.version <= _MAX_INT:
        raise LimitError(f"{where}: bad size/range/version (size {req.size}, [{req.start}, "
                         f"{req.stop}), version {req.version})")
    if req.op != "push" and req.size:
        raise LimitError(f"{where}: op {req.op!r} takes no body")
    if tree_depth(req.tree) > MAX_TREE_DEPTH:
        raise LimitError(f"{where}: relay tree deeper than {MAX_TREE_DEPTH} hops")
    if tree_size(req.tree) > MAX_TREE_NODES:
        raise LimitError(f"{where}: relay tree over {MAX_TREE_NODES} nodes")
    return req


def decode_response(raw: bytes, where: str) -> Response:
    """Parse a response header; its body size is the caller's to bound. Raises LimitError."""
    resp = _decode(_resp_decoder, raw, where, "response")
    if not 0 <= resp.size <= _MAX_INT:
        raise LimitError(f"{where}: response body size {resp.size} outside 0..2^63-1")
    return resp


def _decode(decoder: msgspec.json.Decoder[_T], raw: bytes, where: str, what: str) -> _T:
    """One header, every failure a LimitError (the peer is broken or hostile)."""
    try:
        return decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise LimitError(f"{where}: bad {what} header: {exc}") from None
    except RecursionError:  # only a relay tree nests: bounded by MAX_TREE_DEPTH once decoded
        raise LimitError(f"{where}: bad {what} header: JSON nested too deeply") from None


def parse_addr(addr: str) -> tuple[str, int]:
    """'host:port' -> (host, port). Raises LimitError."""
    host, sep, port = addr.rpartition(":")
    # isdigit() alone takes "²" and other non-ASCII digits that int() refuses
    if not sep or not host or not (port.isascii() and port.isdigit()) or len(port) > 5 \
            or not 0 < int(port) < 65536:
        raise LimitError(f"peer address {addr!r} is not 'host:port'")
    return host.strip("[]"), int(port)
