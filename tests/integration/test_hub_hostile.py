"""A real hub facing malformed tokens and hostile JSON bodies answers 4xx with a clear message,
never 500, and keeps serving (issue #17 item 3)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest
from hub_helpers import HubProcess, signed_request, write_secret

from weighthub.cluster.hub import MAX_DEPTH
from weighthub.net.auth import AUTH_HEADER, body_digest, sign

pytestmark = pytest.mark.slow  # a hub process


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HubProcess, bytes]]:
    """One hub for the module: every case checks that it still serves afterwards."""
    tmp_path = tmp_path_factory.mktemp("hub")
    secret = write_secret(tmp_path / "secret")
    h = HubProcess.start(tmp_path / "hub.db", tmp_path / "secret")
    yield h, secret
    h.kill()


def _request(address: str, method: str, path: str, token: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One request with the token's exact bytes in the auth header (http.client sends bytes as is)."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        conn.putheader(AUTH_HEADER, token)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


SIG = b"0f" * 32
MALFORMED_TOKENS = [b"WH1 --5 abcd " + SIG, "WH1 \u00b2 abcd ".encode() + SIG, b"WH1 1 ab\xffcd " + SIG,
                    b"WH1 1 abcd " + SIG[:-2] + b"\xc3\xa9", b"WH1 " + b"9" * 40 + b" abcd " + SIG]


@pytest.mark.parametrize("token", MALFORMED_TOKENS)
def test_malformed_tokens_get_401_and_the_hub_keeps_serving(hub: tuple[HubProcess, bytes],
                                                            token: bytes) -> None:
    h, secret = hub
    status, raw = _request(h.address, "GET", "/v1/latest", token)
    doc = json.loads(raw)  # a JSON error document, not aiohttp's text 500 page
    assert (status, doc["error"]) == (401, "AuthError") and "malformed auth token" in doc["message"]
    assert signed_request(h.address, secret, "GET", "/v1/latest")[0] == 200


HOSTILE_BODIES = {
    "nested arrays": (b'{"id":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    "nested just past the limit": (b'{"id":' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}",
                                   "nested too deeply"),
    "a lone surrogate escape": (b'{"id": "h\\udcff", "address": "127.0.0.1:1"}', "lone surrogate"),
    "NaN": (b'{"id": "h", "address": "127.0.0.1:1", "load": NaN}', "NaN is not a JSON number"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_BODIES))
def test_hostile_json_bodies_get_400(hub: tuple[HubProcess, bytes], name: str) -> None:
    h, secret = hub
    body, match = HOSTILE_BODIES[name]
    for method, path in (("PUT", "/v1/holders"), ("POST", "/v1/versions"), ("POST", "/v1/plans/1/failed")):
        token = sign(secret, method, path, body_digest(body)).encode()
        status, raw = _request(h.address, method, path, token, body)
        doc = json.loads(raw)
        assert (status, doc["error"]) == (400, "UsageError"), (method, path, raw[:200])
        assert match in doc["message"]
    assert signed_request(h.address, secret, "GET", "/v1/holders") == (200, {"holders": []})


@pytest.mark.parametrize("method,path", [("GET", "/v1/plans/%C2%B2"), ("GET", "/v1/plans/%D9%A1"),
                                         ("POST", "/v1/plans/%C2%B2/failed"),
                                         ("GET", "/v1/sources?version=%C2%B2&key=k")])
def test_versions_of_non_ascii_digits_get_400(hub: tuple[HubProcess, bytes], method: str, path: str) -> None:
    """"²" passes str.isdigit() and int() refuses it; "١" (Arabic one) int() reads as 1."""
    h, secret = hub
    status, raw = _request(h.address, method, path, sign(secret, method, path).encode())
    doc = json.loads(raw)
    assert (status, doc["error"]) == (400, "UsageError")
    assert "must be a non-negative integer" in doc["message"]


@pytest.mark.parametrize("address", ["::::", "a:\u00b2", "a:" + "9" * 30, "a:0", "noport"])
def test_holder_addresses_peers_cannot_parse_get_400(hub: tuple[HubProcess, bytes], address: str) -> None:
    """The hub hands holder addresses to joiners as sources: one a peer cannot dial is refused
    at registration, not passed on."""
    h, secret = hub
    body = json.dumps({"id": "h-bad", "address": address, "labels": {}, "versions": []}).encode()
    status, doc = signed_request(h.address, secret, "PUT", "/v1/holders", body)
    assert (status, doc["error"]) == (400, "UsageError") and "must be host:port" in doc["message"]
    assert signed_request(h.address, secret, "GET", "/v1/holders") == (200, {"holders": []})
