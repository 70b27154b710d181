"""What the transaction engine applies: steps of decoded chunks, whatever they came from.

A `Step` is one representation brought into a target: a delta (forward, or inversely when
rolling back), or a full representation. Every input of the engine is expressed this way:

    store route      the manifests of catalog.plan's route, their chunks fetched through the
                     sources and decoded before the pause (`stage`)
    elastic join     the version's manifest as a full representation whose chunks are whole
                     tensors read as dense ranges from holders (`cluster.join`), streamed while
                     the (empty) target is open
    compact replay   the tensors a LoGRA step rewrites, replayed on the host and handed over as
                     dense words (`train.compact`)

The manifest says what the step may write (its chunk table's coverage), what it must be bound
to (its base root) and, through `expect`, what the tensors' digests must be afterwards.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING

from ..format import ChunkFrame, ChunkRef, Manifest
from ..tensors import TensorSpec

if TYPE_CHECKING:
    from ..codec.prepared import PreparedSegment
    from .device import DeviceSegment
    from .rows import RowPlan


@dataclass(frozen=True, slots=True)
class Chunk:
    """A decoded chunk, ready to apply: its segments and the coverage its manifest gives it.

    `olds`: per segment, Σ mix(i, held word) over what it will rewrite, computed while staging
    from the held bits (the first delta of a route only); None where not computed.
    `decoded`: per segment, its decoding for a tensor the target holds on a device
    (`receive.device`), done while staging; None where not (host tensors, later steps).
    `prepared`: per segment, its words computed against the held bits of a host tensor
    (`codec.prepared`: the pause only scatters them), done while staging the route's first
    step forwards; None where not.
    `rows`: which prepared segments the pause scatters as rows, chosen while staging against
    the views it read (`receive.rows`); None: chosen in the pause.
    """

    frame: ChunkFrame
    ref: ChunkRef
    olds: Sequence[bytes | None] | None = None
    decoded: Sequence[DeviceSegment | None] | None = None
    prepared: Sequence[PreparedSegment | None] | None = None
    rows: RowPlan | None = None


@dataclass(frozen=True, slots=True)
class Step:
    """One representation to apply.

    manifest: what is applied: its tensor table, base binding and chunk table (`base` None: a
        full representation, which rewrites every range its chunks cover).
    chunks: a list once staged, or a stream that a source fills while the target is open (the
        engine applies each chunk as it arrives; the stream may raise, which rolls back).
    inverse: apply the delta `manifest` inversely, from its version back to its base.
    expect: the manifest of the version the step arrives at, whose digests and root the result
        must have: `manifest` itself (default), or for an inverse step a manifest of its base.
    specs: the manifest's tensor table, built when the step is made, before the pause (a table
        of a model with thousands of tensors takes milliseconds to build), unless the caller
        built it already (`table`). An inverse step's `expect` has the same table
        (`routes.expected_base` checks it).
    changes_per_tensor: the mean `changed` of the manifest's tensors that changed (what the
        apply's thread count follows: `receive.apply.apply_threads`); 0 if none did.
    """

    manifest: Manifest
    chunks: Iterable[Chunk]
    inverse: bool = False
    expect: Manifest | None = None
    table: InitVar[list[TensorSpec] | None] = None
    specs: list[TensorSpec] = field(init=False)
    changes_per_tensor: float = field(init=False)

    def __post_init__(self, table: list[TensorSpec] | None) -> None:
        object.__setattr__(self, "specs", self.manifest.specs() if table is None else table)
        changed = [t.changed for t in self.manifest.tensors if t.changed > 0]
        object.__setattr__(self, "changes_per_tensor", sum(changed) / len(changed) if changed else 0.0)

    @property
    def arrives(self) -> Manifest:
        return self.expect if self.expect is not None else self.manifest

    @property
    def full(self) -> bool:
        return self.manifest.base is None
