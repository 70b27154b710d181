"""No cyclic garbage collection inside the refit's critical sections: a receiver's staging and
transaction (the transaction is the pause, the one window a rollout engine cannot hide; staging
is on the refit's path) and a publish (the trainer waits for it). A collection that lands in
one walks the whole heap.

CPython starts a collection whenever allocations outnumber deallocations by a threshold, in
whichever thread allocates. These sections allocate a few objects per tensor (a decoded
manifest's entries, views, digests, per-segment results), so a model with thousands of tensors
sets off dozens to hundreds of young collections in each and, every tenth of those, an older
one; each full (generation-2) collection walks every tracked object in the process. Measured
on this machine (8000 bf16 tensors, 2% changed, `fast`): a full collection landed in 2 of 10
pauses (+165-190 ms to pauses of 110-180 ms), in every one of 4 stagings (180-200 ms of
0.50-0.65 s; the route's plan, which decodes the manifest, went from 200-260 ms to 30-55) and
in 6 of 8 publishes beside a 300k-object heap (+150-180 ms to ~1.1 s).
`integrations.ray.freeze_startup_heap` shrinks what a full collection walks; this keeps every
collection out. What a section leaves for the collector is collected by the first collection
after it (in a rollout engine, while it generates); reference counting frees everything else at
once. A section lasts as long as its work: a staging or an elastic join that waits on a slow
link keeps the collector off for that long, holding whatever cyclic garbage the process makes
meanwhile (weighthub's own work makes next to none).

Sections may nest or overlap (two targets in one process, a node that publishes and applies):
the collector is switched back on when the last one ends, and only if it was on when the
first began. A process forked meanwhile runs none of its parent's sections: its collector is
switched back on at once (if it was on before them).
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def collections_deferred() -> Iterator[None]:
    """Cyclic garbage collection off for the duration (restored to what it was after)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


def _after_fork_in_child() -> None:
    global _depth, _lock
    _lock = threading.Lock()  # another thread of the parent may have held it
    if _depth and _was_enabled:
        gc.enable()
    _depth = 0


os.register_at_fork(after_in_child=_after_fork_in_child)
