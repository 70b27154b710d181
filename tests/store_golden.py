"""Golden digests of a store's contents: SHA-256 of every object, with its random parts masked.

A publisher's output is deterministic except for three things: the token naming each
representation's chunk directory (`from-000000000003-<12 hex>/`), the publisher id written into
manifests (`host:pid:<8 hex>`, a sharded group adds `/<token>`), and the manifest's `created`
time. `masked_objects` replaces exactly those with fixed text, in keys and in manifest bytes,
and leaves every other byte as stored: chunk frames are hashed as they are.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

_TOKEN = re.compile(rb"((?:full|from-\d{12})-)[0-9a-f]{12}(?=/)")
_PUBLISHER = re.compile(rb'"publisher":"[^"]*?(/[0-9a-f]{12})?"')
_CREATED = re.compile(rb'"created":[-+0-9.eE]+')


def _mask(raw: bytes) -> bytes:
    raw = _TOKEN.sub(rb"\1TOKEN", raw)
    raw = _PUBLISHER.sub(lambda m: b'"publisher":"PUBLISHER' + (b"/TOKEN" if m.group(1) else b"")
                         + b'"', raw)
    return _CREATED.sub(b'"created":0', raw)


def _keys(store: Any, prefix: str = "") -> list[str]:
    out = []
    for name in store.children(prefix):
        key = f"{prefix}/{name}" if prefix else name
        sub = store.children(key)
        if sub:
            out += _keys(store, key)
        else:
            out.append(key)
    return out


def masked_objects(store: Any) -> dict[str, str]:
    """Masked key → SHA-256 hex of the masked object, for every object in `store`."""
    out: dict[str, str] = {}
    for key in _keys(store):
        masked = _mask(key.encode()).decode()
        if masked in out:
            raise AssertionError(f"two objects mask to {masked!r}: the golden check is ambiguous")
        out[masked] = hashlib.sha256(_mask(store.get(key))).hexdigest()
    return dict(sorted(out.items()))


def digest_by_version(objects: dict[str, str]) -> dict[str, str]:
    """One SHA-256 per version directory over its masked (key, digest) lines, plus their count."""
    lines: dict[str, list[str]] = {}
    for key, digest in objects.items():
        lines.setdefault(key.split("/", 1)[0], []).append(f"{key} {digest}\n")
    return {d: f"{len(ls)}:" + hashlib.sha256("".join(ls).encode()).hexdigest()[:32]
            for d, ls in sorted(lines.items())}
