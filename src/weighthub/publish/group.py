"""The publisher's collective seam: the ranks that publish one version together.

A publish runs the same collective steps on every rank (see `publish.sharded`): gather what
each rank proposes and wrote, broadcast the committer's outcome. `SoloGroup` is a group of one
(the single-process `Publisher`): its collectives return at once. `TorchGroup` runs them over a
torch.distributed process group, every wait bounded by the group's timeout
(`init_process_group(timeout=)`); a peer that fails or dies there is PeerUnavailable.

A rank's own failure travels to the others as a `Failure` (error class name and message), so
every rank raises the same kind of error and nothing is committed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .. import errors
from ..errors import PeerUnavailable, UsageError, WeighthubError


class Group(Protocol):
    """The ranks of one publish. Every rank calls every collective, in the same order."""

    rank: int
    world: int

    def all_gather(self, obj: Any, doing: str) -> list[Any]:
        """Every rank's `obj`, in rank order. Raises PeerUnavailable if a rank failed or died."""
        ...

    def broadcast(self, obj: Any, src: int, doing: str) -> Any:
        """Rank `src`'s `obj` on every rank. Raises PeerUnavailable if the group failed."""
        ...


class SoloGroup:
    """A group of one: the single-process publisher."""

    rank = 0
    world = 1

    def all_gather(self, obj: Any, doing: str) -> list[Any]:
        return [obj]

    def broadcast(self, obj: Any, src: int, doing: str) -> Any:
        return obj


class TorchGroup:
    """A torch.distributed process group of trainer ranks (default: the world).

    Raises:
        UsageError: torch.distributed is not initialized on this rank.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise UsageError("ShardedPublisher needs torch.distributed initialized "
                             "(init_process_group) on every trainer rank")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def all_gather(self, obj: Any, doing: str) -> list[Any]:
        out: list[Any] = [None] * self.world
        try:
            self._dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as exc:
            raise PeerUnavailable(f"rank {self.rank}: the trainer group failed while {doing} "
                                  f"({exc}); nothing was committed, the baseline is unchanged: "
                                  "restart the group and publish again") from exc
        return out

    def broadcast(self, obj: Any, src: int, doing: str) -> Any:
        box = [obj]
        try:
            self._dist.broadcast_object_list(box, src=src, group=self.group)
        except RuntimeError as exc:
            raise PeerUnavailable(f"rank {self.rank}: the trainer group failed while {doing} "
                                  f"({exc})") from exc
        return box[0]


@dataclass(frozen=True, slots=True)
class Failure:
    """A rank's error, as it travels to the other ranks."""

    rank: int
    kind: str  # class name in weighthub.errors
    message: str

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> Failure:
        return cls(rank, type(exc).__name__, str(exc))


def error_class(kind: str) -> type[WeighthubError]:
    """The weighthub error class named `kind` (PeerUnavailable for anything else)."""
    cls = getattr(errors, kind, None)
    return cls if isinstance(cls, type) and issubclass(cls, WeighthubError) else PeerUnavailable


def raise_failures(failures: Sequence[Failure | None], rank: int,
                   own: BaseException | None = None) -> None:
    """Raise if any rank failed: this rank's own error (`own`, as raised) first, else the first
    other rank's, as its error class, saying which rank failed and that nothing was committed."""
    failed = [f for f in failures if f is not None]
    if not failed:
        return
    if own is not None:
        raise own
    mine = next((f for f in failed if f.rank == rank), None)
    f = mine or failed[0]
    where = "" if mine else f"rank {f.rank} failed: "
    raise error_class(f.kind)(f"{where}{f.message}; nothing was committed")
