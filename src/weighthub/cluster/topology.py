"""Topology labels and source ranking: which holder is "near" to whom.

A node is labelled by where it runs: region ⊃ zone ⊃ host. Distance is the first label that
differs, so a zone name means something only inside its region and a host name only inside its
zone (two clusters may both have a "node-0"). The tiers, nearest first:

    host    same region, zone and host (loopback / shared memory)
    zone    same region and zone (one rack or availability zone)
    region  same region (the fast fabric)
    remote  another region: the slow link that relay trees cross once
    store   the object store, the last resort (not a holder)

Pure functions, no I/O: the hub ranks, the relay planner groups with these.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError

TIERS = ("host", "zone", "region", "remote")
MAX_LABEL = 128


@dataclass(frozen=True, slots=True, order=True)
class Labels:
    """Where a node runs. Empty strings are valid labels (an unlabelled node is its own group)."""

    region: str = ""
    zone: str = ""
    host: str = ""

    @property
    def zone_key(self) -> tuple[str, str]:
        return (self.region, self.zone)

    @property
    def host_key(self) -> tuple[str, str, str]:
        return (self.region, self.zone, self.host)

    def to_dict(self) -> dict[str, str]:
        return {"region": self.region, "zone": self.zone, "host": self.host}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any] | None, *, where: str = "labels") -> Labels:
        """Parse labels from JSON; missing keys are empty. Raises UsageError on wrong types/sizes."""
        if doc is None:
            return cls()
        if not isinstance(doc, Mapping):
            raise UsageError(f"{where} must be an object with region/zone/host, got {type(doc).__name__}")
        unknown = sorted(set(doc) - {"region", "zone", "host"})
        if unknown:
            raise UsageError(f"{where}: unknown label(s) {unknown}; known: region, zone, host")
        values = []
        for name in ("region", "zone", "host"):
            v = doc.get(name, "")
            if not isinstance(v, str) or len(v) > MAX_LABEL:
                raise UsageError(f"{where}.{name} must be a string of at most {MAX_LABEL} chars")
            values.append(v)
        return cls(*values)


def tier(a: Labels, b: Labels) -> int:
    """0 same host, 1 same zone, 2 same region, 3 another region (index into TIERS)."""
    if a.region != b.region:
        return 3
    if a.zone != b.zone:
        return 2
    return 0 if a.host == b.host else 1


@dataclass(frozen=True, slots=True)
class Candidate:
    """A live holder of the wanted version, as the ranking sees it."""

    id: str
    address: str
    labels: Labels
    load: int


def rank(candidates: Iterable[Candidate], asker: Labels, key: str) -> list[tuple[Candidate, str]]:
    """Order holders for `asker`: nearest tier first, least loaded first within a tier.

    Ties (same tier and load) are broken by a hash of (key, holder id): deterministic for one key,
    yet different keys of one version spread over equally good holders (striping, not a hot spot).

    Returns:
        (candidate, tier name) pairs, best first.
    """
    def order(c: Candidate) -> tuple[int, int, bytes, str]:
        spread = hashlib.blake2b(f"{key}\0{c.id}".encode(), digest_size=8).digest()
        return (tier(asker, c.labels), c.load, spread, c.id)

    return [(c, TIERS[tier(asker, c.labels)]) for c in sorted(candidates, key=order)]


def parse_labels(text: str) -> Labels:
    """'region=a,zone=z1,host=h1' (a command line's --labels) -> Labels. Raises UsageError."""
    doc: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise UsageError(f"--labels: {part!r} is not name=value (e.g. region=a,zone=z1,host=h1)")
        doc[name.strip()] = value.strip()
    return Labels.from_dict(doc, where="--labels")
