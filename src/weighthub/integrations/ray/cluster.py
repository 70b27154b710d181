"""A local Ray cluster of real raylets (not local mode), for the example and the tests."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

REGIONS = ("region-a", "region-b", "region-c", "region-d")


@contextlib.contextmanager
def local_cluster(nodes: int = 2, *, cpus_per_node: int = 4,
                  object_store_bytes: int = 1 << 30) -> Iterator[Any]:
    """`nodes` Ray nodes on this machine (a head and workers, each its own raylet and object
    store), labelled with a region each; connected (ray.init) for the block, shut down after."""
    import ray
    from ray.cluster_utils import Cluster

    def args(i: int) -> dict[str, Any]:
        return {"num_cpus": cpus_per_node, "object_store_memory": object_store_bytes,
                "labels": {"region": REGIONS[i % len(REGIONS)], "zone": f"zone-{i}"}}

    cluster = Cluster(initialize_head=True, head_node_args=args(0))
    try:
        for i in range(1, nodes):
            cluster.add_node(**args(i))
        ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=True)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
