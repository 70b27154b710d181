"""What a rank holds: each canonical tensor's local shard, its box and its bits.

A DTensor's box comes from its placements; a plain tensor's from `shard_map`; in a single
process (`whole=True`) a plain tensor is the whole canonical tensor. Only this rank's own shard
is ever read, and nothing is gathered. A shard on a CUDA device stays there (its bits are a
torch word view, scanned on the device: codec/device_encode.py) unless the publisher was told
to copy it to the host (`backend="host"`); `backend="torch"` keeps even CPU shards as torch
views, which is how CPU-only tests run the device code.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import PlacementError, UsageError
from ..layout import ShardBox
from ..tensors import DType, TensorSpec, bits, dtype_of, word_view

Table = list[tuple[str, str, tuple[int, ...]]]  # (name, dtype, global shape), name order


@dataclass(slots=True)
class Shard:
    """One canonical tensor as this rank holds it."""

    index: int  # position in the canonical (name-ordered) tensor table
    spec: TensorSpec  # the canonical tensor
    box: ShardBox
    new: np.ndarray | torch.Tensor  # flat local bits (a view of the local tensor when it is
    # contiguous): numpy words on the host, or a torch integer view where the device path runs

    @property
    def published(self) -> bool:
        """Does this rank write chunks (and digest contributions) for the tensor?"""
        return self.box.primary and self.box.numel > 0


@functools.lru_cache(maxsize=1024)
def whole_box(shape: tuple[int, ...]) -> ShardBox:
    """The box of a whole tensor of `shape` (immutable: one per shape, not one per tensor and
    publish, whose checks cost ~2 µs each for a model of thousands of like-shaped tensors)."""
    return ShardBox(shape, (0,) * len(shape), shape)


# What `resolve` found for a contiguous plain host tensor, by name, and the layout it found it
# for: while a tensor keeps its storage address, dtype, shape and strides (and its shard_map
# box), the next publish skips the checks and takes its spec, box and table entry
# from here (a model of 8000 tensors: resolve 60-96 → ~40 ms a publish). Not its words: a
# view would keep a tensor the caller let go (a fresh copy each publish) alive until the next.
KeptShards = dict[str, tuple[tuple[object, ...], TensorSpec, ShardBox,
                             tuple[str, str, tuple[int, ...]]]]


def resolve(state: Mapping[str, torch.Tensor], shard_map: Mapping[str, ShardBox] | None, *,
            whole: bool, backend: str = "auto", kept: KeptShards | None = None
            ) -> tuple[dict[str, Shard], Table]:
    """This rank's shards of `state` and the tensor table they claim, in name order.

    Args:
        whole: a plain tensor without a shard_map entry is the whole tensor (a single process).
        backend: "auto" (scan where each shard lives: CUDA shards on their device), "host"
            (copy device shards to the host) or "torch" (torch views everywhere).
        kept: the publisher's `KeptShards`, used and updated.

    Raises:
        UsageError: shard_map names a tensor not in the state, or a dtype weighthub does not carry.
        PlacementError: a plain tensor without a box (in a group), a local shard whose shape is
            not its box's, or a DTensor placement weighthub cannot map.
    """
    shard_map = shard_map or {}
    unknown = sorted(set(shard_map) - set(state))
    if unknown:
        raise UsageError(f"shard_map names tensors not in the state: {unknown[:5]}")
    # a DTensor's class is loaded only if someone made one: plain publishers skip its import
    dtensor_mod = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(dtensor_mod, "DTensor", None)
    shards: dict[str, Shard] = {}
    table: Table = []
    for name in sorted(state):
        t = state[name]
        key = None
        if kept is not None and backend != "torch" and t.is_cpu \
                and not (dtensor is not None and isinstance(t, dtensor)):
            key = (t.data_ptr(), t.dtype, t.shape, t.stride(),
                   shard_map.get(name) if shard_map else None)
            hit = kept.get(name)
            if hit is not None and hit[0] == key:
                _, spec, box, entry = hit
                table.append(entry)
                shards[name] = Shard(-1, spec, box, _contiguous_bits(t, spec.dtype))
                continue
        if dtensor is not None and isinstance(t, dtensor):
            from ..layout.dtensor import dtensor_box

            box = dtensor_box(name, t)
            local = t.to_local().detach()
        elif name in shard_map:
            box, local = shard_map[name], t.detach()
        elif whole:
            box, local = whole_box(tuple(t.shape)), t.detach()
        else:
            raise PlacementError(f"tensor {name!r} is a plain tensor with no entry in "
                                 "shard_map: pass its ShardBox (or a DTensor)")
        if tuple(local.shape) != box.shape:
            raise PlacementError(f"tensor {name!r}: local shard has shape {list(local.shape)}, "
                                 f"its box says {list(box.shape)}")
        if local.device.type not in ("cpu", "cuda"):
            raise UsageError(f"tensor {name!r} is on {local.device}: weighthub publishes from "
                             "host or CUDA memory")
        on_device = local.device.type != "cpu"
        if on_device and backend == "host":
            local, on_device = local.cpu(), False  # only this rank's own shard is copied
        dtype = dtype_of(local)
        spec = TensorSpec(name, dtype, box.global_shape)
        table.append((name, dtype.name, box.global_shape))
        words = word_view(local) if on_device or backend == "torch" else bits(local)
        shards[name] = Shard(-1, spec, box, words)
        if kept is not None and key is not None and local.is_contiguous():  # not a copy
            kept[name] = (key, spec, box, table[-1])
    if kept is not None:
        for gone in kept.keys() - state.keys():
            del kept[gone]
    return shards, table


def _contiguous_bits(t: torch.Tensor, dtype: DType) -> np.ndarray:
    """`bits(t)` of a contiguous host tensor of `dtype` (what `KeptShards` vouches for)."""
    flat = t.detach() if t.requires_grad else t
    if flat.dim() != 1:
        flat = flat.view(-1)
    return flat.view(dtype.torch_words).numpy().view(dtype.uint)
