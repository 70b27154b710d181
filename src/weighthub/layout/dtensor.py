"""Shard boxes of DTensors (torch.distributed.tensor): Shard(dim) and Replicate placements.

The box comes from the DTensor's own placement rules (`compute_local_shape_and_global_offset`,
the function DTensor uses to place its shards, uneven shards included), so it cannot drift from
what `to_local()` holds. Of the ranks holding the same replicated block, the one at coordinate 0
of every mesh dim with a Replicate placement publishes it.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..errors import PlacementError
from .box import ShardBox


def dtensor_box(name: str, t: DTensor) -> ShardBox:
    """The canonical box of this rank's local shard of `t`.

    Raises:
        PlacementError: for placements other than Shard/Replicate (Partial holds unreduced
            values, strided shards are not boxes), or a local tensor of an unexpected shape.
    """
    mesh = t.device_mesh
    for p in t.placements:
        if type(p) not in (Shard, Replicate):
            raise PlacementError(f"tensor {name!r}: placement {p} is not supported (only Shard(dim) "
                                 "and Replicate); redistribute it before publishing")
    coord = mesh.get_coordinate()
    if coord is None:
        raise PlacementError(f"tensor {name!r}: this rank is not in the DTensor's device mesh")
    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
    local = t.to_local()
    if tuple(local.shape) != tuple(shape):
        raise PlacementError(f"tensor {name!r}: local shard has shape {list(local.shape)}, its "
                             f"placements {list(t.placements)} give {list(shape)}")
    primary = all(c == 0 for c, p in zip(coord, t.placements, strict=True) if isinstance(p, Replicate))
    return ShardBox(tuple(t.shape), tuple(offset), tuple(shape), primary)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's own data of a DTensor, or the tensor itself (never a gathered copy)."""
    return t.to_local() if isinstance(t, DTensor) else t
