"""Publishing: baseline → bounded encode/upload stream → commit, one pipeline for every publisher.

    publish/
      options.py    PublishOptions: every option, checked once
      baseline.py   the committed state the next delta is taken against; advances on commit
      shards.py     what a rank holds: each tensor's local shard, its box, its bits
      group.py      the collective seam: SoloGroup (one process), TorchGroup (trainer ranks)
      agree.py      step 1: the ranks agree on version, base and tensor table
      stream.py     step 2: chunks encoded and put as a bounded pipeline, digests summed
      commit.py     step 3: manifest assembly, the create-only write, retention
      sharded.py    ShardedPublisher: the pipeline (anchors, skip deltas, retention included)
      single.py     Publisher: the pipeline on a group of one

The single-process `Publisher` is the world-size-1 case of `ShardedPublisher`: the same code
agrees, streams, commits and writes anchors and skip deltas for both.
"""

from ..codec.coding import ENCODE_PROFILES as ENCODE_PROFILES  # re-exported: its home until now
from .commit import collect_garbage, model_id
from .options import DELTA_SPAN_BYTES, FULL_SPAN_BYTES, PublishOptions
from .result import PublishResult
from .sharded import ShardedPublisher
from .single import Publisher

__all__ = ["DELTA_SPAN_BYTES", "ENCODE_PROFILES", "FULL_SPAN_BYTES", "PublishOptions",
           "PublishResult", "Publisher", "ShardedPublisher", "collect_garbage", "model_id"]
