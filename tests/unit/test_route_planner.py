"""catalog.plan against a brute force over every route, on many random version histories.

A history is a set of committed versions, each with representations: anchors (full), deltas
from any earlier version (chain steps and skip deltas), some invertible. The brute force walks
every simple path of steps allowed by the same rules (a full representation can begin a route
anywhere; a delta goes from its base to its version, or, if invertible and its base committed,
back; forward routes stay in (start, target], backward ones in [0, start]) and keeps the
cheapest by (payload bytes, inverse steps). plan must return a route of exactly that cost,
and the route must be valid step by step. Some histories lose versions (retention, a failed
publish), so routes may have to step around them.

A short forward route is planned from the directories of the versions it crosses (one listing
each, `PROBE_AHEAD`), anything else from a listing of the store: the brute force checks both.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from counting_store import CountingStore
from weighthub import catalog
from weighthub.errors import NoSyncPath, VersionNotFound
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store.memory import MemoryStore
from weighthub.targets import StateDictTarget

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


class _FakeStore:
    """Answers only what the planner lists: which version directories hold a manifest."""

    def __init__(self, url: str, committed: set[int]) -> None:
        self.url = url
        self.committed = committed

    def children(self, prefix: str) -> list[str]:
        v = int(prefix[1:])
        return [catalog.PRIMARY] if v in self.committed else []


@pytest.mark.parametrize("seed", range(N_HISTORIES))
def test_plan_matches_brute_force(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    reps = _history(rng)
    for v in [v for v in reps if v and rng.random() < 0.15]:  # deleted: retention, a failure
        del reps[v]
    monkeypatch.setattr(catalog, "list_versions", lambda store: sorted(reps))
    monkeypatch.setattr(catalog, "representations", lambda store, v, leaves=None: list(reps[v]))
    store = _FakeStore(f"memory://history-{seed}", set(reps))
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


def test_a_refit_plans_from_the_versions_it_crosses_not_the_whole_store() -> None:
    """One step forward lists that version's directory once and reads its manifest once,
    however many versions the store holds (a long run's refits must not slow down); a route
    longer than PROBE_AHEAD, or from nothing, lists the store as before, with the same result."""
    store = MemoryStore()
    target = StateDictTarget({})
    receiver = Receiver(store, target)
    pub = Publisher(store)
    torch.manual_seed(0)
    w = torch.randn(4096, dtype=torch.float32)
    for _ in range(12):
        w += 1e-2 * torch.randn_like(w)
        pub.publish({"w": w.to(torch.bfloat16)})
    receiver.sync(10)
    counting = CountingStore(store)
    route = catalog.plan(counting, 10, 11)  # type: ignore[arg-type]
    assert [r.label for r in route] == [catalog.rep_key(11, None, primary=True)]
    assert counting.listed == [catalog.version_dir(11)]
    assert counting.manifests_read == [catalog.rep_key(11, None, primary=True)]
    assert route[0].manifest is not None and route[0].manifest.version == 11
    far = catalog.plan(counting, 0, 11)  # type: ignore[arg-type]  # 11 > PROBE_AHEAD: listed
    assert "" in counting.listed and [r.version for r in far] == list(range(1, 12))
    with pytest.raises(VersionNotFound, match="version 12 is not committed"):
        catalog.plan(counting, 10, 12)  # type: ignore[arg-type]
    # the receiver stages from the planner's manifest: one read of it per sync
    counting.manifests_read.clear()
    Receiver(counting, target).sync(11)  # type: ignore[arg-type]
    assert counting.manifests_read.count(catalog.rep_key(11, None, primary=True)) == 1
    held = target.held()
    assert held is not None and held.version == 11


def test_the_latest_version_is_found_from_the_newest_directory_down() -> None:
    """One listing of the root and one of the newest version's directory, whatever the store
    holds; a newest directory without a manifest (a publish that failed) is passed over."""
    store = MemoryStore()
    pub = Publisher(store)
    for i in range(5):
        pub.publish({"w": torch.full((64,), float(i), dtype=torch.bfloat16)})
    store.put(f"{catalog.version_dir(5)}/delta-abc/c000000.whc", b"orphan chunk")
    store.put("notes/readme.txt", b"not a version")
    counting = CountingStore(store)
    assert catalog.latest_version(counting) == 4  # type: ignore[arg-type]
    assert counting.listed == ["", catalog.version_dir(5), catalog.version_dir(4)]
    assert catalog.latest_version(MemoryStore()) is None
    assert catalog.list_versions(store) == [0, 1, 2, 3, 4]
