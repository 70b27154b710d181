"""Keep the heap of a long-lived refit process out of the refit window: full garbage
collections (`freeze_startup_heap`) and pages handed back to the kernel (`REFIT_MALLOC_ENV`).

A trainer or rollout process holds a large heap of objects that live as long as it does (torch
modules, transformers, Ray's runtime), and CPython's full (generation-2) collection walks all of
them whenever it runs. In the RL demo one ran inside the trainer's publish about one step in
four and paused it for 0.30 s, longer than the whole publish (~0.2 s). `gc.freeze()` after
start-up moves what exists then into a permanent generation that collections skip, so a later
full collection walks only what the steps allocated. vLLM's engine core does the same after its
start-up. Objects frozen here are still freed by reference counting; only cycles among them
would outlive their use, and start-up state lives as long as the process anyway.
"""

from __future__ import annotations

import gc

# glibc malloc settings for a process that stages or publishes every step; glibc reads them
# when the process starts, so they go in its environment (a Ray actor's
# `runtime_env={"env_vars": REFIT_MALLOC_ENV}`, or the shell of a torchrun trainer). Each
# staging allocates about 20 bytes per changed word in fresh arrays (positions, words, values),
# and by default glibc gives freed memory back to the kernel (large blocks as their own
# mappings, the top of a heap past a trim threshold) and gives new threads (a staging's pool)
# arenas of their own: the next version faults the same pages in again, zero-filled. In the RL
# demo's engines that was 1.5-7k page faults and 8-24 ms of kernel time per staging; with these
# settings, ~10 faults from the second refit on and staging CPU 75 -> 64 ms per engine (one run,
# steps 1-4). The price: such a process keeps the memory of its largest staging or publish
# rather than returning it, and its threads share two arenas (weighthub's allocations are few
# and large).
REFIT_MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "2",
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),  # glibc's largest: blocks up to it come from a heap
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),  # never trim a heap's top for staging-sized frees
}
REFIT_RUNTIME_ENV = {"env_vars": REFIT_MALLOC_ENV}  # a Ray actor's `runtime_env` option


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object tracked now; the number frozen in all."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
