"""Relay-tree planning for one refit: who forwards the version's chunks to whom. Pure functions.

`plan_tree(publisher, receivers, degree)` builds the tree; `replan(tree, failed)` repairs it when
nodes die. Both are deterministic: the same input gives the same tree, so every node that asks
the hub sees one plan.

What a plan guarantees (each is a property test in tests/unit/test_plan.py):
- Every receiver appears exactly once; the publisher is the root; it is a tree.
- Region boundaries are the slow links: every remote region that has receivers is entered by
  exactly one edge, into the region's root, from a node of the publisher's region (the payload
  crosses each boundary once, whatever the number of receivers behind it).
- Inside a region every node has at most `degree` children. The whole tree keeps that bound
  too, unless the publisher's region (m nodes) has fewer free slots, m·(degree−1)+1, than there
  are remote regions: then the extra region roots go to the least-loaded publisher-region nodes
  beyond `degree` — one more stream on a fast fabric costs less than a second slow-link crossing.
- Locality: each host's receivers form one connected subtree (exactly one edge enters a host from
  outside, none for the publisher's host), and likewise each zone's, so same-host children hang
  under a same-host parent.
- Depth: remote region roots take the publisher's shallowest slots (keeping one for its own
  region). Inside a region hosts are placed one after another (the publisher's first, then big
  zones and big hosts first), each growing breadth-first from the shallowest free slot of its
  host, else zone, else region. A region of one host is thus a complete `degree`-ary tree, the
  minimal depth; several hosts add roughly one host subtree's depth (locality is worth it: with
  cut-through forwarding a level costs one chunk's latency, a cross-host hop costs bandwidth).

`replan` moves only the orphans (survivors whose parent failed), each with its subtree intact, to
the nearest live node with a free slot (same host, zone, region; a remote region's orphans stay in
their region when any of it is still attached, else re-enter it from the publisher's region).
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import FormatError, UsageError, WeighthubError
from .topology import Labels, tier

MAX_DEGREE = 1024
_NO_LABELS = Labels()


@dataclass(frozen=True, slots=True)
class Node:
    """A tree member: a holder id and where it runs."""

    id: str
    labels: Labels = _NO_LABELS


@dataclass(frozen=True)
class RelayTree:
    """A relay plan: `children[id]` lists, in order, whom `id` forwards to (every node has an entry).

    Treat as immutable: `replan` returns a new tree.
    """

    root: str
    degree: int
    labels: Mapping[str, Labels]
    children: Mapping[str, tuple[str, ...]]

    def parents(self) -> dict[str, str]:
        """child id -> parent id (the root has none)."""
        return {c: p for p, cs in self.children.items() for c in cs}

    def order(self) -> list[str]:
        """Breadth-first order from the root, children in their listed order."""
        out, queue = [], deque([self.root])
        while queue:
            n = queue.popleft()
            out.append(n)
            queue.extend(self.children[n])
        return out

    def depths(self) -> dict[str, int]:
        d = {self.root: 0}
        for n in self.order():
            for c in self.children[n]:
                d[c] = d[n] + 1
        return d

    def crossings(self) -> list[tuple[str, str]]:
        """Edges (parent, child) that cross a region boundary."""
        return [(p, c) for p, cs in self.children.items() for c in cs
                if self.labels[p].region != self.labels[c].region]

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "degree": self.degree,
                "labels": {n: self.labels[n].to_dict() for n in sorted(self.labels)},
                "children": {n: list(self.children[n]) for n in sorted(self.children)}}

    @classmethod
    def from_dict(cls, doc: Any) -> RelayTree:
        """Parse and check a plan (from the hub or the database): one root, a tree, known nodes.

        Raises:
            FormatError: anything that is not a well-formed tree.
        """
        try:
            root, degree = doc["root"], doc["degree"]
            labels = {str(n): Labels.from_dict(v, where=f"plan node {n!r}") for n, v in doc["labels"].items()}
            children = {str(n): tuple(str(c) for c in cs) for n, cs in doc["children"].items()}
        except (KeyError, TypeError, AttributeError, UsageError) as exc:
            raise FormatError(f"relay plan does not parse ({exc!r}); expected root, degree, labels, "
                              "children") from exc
        if not isinstance(degree, int) or not 1 <= degree <= MAX_DEGREE or root not in labels:
            raise FormatError(f"relay plan: bad degree {degree!r} or root {root!r} not among its nodes")
        if set(children) != set(labels):
            raise FormatError("relay plan: children and labels name different nodes")
        tree = cls(root=root, degree=degree, labels=labels, children=children)
        listed = [c for cs in children.values() for c in cs]
        # checked in this order, order() cannot meet an unknown id or loop forever
        if not set(listed) <= set(labels) or len(listed) != len(set(listed)) or root in listed \
                or len(tree.order()) != len(labels):
            raise FormatError("relay plan: not a tree (a node listed twice, a cycle or an unreachable node)")
        return tree


class _Builder:
    """Grows a tree node by node, placing each at the shallowest free slot of the nearest group.

    Free slots are kept in heaps per host, zone and region keyed by (depth, placement index);
    full nodes are dropped lazily when they reach the top. O(n log n).
    """

    def __init__(self, root: Node, degree: int):
        self.degree = degree
        self.labels: dict[str, Labels] = {root.id: root.labels}
        self.children: dict[str, list[str]] = {root.id: []}
        self.depth = {root.id: 0}
        self.index = {root.id: 0}
        self.free: dict[tuple[str, ...], list[tuple[int, int, str]]] = defaultdict(list)
        self._offer(root.id)

    def _groups(self, labels: Labels) -> tuple[tuple[str, ...], ...]:
        return (("h", *labels.host_key), ("z", *labels.zone_key), ("r", labels.region))

    def _offer(self, nid: str) -> None:
        for g in self._groups(self.labels[nid]):
            heapq.heappush(self.free[g], (self.depth[nid], self.index[nid], nid))

    def _top(self, group: tuple[str, ...]) -> str | None:
        heap = self.free.get(group)
        while heap and len(self.children[heap[0][2]]) >= self.degree:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def attach(self, node: Node, parent: str) -> None:
        self.labels[node.id] = node.labels
        self.children[node.id] = []
        self.children[parent].append(node.id)
        self.depth[node.id] = self.depth[parent] + 1
        self.index[node.id] = len(self.index)
        self._offer(node.id)

    def nearest_free(self, labels: Labels) -> str | None:
        """The shallowest node with a free slot on the same host, else zone, else region."""
        for g in self._groups(labels):
            found = self._top(g)
            if found is not None:
                return found
        return None

    def feeder(self, region: str) -> str:
        """Who in `region` feeds one more remote region root: a free slot if any, else the least loaded."""
        found = self._top(("r", region))
        if found is not None:
            return found
        members = [n for n, lab in self.labels.items() if lab.region == region]
        return min(members, key=lambda n: (len(self.children[n]), self.depth[n], self.index[n]))

    def fill(self, nodes: Sequence[Node]) -> None:
        """Place nodes one by one in the given (locality) order, each at its nearest free slot.

        Placing a host's nodes back to back keeps its subtree connected: while they are placed
        nothing else grows, and its newest node is a leaf with a free slot for the next one.
        """
        for n in nodes:
            parent = self.nearest_free(n.labels)
            if parent is None:  # cannot happen: the region's entry is placed and leaves are free
                raise WeighthubError(f"relay planner: no free slot for {n.id!r} in a tree of "
                                     f"degree {self.degree}; this is a weighthub bug: please "
                                     "report it with the receivers' labels")
            self.attach(n, parent)

    def tree(self, root: str) -> RelayTree:
        return RelayTree(root=root, degree=self.degree, labels=dict(self.labels),
                         children={n: tuple(cs) for n, cs in self.children.items()})


def _locality_order(nodes: Iterable[Node], first: Labels | None = None) -> list[Node]:
    """Group members contiguous: `first`'s zone and host first (the publisher's), then big zones,
    big hosts within them, then by id (big subtrees get the shallow slots)."""
    nodes = list(nodes)
    zone_size: dict[tuple[str, str], int] = defaultdict(int)
    host_size: dict[tuple[str, str, str], int] = defaultdict(int)
    for n in nodes:
        zone_size[n.labels.zone_key] += 1
        host_size[n.labels.host_key] += 1
    fz = first.zone_key if first else None
    fh = first.host_key if first else None
    return sorted(nodes, key=lambda n: (n.labels.zone_key != fz, -zone_size[n.labels.zone_key],
                                        n.labels.zone, n.labels.host_key != fh,
                                        -host_size[n.labels.host_key], n.labels.host, n.id))


def _check(publisher: Node, receivers: Sequence[Node], degree: int) -> None:
    if not isinstance(degree, int) or not 1 <= degree <= MAX_DEGREE:
        raise UsageError(f"relay fan-out degree must be an integer in 1..{MAX_DEGREE}, got {degree!r}")
    seen = {publisher.id}
    for r in receivers:
        if not r.id:
            raise UsageError("relay plan: a receiver has an empty id")
        if r.id in seen:
            what = "is the publisher" if r.id == publisher.id else "appears twice"
            raise UsageError(f"relay plan: receiver {r.id!r} {what}; ids must be unique")
        seen.add(r.id)


def plan_tree(publisher: Node, receivers: Sequence[Node], degree: int) -> RelayTree:
    """Plan the relay tree of one refit (see the module docstring for its guarantees).

    Args:
        publisher: the root; it streams chunks while encoding.
        receivers: the subscribed receivers (ids unique, the publisher not among them).
        degree: the fan-out bound, ≥ 1.

    Raises:
        UsageError: bad degree, duplicate or empty ids.
    """
    _check(publisher, receivers, degree)
    home = publisher.labels.region
    by_region: dict[str, list[Node]] = defaultdict(list)
    for r in receivers:
        by_region[r.labels.region].append(r)
    local = _locality_order(by_region.pop(home, []), publisher.labels)
    remote = sorted(by_region, key=lambda reg: (-len(by_region[reg]), reg))
    members = {reg: _locality_order(by_region[reg]) for reg in remote}

    b = _Builder(publisher, degree)
    # The biggest remote regions get the publisher's own slots (shallowest), one kept for home.
    early = max(0, min(len(remote), degree - (1 if local else 0)))
    for reg in remote[:early]:
        b.attach(members[reg][0], publisher.id)
    b.fill(local)
    for reg in remote[early:]:
        b.attach(members[reg][0], b.feeder(home))
    for reg in remote:
        b.fill(members[reg][1:])
    return b.tree(publisher.id)


def replan(tree: RelayTree, failed_ids: Iterable[str]) -> RelayTree:
    """Remove failed nodes; re-attach each orphaned subtree whole to the nearest live free slot.

    Idempotent: ids not in the tree (already removed, or never there) are ignored.

    Raises:
        UsageError: the publisher (root) is among the failed: there is nothing to relay from;
            the refit is aborted and receivers fetch from holders or the store.
    """
    failed = set(failed_ids) & set(tree.labels)
    if tree.root in failed:
        raise UsageError(f"relay plan: the publisher {tree.root!r} failed; abort this refit "
                         "(receivers fetch from holders or the store)")
    if not failed:
        return tree
    old_order = tree.order()
    rank = {n: i for i, n in enumerate(old_order)}
    parents = tree.parents()
    orphans = [n for n in old_order if n not in failed and parents.get(n) in failed]
    children = {n: [c for c in cs if c not in failed] for n, cs in tree.children.items() if n not in failed}

    def subtree(top: str) -> list[str]:
        out, queue = [], deque([top])
        while queue:
            n = queue.popleft()
            out.append(n)
            queue.extend(children[n])
        return out

    depth: dict[str, int] = {}
    for n in subtree(tree.root):
        depth[n] = 0 if n == tree.root else depth[parents[n]] + 1
    home = tree.labels[tree.root].region
    for o in orphans:
        lab = tree.labels[o]
        same = [n for n in depth if tree.labels[n].region == lab.region]
        allowed = same or [n for n in depth if tree.labels[n].region == home]
        free = [n for n in allowed if len(children[n]) < tree.degree]
        if free:
            parent = min(free, key=lambda n: (tier(lab, tree.labels[n]), depth[n], rank[n]))
        else:  # every allowed node is full: exceed the degree rather than cross a slow link twice,
            # on a node with the fewest children in the orphan's region (in-region fan-out stays ≤ d)
            def load(n: str, region: str = lab.region) -> tuple[int, int, int, int]:
                inside = sum(tree.labels[c].region == region for c in children[n])
                return (inside, len(children[n]), depth[n], rank[n])
            parent = min(allowed, key=load)
        children[parent].append(o)
        base = depth[parent] + 1
        for n in subtree(o):  # internal edges of a moved subtree are unchanged: old parents hold
            depth[n] = base if n == o else depth[parents[n]] + 1
    return RelayTree(root=tree.root, degree=tree.degree,
                     labels={n: lab for n, lab in tree.labels.items() if n not in failed},
                     children={n: tuple(cs) for n, cs in children.items()})

