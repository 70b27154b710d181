"""catalog.plan against a brute force over every route, on many random version histories.

A history is a set of committed versions, each with representations: anchors (full), deltas
from any earlier version (chain steps and skip deltas), some invertible. The brute force walks
every simple path of steps allowed by the same rules (a full representation can begin a route
anywhere; a delta goes from its base to its version, or, if invertible and its base committed,
back; forward routes stay in (start, target], backward ones in [0, start]) and keeps the
cheapest by (payload bytes, inverse steps). plan must return a route of exactly that cost,
and the route must be valid step by step.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from weighthub import catalog
from weighthub.errors import NoSyncPath, VersionNotFound

N_HISTORIES = 300


def _history(rng: random.Random) -> dict[int, list[catalog.Rep]]:
    # coarse byte counts, so that routes often tie on bytes and the inverse-step tie-break counts
    n = rng.randint(1, 7)
    reps: dict[int, list[catalog.Rep]] = {}
    for v in range(n):
        rs = []
        if v == 0 or rng.random() < 0.3:
            rs.append(catalog.Rep(v, None, f"v{v}/full", 10 * rng.randint(3, 8)))
        for base in range(v):
            if (base == v - 1 and rng.random() < 0.9) or rng.random() < 0.25:
                rs.append(catalog.Rep(v, base, f"v{v}/delta-{base}", 10 * rng.randint(0, 3),
                                      invertible=rng.random() < 0.5))
        reps[v] = rs
    return reps


def _brute(reps: dict[int, list[catalog.Rep]], start: int | None,
           target: int) -> tuple[int, int] | None:
    if start is not None and start < target:
        lo, hi = start, target
    else:
        lo, hi = -1, target if start is None else start
    steps: list[tuple[int | None, int, catalog.Rep]] = []  # (from, to, rep); from None: anywhere
    for v, rs in reps.items():
        if not lo < v <= hi:
            continue
        for r in rs:
            if r.base is None:
                steps.append((None, v, r))
            else:
                steps.append((r.base, v, r))
                if r.invertible and r.base in reps:
                    steps.append((v, r.base, replace(r, inverse=True)))
    best: tuple[int, int] | None = None

    def walk(node: int | None, seen: frozenset[int | None], cost: tuple[int, int]) -> None:
        nonlocal best
        if node == target:
            best = cost if best is None or cost < best else best
            return
        for frm, to, r in steps:
            if (frm is None or frm == node) and to not in seen:
                walk(to, seen | {to}, (cost[0] + r.payload_bytes, cost[1] + r.inverse))

    origin = start
    walk(origin, frozenset({origin}), (0, 0))
    return best


def _valid(route: list[catalog.Rep], start: int | None, target: int) -> bool:
    at = start
    for r in route:
        if r.base is None:
            at = r.version
        elif r.inverse:
            if at != r.version:
                return False
            at = r.base
        else:
            if at != r.base:
                return False
            at = r.version
    return at == target


@pytest.mark.parametrize("seed", range(N_HISTORIES))
def test_plan_matches_brute_force(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    reps = _history(rng)
    monkeypatch.setattr(catalog, "list_versions", lambda store: sorted(reps))
    monkeypatch.setattr(catalog, "representations", lambda store, v: list(reps[v]))
    store = type("FakeStore", (), {"url": f"memory://history-{seed}"})()
    for start in [None, *reps]:
        for target in reps:
            want = _brute(reps, start, target)
            if want is None:
                with pytest.raises(NoSyncPath):
                    catalog.plan(store, start, target)  # type: ignore[arg-type]
                continue
            route = catalog.plan(store, start, target)  # type: ignore[arg-type]
            got = (sum(r.payload_bytes for r in route), sum(r.inverse for r in route))
            assert got == want, (seed, start, target, [r.label for r in route])
            assert _valid(route, start, target), (seed, start, target, [r.label for r in route])


def test_plan_refuses_an_uncommitted_target(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(catalog, "list_versions", lambda store: [0, 1])
    store = type("FakeStore", (), {"url": "memory://x"})()
    with pytest.raises(VersionNotFound, match="version 5 is not committed"):
        catalog.plan(store, None, 5)  # type: ignore[arg-type]
