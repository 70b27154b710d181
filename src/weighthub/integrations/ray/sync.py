"""WeightSync: a weighthub sync group on a Ray cluster.

    sync = WeightSync.create("s3://bucket/policy")    # hub actor + a node daemon per Ray node
    publisher = sync.publisher()                      # on the trainer (rank 0 of the policy)
    sync.attach_engine(rollout_actor)                 # each rollout actor (a RolloutEngine)

The hub runs on the driver's Ray node; one node daemon runs on every Ray node (node-affinity,
not soft), labelled from the Ray node's labels (`region`, `zone`; the host is the Ray node id,
so engines on one node share its staging cache and daemon). Daemons are restarted by Ray
(`max_restarts`) at the same address with their state (`daemons`). Engines read each chunk from
their node daemon's relay cache in place (the relay tree, which crosses each region once, pushed
it there), then their node's staging cache, then its daemon, then the store; the publisher
pushes down the hub's relay tree while it encodes.

A trainer outside Ray (torchrun): `WeightSync.create(...).save_spec(path)` on the driver, then
`WeightSync.connect(path).publisher()` on the trainer: only the store, the hub's address and the
secret are needed there (no Ray).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ...cluster.hubclient import HubClient
from ...cluster.publisher import NetPublisher
from ...cluster.topology import Labels
from ...engines.warm import warm_kernels
from ...errors import PeerTimeout, UsageError
from ...publish import ShardedPublisher
from ...publish.options import PublishOptions
from ...store import open_store
from .daemons import CACHE_SUBDIR, STAGE_SUBDIR, HubDaemon, NodeDaemon
from .heap import REFIT_RUNTIME_ENV
from .ranks import RankPublisher
from .spec import NodeSpec, SyncSpec

LABEL_KEYS = {"region": ("region", "ray.io/region", "topology.kubernetes.io/region"),
              "zone": ("zone", "ray.io/availability-zone", "topology.kubernetes.io/zone")}
DEFAULT_TIMEOUT_S = 120.0


def labels_of(ray_node: dict[str, Any]) -> Labels:
    """A Ray node's weighthub labels: region and zone from its labels, host = its node id."""
    ray_labels = ray_node.get("Labels") or {}

    def first(keys: Iterable[str]) -> str:
        return next((str(ray_labels[k]) for k in keys if ray_labels.get(k)), "")

    return Labels(region=first(LABEL_KEYS["region"]), zone=first(LABEL_KEYS["zone"]),
                  host=str(ray_node["NodeID"])[:16])


class WeightSync:
    """A sync group; see the module docstring. `create` on a Ray driver, `connect` elsewhere."""

    def __init__(self, spec: SyncSpec, *, hub: Any = None, nodes: dict[str, Any] | None = None,
                 options: dict[str, Any] | None = None) -> None:
        self.spec = spec
        self._hub = hub  # actor handles (None when connected from outside Ray)
        self._nodes = dict(nodes or {})
        self._options = dict(options or {})

    # -- making a group -------------------------------------------------------------------------
    @classmethod
    def create(cls, store_url: str, *, name: str = "weighthub", secret: bytes | None = None,
               host: str | None = None, work_dir: str | None = None, lease_ttl: float = 10.0,
               retain: int = 8, degree: int = 4, timeout: float = 10.0,
               max_restarts: int = -1, skip_nodes: Iterable[str] = ()) -> WeightSync:
        """Start the hub and a node daemon on every alive Ray node (ray.init() first).

        Args:
            store_url: where versions are committed (a path, file://, s3://).
            name: the group's name (actor names; staging directories).
            secret: shared secret (default: 32 random bytes, handed to members in the spec).
            host: the address daemons listen on (default: each Ray node's IP).
            work_dir: per-node state directories (default: the temp dir).
            lease_ttl, retain, degree: the hub's (`serve hub`); timeout: the nodes' (`serve node`).
            max_restarts: Ray's restarts per daemon (-1: always).
            skip_nodes: Ray node ids that get no daemon, now or in `add_nodes` (nodes that run
                no engine, e.g. the trainer's: a daemon keeps a host copy of the model and
                applies every version, for nothing there).
        """
        import ray

        if not ray.is_initialized():
            raise UsageError("WeightSync.create needs a Ray cluster: call ray.init() first "
                             "(or WeightSync.connect(spec) outside Ray)")
        open_store(store_url)  # a bad URL fails here, not in every daemon
        secret = secret or secrets.token_bytes(32)
        root = work_dir or os.path.join(tempfile.gettempdir(), f"weighthub-ray-{name}")
        options = {"name": name, "host": host, "root": root, "timeout": timeout,
                   "max_restarts": max_restarts, "skip": frozenset(skip_nodes)}
        here = ray.get_runtime_context().get_node_id()
        hub = _actor(HubDaemon, here, max_restarts, f"{name}-hub").remote(
            os.path.join(root, "hub"), secret, host or _node_ip(ray, here),
            lease_ttl=lease_ttl, retain=retain, degree=degree)
        address = ray.get(hub.address.remote(), timeout=DEFAULT_TIMEOUT_S)
        sync = cls(SyncSpec(name, store_url, address, secret, {}), hub=hub, options=options)
        sync.add_nodes()
        return sync

    @classmethod
    def connect(cls, spec: SyncSpec | str | os.PathLike[str]) -> WeightSync:
        """Join an existing group from its spec (or a spec file) — no Ray needed."""
        return cls(spec if isinstance(spec, SyncSpec) else SyncSpec.load(spec))

    def add_nodes(self) -> list[str]:
        """Start daemons on alive Ray nodes that have none yet (nodes that joined later),
        except the skipped ones."""
        import ray

        if self._hub is None:
            raise UsageError("add_nodes runs on the driver that created the group")
        o = self._options
        started = {}
        for n in ray.nodes():
            node_id = n["NodeID"]
            if not n.get("Alive") or node_id in self.spec.nodes or node_id in o["skip"]:
                continue
            labels = labels_of(n)
            state = os.path.join(o["root"], f"node-{node_id[:16]}")
            handle = _actor(NodeDaemon, node_id, o["max_restarts"],  # stages every version:
                            f"{o['name']}-node-{node_id[:16]}",  # keeps freed pages (`heap`)
                            runtime_env=REFIT_RUNTIME_ENV).remote(
                self.spec.store_url, self.spec.hub, self.spec.secret, node_id, labels, state,
                o["host"] or n["NodeManagerAddress"], timeout=o["timeout"])
            started[node_id] = (handle, labels, state)
        addresses = ray.get([h.address.remote() for h, _, _ in started.values()],
                            timeout=DEFAULT_TIMEOUT_S)
        nodes = dict(self.spec.nodes)
        for (node_id, (handle, labels, state)), address in zip(started.items(), addresses, strict=True):
            nodes[node_id] = NodeSpec(address, labels, os.path.join(state, STAGE_SUBDIR),
                                      os.path.join(state, CACHE_SUBDIR))
            self._nodes[node_id] = handle
        self.spec = SyncSpec(self.spec.name, self.spec.store_url, self.spec.hub, self.spec.secret,
                             nodes)
        return list(started)

    def save_spec(self, path: str | os.PathLike[str]) -> Path:
        """The spec as a JSON file (mode 0600: it holds the secret), for `connect` elsewhere."""
        return self.spec.save(path)

    # -- members --------------------------------------------------------------------------------
    def publisher(self, *, labels: Labels | None = None, host: str | None = None,
                  **publisher_options: Any) -> NetPublisher:
        """A started NetPublisher into the group's store, relaying down the hub's tree.

        `host`: where its chunk server listens (nodes fetch the chunks a push missed from it).
        Default: loopback when the group's hub listens on loopback (one machine), else this
        Ray node's IP (or loopback outside Ray). `publisher_options`: as `Publisher` (encode,
        anchor_every, retain, workers, ...). Close it when done. The first in a process
        compiles or loads the codec kernels first (~1 s, `engines.warm`), not the first publish.
        """
        warm_kernels()
        hub = HubClient(self.spec.hub, self.spec.secret, labels=labels)
        return NetPublisher(open_store(self.spec.store_url), self.spec.secret, hub=hub,
                            host=host or self._reachable_host(), **publisher_options).start()

    def _reachable_host(self) -> str:
        """An address of this process that the group's nodes can reach (see `publisher`)."""
        hub_host = self.spec.hub.rpartition(":")[0].strip("[]")
        if hub_host in ("127.0.0.1", "::1", "localhost"):
            return "127.0.0.1"
        try:
            import ray
        except ImportError:
            return "127.0.0.1"
        return str(ray.util.get_node_ip_address()) if ray.is_initialized() else "127.0.0.1"

    def sharded_publisher(self, *, group: Any = None, committer: int = 0,
                          **publisher_options: Any) -> RankPublisher:
        """This trainer rank's publisher when the policy is sharded over ranks (every rank
        calls `publish` with its shards; see `ShardedPublisher`). `group`: the torch.distributed
        group of the trainer ranks (default: the world) or a `publish.group.Group`; the
        `committer` rank writes manifests and announces each version to the hub. Warms the
        codec kernels as `publisher` does."""
        warm_kernels()
        store = open_store(self.spec.store_url)
        if group is not None and hasattr(group, "all_gather") and hasattr(group, "world"):
            pub = ShardedPublisher.on_group(store, group, committer=committer,
                                            options=PublishOptions(**publisher_options))
        else:
            pub = ShardedPublisher(store, group=group, committer=committer, **publisher_options)
        hub = HubClient(self.spec.hub, self.spec.secret) if pub.rank == committer else None
        return RankPublisher(pub, store, hub)

    def attach_engine(self, engine: Any, *, version: int | None = None,
                      timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
        """Bind a rollout actor (a `RolloutEngine`) to the group; its bind result.

        `version`: the version its engine was started from (default: found by digest)."""
        import ray

        return dict(ray.get(engine.weighthub_attach.remote(self.spec, version), timeout=timeout))

    def node_daemon(self, node_id: str) -> Any:
        """The actor handle of a Ray node's daemon (driver only)."""
        self.spec.node(node_id)
        return self._nodes[node_id]

    @property
    def hub_actor(self) -> Any:
        return self._hub

    def wait_daemons(self, *, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, str]:
        """Block until the hub and every node daemon answer (after Ray restarted one, say);
        name -> address. Raises PeerTimeout naming the first that did not."""
        import ray

        daemons = {"hub": self._hub, **self._nodes}
        deadline = time.monotonic() + timeout
        out = {}
        for name, handle in daemons.items():
            while True:
                try:
                    out[name] = ray.get(handle.address.remote(), timeout=max(0.1, min(
                        5.0, deadline - time.monotonic())))
                    break
                except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError) as exc:
                    if time.monotonic() >= deadline:
                        raise PeerTimeout(f"weighthub daemon {name} did not answer within "
                                          f"{timeout:g} s ({type(exc).__name__}); see `ray status` "
                                          "and the actor's log") from exc
                    time.sleep(0.2)
        return out

    def wait_nodes(self, version: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
        """Block until every node daemon holds `version` (or newer); node id -> held. A daemon
        that Ray is restarting meanwhile is asked again (within `timeout`)."""
        import ray

        deadline = time.monotonic() + timeout
        out = {}
        for node_id, handle in self._nodes.items():
            while True:
                left = max(0.1, deadline - time.monotonic())
                try:
                    out[node_id] = ray.get(handle.wait_version.remote(version, left),
                                           timeout=left + 10)
                    break
                except ray.exceptions.ActorUnavailableError:
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.2)
        return out

    def close(self) -> None:
        """Stop and remove every daemon this driver started."""
        import ray

        handles = [*self._nodes.values(), *([self._hub] if self._hub is not None else [])]
        for h in handles:
            with contextlib.suppress(Exception):  # a dead or hung actor is killed below
                ray.get(h.stop.remote(), timeout=15)
            ray.kill(h, no_restart=True)
        self._nodes.clear()
        self._hub = None


def _node_ip(ray: Any, node_id: str) -> str:
    for n in ray.nodes():
        if n["NodeID"] == node_id:
            return str(n["NodeManagerAddress"])
    raise UsageError(f"Ray node {node_id[:12]}… is not in the cluster")


def _actor(cls: type, node_id: str, max_restarts: int, name: str, **options: Any) -> Any:
    """`cls` as a Ray actor pinned to `node_id` (not soft: a daemon serves its own node)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(cls).options(
        name=name, num_cpus=0, max_restarts=max_restarts, max_task_retries=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), **options)
