"""Affine shard → canonical maps (DTensor / FSDP / tensor-parallel) and their tiling check.

`layout.dtensor` (DTensor boxes) is imported on its own: it pulls in torch.distributed.tensor,
which receivers that only check box coverage do not need.
"""

from .box import ShardBox
from .membership import segment_outside
from .pieces import Piece, Run, plan_pieces
from .tiling import check_tiling

__all__ = ["Piece", "Run", "ShardBox", "check_tiling", "plan_pieces", "segment_outside"]
