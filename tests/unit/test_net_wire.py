"""The chunk-server frame format: golden bytes, and hostile headers refused before allocation."""

from __future__ import annotations

import msgspec
import pytest

from weighthub.errors import LimitError
from weighthub.net import wire


def test_golden_request_and_response_bytes() -> None:
    req = wire.pack(wire.REQUEST_MAGIC, wire.Request("get", auth="WH1 1 n s", key="v000000000001/a.whc"))
    assert req == (b'WHQ1\x00\x00\x00\x93{"op":"get","auth":"WH1 1 n s","key":"v000000000001/a.whc",'
                   b'"start":0,"stop":0,"version":-1,"tensor":"","lease":"","size":0,"checksum":"",'
                   b'"tree":[]}')
    resp = wire.pack(wire.RESPONSE_MAGIC, wire.Response("ok", size=5))
    assert resp == (b'WHS1\x00\x00\x00L{"status":"ok","message":"","size":5,"version":-1,"versions":[],'
                    b'"failed":[]}')


def test_round_trip_with_a_relay_tree() -> None:
    tree = [wire.Hop("127.0.0.1:1", [wire.Hop("127.0.0.1:2"), wire.Hop("[::1]:3")])]
    req = wire.Request("push", key="v000000000001/c.whc", size=10, checksum="ab", tree=tree)
    raw = wire.pack(wire.REQUEST_MAGIC, req)
    hlen = wire.header_length(raw[:8], wire.REQUEST_MAGIC, "test")
    assert wire.decode_request(raw[8:8 + hlen], "test") == req
    assert wire.addresses(tree[0]) == ["127.0.0.1:1", "127.0.0.1:2", "[::1]:3"]


@pytest.mark.parametrize("prefix", [b"WHS1\x00\x00\x00\x10", b"WHQ1\x00\x00\x00\x00",
                                    b"WHQ1\x7f\xff\xff\xff", b"HTTP/1.1"])
def test_bad_prefixes_are_refused(prefix: bytes) -> None:
    with pytest.raises(LimitError):
        wire.header_length(prefix, wire.REQUEST_MAGIC, "test")


@pytest.mark.parametrize("header", [
    b"not json", b'{"op":"delete"}', b'{"op":"get","size":5}', b'{"op":"push","size":-1}',
    b'{"op":"range","start":10,"stop":5}', b'{"op":"get","evil":1}', b'{"op":"get","start":"0"}',
])
def test_hostile_request_headers_are_refused(header: bytes) -> None:
    with pytest.raises(LimitError):
        wire.decode_request(header, "test")


def test_an_oversized_relay_tree_is_refused() -> None:
    tree = [wire.Hop(f"127.0.0.1:{i + 1}") for i in range(wire.MAX_TREE_NODES + 1)]
    raw = wire.Request("push", key="v000000000001/c.whc", tree=tree)
    with pytest.raises(LimitError, match="relay tree"):
        wire.decode_request(msgspec.json.encode(raw), "test")


def test_every_content_field_is_in_the_signed_subject() -> None:
    base = wire.Request("push", key="v000000000001/c.whc", start=1, stop=2, version=3, tensor="t",
                        lease="l", size=4, checksum="c", tree=[wire.Hop("h:1")])
    changes = dict(op="get", key="v000000000001/d.whc", start=0, stop=3, version=4, tensor="u",
                   lease="m", size=5, checksum="d", tree=[wire.Hop("h:2")])
    for field, value in changes.items():
        assert wire.auth_subject(msgspec.structs.replace(base, **{field: value})) != \
            wire.auth_subject(base), field


@pytest.mark.parametrize("addr", ["localhost", "h:", ":80", "h:0", "h:65536", "h:x"])
def test_bad_addresses_are_refused(addr: str) -> None:
    with pytest.raises(LimitError):
        wire.parse_addr(addr)


def test_addresses_parse() -> None:
    assert wire.parse_addr("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert wire.parse_addr("[::1]:9") == ("::1", 9)
