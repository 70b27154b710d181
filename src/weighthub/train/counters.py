"""LoGRA's step counters, kept in its first param group so that checkpoints carry them.

torch's `Optimizer.state_dict()` saves per-parameter state and every param group's settings;
`load_state_dict()` restores both. Counters stored as plain attributes would be lost, and a
resumed run would restart its bias corrections (m_t, v_t), its refresh schedule and its
projection epoch: different bits than the uninterrupted run. A param-group entry is saved.
"""

from __future__ import annotations

from typing import Any

COUNTERS = ("steps", "applied_steps", "epoch", "m_t", "v_t")


def counter(name: str) -> Any:
    """A property reading and writing `param_groups[0][name]` (the group dict is replaced by
    `load_state_dict`, so it is looked up on every access)."""

    def get(self: Any) -> int:
        return int(self.param_groups[0][name])

    def put(self: Any, value: int) -> None:
        self.param_groups[0][name] = value

    return property(get, put, doc=f"{name}, saved in state_dict() with the first param group")
