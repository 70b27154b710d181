"""Admission bookkeeping of a chunk server (net.admission): who is evicted at which cap, what a
connection counts against, and that any request header becomes a request or a refusal."""

from __future__ import annotations

import pytest

from weighthub.net import admission, auth, wire

SECRET = b"admission-test-secret-0123456789"


def test_at_the_source_cap_the_sources_oldest_goes() -> None:
    p: admission.Pending[str] = admission.Pending(max_total=100, max_per_source=2)
    assert p.add("a", "a1") == [] and p.add("b", "b1") == [] and p.add("a", "a2") == []
    assert p.add("a", "a3") == ["a1"]  # not b1, though it is older
    assert p.count("a") == 2 and "a1" not in p and "b1" in p and len(p) == 3


def test_at_the_total_cap_the_heaviest_sources_oldest_goes() -> None:
    p: admission.Pending[str] = admission.Pending(max_total=4, max_per_source=10)
    for h in ("peer", "x1", "x2", "x3"):
        p.add("me" if h == "peer" else "x", h)
    # the peer's connection is the oldest of all, but its source holds one: x pays
    assert p.add("y", "y1") == ["x1"]
    assert p.add("z", "z1") == ["x2"]
    assert "peer" in p and len(p) == 4


def test_removal_frees_the_slot_and_forgets_empty_sources() -> None:
    p: admission.Pending[str] = admission.Pending(max_total=1, max_per_source=1)
    p.add("a", "a1")
    assert p.remove("a1") and not p.remove("a1")
    assert p.count("a") == 0 and p.add("b", "b1") == []
    with pytest.raises(ValueError, match="pending caps"):
        admission.Pending(max_total=0, max_per_source=1)


@pytest.mark.parametrize(("host", "source"), [
    ("10.1.2.3", "10.1.2.3"),
    ("::ffff:10.1.2.3", "10.1.2.3"),  # a dual-stack listener's IPv4 client
    ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
    ("2001:db8:1:2:bbbb::9", "2001:db8:1:2::/64"),  # one host's /64 is one source
    ("fe80::1%eth0", "fe80::/64"),
])
def test_source_of(host: str, source: str) -> None:
    assert admission.source_of(host) == source


def test_any_header_is_a_request_or_a_refusal() -> None:
    replay = auth.ReplayGuard()
    good = wire.Request("versions")
    good = wire.Request("versions", auth=auth.sign(SECRET, *wire.auth_subject(good)))
    raw = wire.pack(wire.REQUEST_MAGIC, good)[wire.PREFIX.size:]
    assert admission.authenticate(raw, SECRET, replay, "here") == good
    deep = b'{"op": "push", "tree": ' + b'[{"addr": "a", "children": ' * 3000 + b"[]" + b"}]" * 3000 + b"}"
    for hostile, status in [
        (raw, wire.AUTH),  # replayed
        (b"\xff{", wire.BAD_REQUEST),
        (deep, wire.BAD_REQUEST),
        (wire.pack(wire.REQUEST_MAGIC, wire.Request("get", key="k", auth="WH1 \u00b2 n s"))[8:], wire.AUTH),
    ]:
        got = admission.authenticate(hostile, SECRET, replay, "here")
        assert isinstance(got, wire.Response) and got.status == status, got
        assert got.message.startswith("here"), got
