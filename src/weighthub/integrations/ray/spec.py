"""SyncSpec: everything a process needs to join a sync group, as a small picklable/JSON value.

A `WeightSync` hands it to every trainer rank and rollout actor; a trainer that is not a Ray
actor (a torchrun job) reads it from the JSON file `WeightSync.save_spec` wrote. It carries
the shared secret: write it only where the group's processes alone can read it (mode 0600).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...cluster.topology import Labels
from ...errors import UsageError
from ...net.auth import MIN_SECRET_BYTES


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One Ray node's daemon: where it listens, its labels, its host staging directory, and its
    relay cache (engines on the node read pushed chunks there in place; "" for none)."""

    address: str
    labels: Labels
    stage_dir: str
    cache_dir: str = ""


@dataclass(frozen=True, slots=True)
class SyncSpec:
    """A sync group: its store, hub, secret and the node daemon of every Ray node (by node id)."""

    name: str
    store_url: str
    hub: str
    secret: bytes = field(repr=False)
    nodes: dict[str, NodeSpec]

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_SECRET_BYTES:
            raise UsageError(f"sync group {self.name!r}: the secret must be at least "
                             f"{MIN_SECRET_BYTES} bytes, got {len(self.secret)}")

    def node(self, node_id: str) -> NodeSpec:
        """The daemon of Ray node `node_id`.

        Raises:
            UsageError: none (the node joined the Ray cluster after the group was created:
                `WeightSync.add_nodes()` starts its daemon).
        """
        spec = self.nodes.get(node_id)
        if spec is None:
            raise UsageError(f"sync group {self.name!r} has no node daemon on Ray node "
                             f"{node_id[:12]}… (it has {len(self.nodes)}): call "
                             "sync.add_nodes() after nodes join the cluster")
        return spec

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "store_url": self.store_url, "hub": self.hub,
                           "secret": self.secret.hex(),
                           "nodes": {k: {"address": n.address, "labels": n.labels.to_dict(),
                                         "stage_dir": n.stage_dir, "cache_dir": n.cache_dir}
                                     for k, n in self.nodes.items()}},
                          indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, where: str = "sync spec") -> SyncSpec:
        try:
            doc: Any = json.loads(text)
            nodes = {str(k): NodeSpec(str(n["address"]), Labels.from_dict(n["labels"], where=where),
                                      str(n["stage_dir"]), str(n.get("cache_dir", "")))
                     for k, n in doc["nodes"].items()}
            return cls(str(doc["name"]), str(doc["store_url"]), str(doc["hub"]),
                       bytes.fromhex(doc["secret"]), nodes)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UsageError(f"{where} is not a weighthub sync spec ({type(exc).__name__}: {exc}); "
                             "write it with WeightSync.save_spec") from exc

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write as JSON, readable by its owner only (it holds the secret)."""
        out = Path(path)
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.to_json())
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SyncSpec:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise UsageError(f"cannot read sync spec {path}: {exc.strerror}") from exc
        return cls.from_json(text, where=f"sync spec {path}")
