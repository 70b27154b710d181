"""Publisher: one process publishes successive states of a model (a group of one).

It is the sharded pipeline (`publish.sharded`) on a `SoloGroup`: every tensor is whole, the
collectives return at once, chunks are named `c000123.whc` (no rank), and a publisher that
starts on a store holding versions adopts the latest one as its baseline (reading it back as a
receiver does), so it goes on with deltas.
"""

from __future__ import annotations

from ..codec import EncodePolicy
from ..store import Store
from .group import SoloGroup
from .options import DELTA_SPAN_BYTES, FULL_SPAN_BYTES, PublishOptions
from .sharded import ShardedPublisher


class Publisher(ShardedPublisher):
    """Publishes successive states of one model to a store.

    `publish(state)` commits `state` (name → tensor, on any device) as the next version: full
    if the store is empty, else a delta from the last committed version. Chunks are encoded on
    `workers` threads and written while later ones are still encoding; the manifest goes last,
    create-only: that is the commit. The baseline advances only after the commit succeeds.

    Args:
        store: where versions go.
        anchor_every, skip_every, retain, policy, workers, delta_span_bytes, full_span_bytes,
            backend, host_baseline, delta_chunk_bytes: see `PublishOptions`.

    Raises:
        UsageError: an option `PublishOptions` refuses.
    """

    def __init__(self, store: Store, *, anchor_every: int = 16, skip_every: int = 0,
                 retain: int = 0, policy: EncodePolicy | None = None, workers: int = 2,
                 delta_span_bytes: int = DELTA_SPAN_BYTES,
                 full_span_bytes: int = FULL_SPAN_BYTES, backend: str = "auto",
                 host_baseline: bool = False,
                 delta_chunk_bytes: int | None = None) -> None:
        options = PublishOptions(anchor_every, skip_every, retain, policy or EncodePolicy(),
                                 workers, delta_span_bytes, full_span_bytes, backend,
                                 host_baseline, delta_chunk_bytes)
        self._setup(store, SoloGroup(), 0, options)
