"""Relay-tree planning (weighthub.cluster.plan): the guarantees of its docstring, as properties."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weighthub.cluster.plan import Node, RelayTree, plan_tree, replan
from weighthub.cluster.topology import Labels
from weighthub.errors import FormatError, UsageError

labels_st = st.builds(Labels, region=st.sampled_from("abc"), zone=st.sampled_from("xy"),
                      host=st.sampled_from("pq"))


@st.composite
def cases(draw: st.DrawFn, max_receivers: int = 40) -> tuple[Node, list[Node], int]:
    publisher = Node("pub", draw(labels_st))
    n = draw(st.integers(0, max_receivers))
    receivers = [Node(f"r{i:02d}", draw(labels_st)) for i in range(n)]
    return publisher, receivers, draw(st.integers(1, 5))


def region_of(tree: RelayTree, n: str) -> str:
    return tree.labels[n].region


def check_tree(tree: RelayTree, publisher: Node, receiver_ids: set[str]) -> None:
    """A tree rooted at the publisher holding every receiver exactly once."""
    assert tree.root == publisher.id
    order = tree.order()
    assert len(order) == len(set(order)) == len(receiver_ids) + 1
    assert set(order) == receiver_ids | {publisher.id}
    listed = Counter(c for cs in tree.children.values() for c in cs)
    assert all(v == 1 for v in listed.values()) and publisher.id not in listed
    assert RelayTree.from_dict(tree.to_dict()) == tree


def entering_edges(tree: RelayTree, key: Callable[[Labels], tuple[str, ...]]) -> Counter:
    """How many edges enter each group (parent outside the group, child inside)."""
    return Counter(key(tree.labels[c]) for p, cs in tree.children.items() for c in cs
                   if key(tree.labels[p]) != key(tree.labels[c]))


def check_crossings(tree: RelayTree) -> None:
    """Each remote region with nodes is entered exactly once, from the publisher's region."""
    home = region_of(tree, tree.root)
    remote = {lab.region for lab in tree.labels.values()} - {home}
    crossings = tree.crossings()
    assert len(crossings) == len(remote)
    assert {region_of(tree, c) for _, c in crossings} == remote
    assert all(region_of(tree, p) == home for p, _ in crossings)


def intra_region_fanout(tree: RelayTree, n: str) -> int:
    return sum(region_of(tree, c) == region_of(tree, n) for c in tree.children[n])


@given(cases())
def test_plan_contains_every_receiver_once(case: tuple[Node, list[Node], int]) -> None:
    publisher, receivers, d = case
    check_tree(plan_tree(publisher, receivers, d), publisher, {r.id for r in receivers})


@given(cases())
def test_each_remote_region_is_entered_exactly_once(case: tuple[Node, list[Node], int]) -> None:
    check_crossings(plan_tree(*case))


@given(cases())
def test_fanout_bound(case: tuple[Node, list[Node], int]) -> None:
    publisher, receivers, d = case
    tree = plan_tree(publisher, receivers, d)
    assert all(intra_region_fanout(tree, n) <= d for n in tree.labels)
    home = publisher.labels.region
    m = 1 + sum(r.labels.region == home for r in receivers)
    remote_regions = len({r.labels.region for r in receivers} - {home})
    over = [n for n in tree.labels if len(tree.children[n]) > d]
    # beyond d only when the home region runs out of slots, and then only in the home region
    assert (not over) == (remote_regions <= m * (d - 1) + 1)
    assert all(region_of(tree, n) == home for n in over)


@given(cases())
def test_hosts_and_zones_are_connected_subtrees(case: tuple[Node, list[Node], int]) -> None:
    publisher, receivers, d = case
    tree = plan_tree(publisher, receivers, d)
    for key in (lambda lab: lab.host_key, lambda lab: lab.zone_key):
        entered = entering_edges(tree, key)
        for group in {key(lab) for lab in tree.labels.values()}:
            assert entered[group] == (0 if group == key(publisher.labels) else 1), group


@given(st.integers(0, 200), st.integers(1, 6))
def test_single_host_tree_has_minimal_depth(n: int, d: int) -> None:
    lab = Labels("a", "x", "p")
    tree = plan_tree(Node("pub", lab), [Node(f"r{i}", lab) for i in range(n)], d)
    depth, capacity = 0, 0
    while capacity < n:  # the fewest levels below the root that hold n nodes at fan-out d
        depth += 1
        capacity += d ** depth
    assert max(tree.depths().values()) == depth


@given(cases(), st.randoms(use_true_random=False))
def test_plan_is_deterministic(case: tuple[Node, list[Node], int], rnd: random.Random) -> None:
    publisher, receivers, d = case
    shuffled = list(receivers)
    rnd.shuffle(shuffled)
    assert plan_tree(publisher, shuffled, d) == plan_tree(publisher, receivers, d)


@given(cases(), st.data())
def test_replan_reattaches_only_orphans(case: tuple[Node, list[Node], int], data: st.DataObject) -> None:
    publisher, receivers, d = case
    tree = plan_tree(publisher, receivers, d)
    failed = set(data.draw(st.lists(st.sampled_from([r.id for r in receivers]), unique=True))
                 if receivers else [])
    new = replan(tree, failed)
    survivors = {r.id for r in receivers} - failed
    check_tree(new, publisher, survivors)
    check_crossings(new)
    assert all(intra_region_fanout(new, n) <= d for n in new.labels)
    old_parent, new_parent = tree.parents(), new.parents()
    orphans = {n for n in survivors if old_parent[n] in failed}
    moved = {n for n in survivors if new_parent[n] != old_parent[n]}
    assert moved == orphans
    assert replan(new, failed) == new  # idempotent: reporting a failure twice changes nothing


def test_replan_prefers_the_orphans_region_and_host() -> None:
    pub = Node("pub", Labels("a", "x", "p"))
    remote = [Node(f"b{i}", Labels("b", "x", "p" if i < 4 else "q")) for i in range(7)]
    tree = plan_tree(pub, remote, 2)
    region_root = tree.children["pub"][0]
    new = replan(tree, [region_root])
    check_crossings(new)  # one orphan re-enters region b from the publisher; the other stays inside
    (entry,) = [c for p, c in new.crossings()]
    assert entry in tree.children[region_root]


def test_replan_of_the_publisher_is_refused() -> None:
    tree = plan_tree(Node("pub"), [Node("r1")], 2)
    with pytest.raises(UsageError, match="publisher 'pub' failed"):
        replan(tree, ["pub"])
    assert replan(tree, ["nobody"]) is tree


def test_publisher_feeds_remote_regions_before_its_own() -> None:
    pub = Node("pub", Labels("a"))
    receivers = [Node("a1", Labels("a")), Node("b1", Labels("b")), Node("c1", Labels("c")),
                 Node("c2", Labels("c"))]
    tree = plan_tree(pub, receivers, 3)
    assert tree.children["pub"] == ("c1", "b1", "a1")  # biggest remote region first, one slot kept


@pytest.mark.parametrize(("receivers", "degree", "message"), [
    ([Node("r1")], 0, "degree must be an integer"),
    ([Node("r1"), Node("r1")], 2, "'r1' appears twice"),
    ([Node("pub")], 2, "'pub' is the publisher"),
    ([Node("")], 2, "empty id"),
])
def test_bad_plan_input_is_refused(receivers: list[Node], degree: int, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        plan_tree(Node("pub"), receivers, degree)


@pytest.mark.parametrize("doc", [
    {"root": "a", "degree": 2, "labels": {"a": {}, "b": {}}, "children": {"a": ["b"], "b": ["a"]}},
    {"root": "a", "degree": 2, "labels": {"a": {}, "b": {}}, "children": {"a": [], "b": []}},
    {"root": "a", "degree": 2, "labels": {"a": {}}, "children": {"a": ["zz"]}},
    {"root": "a", "degree": 0, "labels": {"a": {}}, "children": {"a": []}},
    {"root": "a", "degree": 2, "labels": {"a": {"rack": "1"}}, "children": {"a": []}},
    {"root": "a"},
    ["not", "a", "plan"],
])
def test_malformed_plan_documents_are_refused(doc: object) -> None:
    with pytest.raises(FormatError, match="relay plan"):
        RelayTree.from_dict(doc)
