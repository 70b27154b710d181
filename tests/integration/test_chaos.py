"""Chaos: kill -9 of every kind of process mid-refit, corrupt chunks and stalled peers, over many
rounds of a fixed-seed schedule; the invariants hold after every round.

The cluster (chaos_helpers.Cluster): a hub, a publisher process (NetPublisher: chunks relayed
down the hub's tree while it encodes), three `weighthub serve node` processes in a relay chain
(publisher -> n? -> n? -> n?: all but the last relay), and a receiver process (`weighthub
pull`'s receiver into a safetensors file, its named holders ahead of the store). Each round
commits the next RL-like step of a ~3 MB bf16 model (~2% of words moved ±1 ulp) while one
fault, drawn by `random.Random(SEED)`, strikes:

    kill_publisher  mid-publish (after k chunks, just before or just after the commit); the
                    store holds the whole new version or none of it; restarted, it publishes again
    kill_relay      the node the publisher pushes to, after k chunks; restarted
    kill_node       any node, after k chunks or while it syncs after the commit; restarted
    kill_hub        after k chunks; restarted on its port and database a moment later
    kill_receiver   twice a round, stopped mid-pull (staging, a chunk fetched; the file opened for the apply;
                    every word applied but the target's commit not called; or inside that
                    commit, after its Nth fsync); killed there, restarted and pulled again: the
                    file holds the old or the new version or is flagged, and the pull heals it
                    to the new one
    corrupt_store   one chunk of the new version flipped in the store: the pull fails clearly
                    and leaves the file at the old version; repaired, the next pull succeeds
    corrupt_peer    a holder that serves flipped chunks, ranked first by the receiver and (on
                    its host) by a node killed mid-publish that fetches what it missed after
                    its restart: every bad chunk refused, read elsewhere
    stall_peer      the same with a holder that accepts and never answers: timed out, benched
    none            a plain refit

After each round every node and the receiver hold the new or the old version, bit-exact (their
file's fingerprint is the committed state's, their sidecar's root the manifest's), every
process is running and answered within its bound, and every committed version is still in the
store. The run ends with a clean refit everyone must reach, a walk through every committed
version checking its bits, and a graceful stop that must not hang. A one-line summary is
printed (and written as JSON to $WEIGHTHUB_CHAOS_SUMMARY when set); WEIGHTHUB_CHAOS_SEED and
WEIGHTHUB_CHAOS_ROUNDS run other or longer schedules.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from chaos_helpers import ChildProcess, Cluster, Event, Holding, fingerprint, holding
from deadlines import PROCESS_S
from hub_helpers import write_secret
from node_helpers import make_state, step
from safetensors.torch import save_file

from silent_server import silent_server
from weighthub import catalog
from weighthub.cluster.hubclient import HubClient
from weighthub.cluster.topology import Labels
from weighthub.receive import Receiver
from weighthub.store import LocalStore
from weighthub.targets import StateDictTarget

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("WEIGHTHUB_CHAOS_SEED", "17"))
ROUNDS = int(os.environ.get("WEIGHTHUB_CHAOS_ROUNDS", "27"))  # each fault 3 times
NODES = 3
TIMEOUT_S = 2.0  # every process's peer/hub timeout
BOUND_S = PROCESS_S  # hang guard for any one wait (a restart on a loaded machine included)
FAULTS = ("none", "kill_publisher", "kill_relay", "kill_node", "kill_hub", "kill_receiver",
          "corrupt_store", "corrupt_peer", "stall_peer")
KILL_DELAY_S = 0.03  # per chunk write in rounds that kill mid-publish: the kill lands mid-way


def schedule(seed: int, rounds: int) -> list[str]:
    """Every fault kind equally often, in a seeded order."""
    rng, kinds, out = random.Random(seed), list(FAULTS), list[str]()
    while len(out) < rounds:
        rng.shuffle(kinds)
        out += kinds
    return out[:rounds]


def kill_of(child: ChildProcess | None, *, publisher: bool = False) -> Callable[[Event], bool]:
    """A `Chaos.publish` action: kill -9 `child`; True if that ends the publish (the publisher)."""
    def kill(_e: Event) -> bool:
        assert child is not None
        child.kill9()
        return publisher
    return kill


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with tempfile.TemporaryDirectory(prefix="weighthub-chaos-") as tmp:
        root = Path(tmp)
        write_secret(root / "secret")
        c = Cluster(root, root / "secret", NODES, timeout=TIMEOUT_S)
        try:
            yield c
        finally:
            c.close()


class Chaos:
    """The rounds, and what they found (see the module docstring)."""

    def __init__(self, c: Cluster, seed: int) -> None:
        self.c = c
        self.rng = random.Random(seed + 1)
        self.store = LocalStore(c.store)
        self.prints: dict[int, str] = {}  # committed version -> fingerprint of its state
        self.version = -1  # the store's latest committed version
        self.state = make_state(seed)
        self.outcomes: Counter[str] = Counter()
        self.rounds: list[dict[str, Any]] = []
        self._ckpts = 0
        self._t0 = time.monotonic()
        pauses = ["fetch", "open", "commit", "fsync"]
        self.rng.shuffle(pauses)
        self._pauses = itertools.cycle(pauses)  # where kill_receiver stops the receiver next
        self.waits: dict[str, list[float]] = {}  # seconds a bad holder cost, by who met it

    # -- publishing ---------------------------------------------------------------------------
    def _ckpt(self, state: dict[str, torch.Tensor]) -> Path:
        for old in self.c.root.glob("ckpt*.safetensors"):  # read by the publisher already
            old.unlink()
        self._ckpts += 1
        path = self.c.root / f"ckpt{self._ckpts}.safetensors"
        save_file(state, path)
        return path

    def publish(self, state: dict[str, torch.Tensor], *, delay: float = 0.0,
                when: Callable[[Event], bool] | None = None,
                action: Callable[[Event], bool] | None = None) -> int | None:
        """Publish `state`; when an event matches `when`, run `action` (True: it killed the
        publisher, so no "published" comes). Returns the version, or None if killed."""
        pub = self.c.publisher
        assert pub is not None
        since = pub.send({"cmd": "publish", "ckpt": str(self._ckpt(state)), "delay": delay})
        if when is not None and action is not None:
            e = pub.wait_for(lambda e: when(e) or e["event"] == "published", BOUND_S, since=since,
                             what="the fault's moment")
            if action(e):
                return None
        e = pub.wait_for(lambda e: e["event"] == "published", BOUND_S, since=since, what="published")
        self._committed(e["version"], state)
        return int(e["version"])

    def _committed(self, version: int, state: dict[str, torch.Tensor]) -> None:
        assert version == self.version + 1, (version, self.version)
        self.version = version
        self.prints[version] = fingerprint(state)

    # -- receivers ----------------------------------------------------------------------------
    def pull(self, *, peers: list[str] | None = None, pause: str | None = None, nth: int = 1) -> Event:
        rec = self.c.receiver
        assert rec is not None
        since = rec.send({"cmd": "pull", "peers": peers or [], "pause": pause, "nth": nth})
        # a pause may never come (an fsync past the commit's last; a receiver already at the
        # latest version, after a kill the commit survived): the pull just ends
        done = ("paused", "pulled", "error")
        return rec.wait_for(lambda e: e["event"] in done, BOUND_S, since=since, what="pull's end")

    def check(self, where: str, h: Holding, allowed: set[int]) -> str:
        """`h` is a committed version in `allowed`, bit-exact; 'new' or 'old'."""
        assert h.committed, f"{where}: flagged {h}"
        assert h.version in allowed, f"{where}: holds version {h.version}, expected one of {allowed}"
        assert h.print == self.prints[h.version], f"{where}: bits are not version {h.version}'s"
        assert h.root == catalog.primary_manifest(self.store, h.version).root, f"{where}: root"
        return "new" if h.version == max(allowed) else "old"

    def wait_node(self, node_id: str, version: int | None, timeout: float = BOUND_S) -> Holding:
        """Until the node's file holds `version` (None: any committed one), committed."""
        end = time.monotonic() + timeout
        while True:
            h = holding(self.c.out(node_id))
            if h.committed and version in (None, h.version):
                return h
            node = self.c.nodes[node_id]
            # a thread that died of an exception leaves a process that serves but never syncs
            dead = any("Exception in thread" in line for line in node.stderr)
            if time.monotonic() > end or node.proc.poll() is not None or dead:
                raise TimeoutError(f"{node_id} not at version {version} within {timeout:g}s: {h}; "
                                   f"exit {node.proc.poll()}; events {node.events[-3:]}; stderr:\n"
                                   + "".join(node.stderr[-15:]))
            time.sleep(0.1)

    def settle(self, old: int, new: int, *, nodes_must_reach: bool = True) -> dict[str, str]:
        """Every node and the receiver at `old` or `new`, bit-exact; the receiver pulled to `new`
        (and the nodes reached it, unless a restarted hub missed its announcement)."""
        allowed = {old, new}
        out = {}
        for i in self.c.ids:
            h = self.wait_node(i, new if nodes_must_reach else None)
            out[i] = self.check(i, h, allowed)
        e = self.pull()
        assert e["event"] == "pulled" and e["version"] == new, e
        out["receiver"] = self.check("receiver", holding(self.c.receiver_out), allowed)
        assert sorted(self.c.running()) == sorted(["hub", "publisher", "receiver", *self.c.ids])
        assert set(self.prints) <= set(catalog.list_versions(self.store)), "a committed version was lost"
        return out

    def record(self, fault: str, detail: str, held: dict[str, str]) -> None:
        self.outcomes[f"{fault}:{detail}"] += 1
        self.rounds.append({"round": len(self.rounds), "fault": fault, "detail": detail,
                            "held": held, "version": self.version,
                            "seconds": round(time.monotonic() - self._t0, 2)})

    # -- one round per fault ------------------------------------------------------------------
    def round(self, fault: str) -> None:
        self._t0 = time.monotonic()
        old, state = self.version, step(self.state, len(self.rounds) + 1)
        self.state = state
        k = self.rng.randint(1, 10)
        after_k = lambda e: e["event"] == "put" and e["n"] >= k  # noqa: E731
        if fault == "kill_publisher":
            detail = self._kill_publisher(state, old, k)
        elif fault == "kill_relay":
            detail = self._kill_relay(state, after_k)
        elif fault == "kill_node":
            detail = self._kill_node(state, after_k)
        elif fault == "kill_hub":
            detail = self._kill_hub(state, old, after_k)
            if detail == "hub-missed-announce":
                self.record(fault, detail, self.settle(old, self.version, nodes_must_reach=False))
                return
        elif fault == "kill_receiver":
            self.publish(state)
            detail = self._kill_receiver(old)
        elif fault == "corrupt_store":
            self.publish(state)
            for i in self.c.ids:
                self.wait_node(i, self.version)
            detail = self._corrupt_store(old)
        elif fault in ("corrupt_peer", "stall_peer"):
            detail = self._bad_peer(fault, state, after_k)
        else:
            self.publish(state)
            detail = "clean"
        self.record(fault, detail, self.settle(old, self.version))

    def _kill_publisher(self, state: dict[str, torch.Tensor], old: int, k: int) -> str:
        point = self.rng.choice(["chunk", "committing", "committed"])
        when = {"chunk": lambda e: e["event"] == "put" and e["n"] >= k,
                "committing": lambda e: e["event"] == "committing",
                "committed": lambda e: e["event"] == "committed"}[point]
        assert self.c.publisher is not None
        killed = self.publish(state, delay=KILL_DELAY_S, when=when,
                              action=kill_of(self.c.publisher, publisher=True))
        assert killed is None
        # the whole new version or none of it: a version exists iff its manifest does, and a
        # manifest that exists must bring a receiver to exactly the state it was asked to commit
        versions = catalog.list_versions(self.store)
        assert versions[-1] in (old, old + 1), versions
        committed = versions[-1] == old + 1
        if committed:
            got = StateDictTarget({})
            Receiver(self.store, got).sync(old + 1)
            assert fingerprint(dict(got.state)) == fingerprint(state), "a half-committed version"
            self._committed(old + 1, state)
        self.c.start_publisher()
        self.publish(state)  # a restarted trainer publishes its latest state again
        return f"{point}-{'committed' if committed else 'nothing-committed'}"

    def _kill_relay(self, state: dict[str, torch.Tensor], after_k: Callable[[Event], bool]) -> str:
        killed: list[tuple[str, str]] = []

        def kill(e: Event) -> bool:
            by_addr = {n.address: i for i, n in self.c.nodes.items()}
            victim = by_addr.get(e["roots"][0]) if e.get("roots") else None
            what = "relay"
            if victim is None:  # no relay tree this time (published first): any node, after it
                victim, what = self.rng.choice(self.c.ids), "node-after-publish"
            self.c.nodes[victim].kill9()
            killed.append((victim, what))
            return False
        self.publish(state, delay=KILL_DELAY_S,
                     when=lambda e: after_k(e) and bool(e.get("roots")), action=kill)
        victim, what = killed[0]
        self.c.start_node(victim).listening()
        return what

    def _kill_node(self, state: dict[str, torch.Tensor], after_k: Callable[[Event], bool]) -> str:
        victim = self.rng.choice(self.c.ids)
        if self.rng.random() < 0.5:
            self.publish(state, delay=KILL_DELAY_S, when=after_k,
                         action=kill_of(self.c.nodes[victim]))
            detail = "mid-publish"
        else:  # while it stages, applies or commits the version just relayed to it
            self.publish(state)
            time.sleep(self.rng.uniform(0.0, 0.6))
            self.c.nodes[victim].kill9()
            detail = "mid-sync"
        flagged = not holding(self.c.out(victim)).committed
        self.c.start_node(victim).listening()
        return detail + ("-flagged" if flagged else "")

    def _kill_hub(self, state: dict[str, torch.Tensor], old: int,
                  after_k: Callable[[Event], bool]) -> str:
        def kill(_e: Event) -> bool:
            assert self.c.hub is not None
            self.c.hub.kill()
            time.sleep(self.rng.uniform(0.0, 1.0))
            self.c.start_hub()
            return False
        new = self.publish(state, delay=self.rng.choice([KILL_DELAY_S, 0.2]), when=after_k,
                           action=kill)
        secret = self.c.secret_file.read_bytes().strip()
        latest = HubClient(self.c.hub_address, secret, timeout=10.0).latest()
        # a hub restarted before the commit knows the new version; otherwise it knows the old
        # one, and nodes that followed it stay there until the next announcement (documented)
        assert latest in (old, new), (latest, old, new)
        return "hub-announced" if latest == new else "hub-missed-announce"

    def _kill_receiver(self, old: int) -> str:
        """Two kills per round, at the next points of a seeded cycle through every pause."""
        return ",".join(self._kill_receiver_at(next(self._pauses), old) for _ in range(2))

    def _kill_receiver_at(self, pause: str, old: int) -> str:
        nth = self.rng.randint(1, 6)
        e = self.pull(pause=pause, nth=nth)
        if pause == "fsync":
            pause = f"fsync{nth}"
        if e["event"] != "paused":  # fewer fsyncs, or nothing left to pull: it completed
            assert e["event"] == "pulled" and e["version"] == self.version, e
            return f"{pause}-unreached"
        assert self.c.receiver is not None
        self.c.receiver.kill9()
        h = holding(self.c.receiver_out)
        if h.committed:  # the crash left a committed claim: then exactly its version's bits
            self.check("receiver after kill", h, {old, self.version})
        self.c.start_receiver()  # the next pull must heal the file
        state = "flagged" if not h.committed else "new" if h.version == self.version else "old"
        return f"{pause}-{state}"

    def _corrupt_store(self, old: int) -> str:
        m = catalog.primary_manifest(self.store, self.version)
        chunk = self.rng.choice(m.chunks)
        path = self.c.store / chunk.key
        good = path.read_bytes()
        bad = bytearray(good)
        bad[self.rng.randrange(len(bad))] ^= 1 << self.rng.randrange(8)
        path.write_bytes(bytes(bad))
        try:
            e = self.pull()
            assert e["event"] == "error" and "ChecksumError" in e["error"], e
            assert chunk.key in e["error"], e  # says which chunk
            self.check("receiver facing a corrupt store", holding(self.c.receiver_out), {old})
        finally:
            path.write_bytes(good)  # repaired: the next pull (settle) must succeed
        return "refused"

    def _bad_peer(self, fault: str, state: dict[str, torch.Tensor],
                  after_k: Callable[[Event], bool]) -> str:
        """A holder that lies (flips a bit of every chunk) or stalls (accepts, never answers),
        ranked first: for the receiver (named first) and for a node killed mid-publish (the
        hub lists it on the node's own host), which fetches what it missed after its restart."""
        victim = self.rng.choice(self.c.ids)
        self.publish(state, delay=KILL_DELAY_S, when=after_k,
                     action=kill_of(self.c.nodes[victim]))
        with contextlib.ExitStack() as stack:
            if fault == "corrupt_peer":
                liar = self.c.liar or self.c.start_liar()
                liar.serve(self.version)
                address = liar.address
            else:
                address = stack.enter_context(silent_server())
            host = f"h{self.c.ids.index(victim) + 1}"
            hub = HubClient(self.c.hub_address, self.c.secret_file.read_bytes().strip(),
                            timeout=TIMEOUT_S, labels=Labels("a", "z1", host))
            hub.register(f"bad-{fault}", address, versions=[self.version], dense=False)
            hub.start_heartbeat()
            stack.callback(hub.stop)
            node = self.c.start_node(victim).listening()
            self.wait_node(victim, self.version)
            e = self.pull(peers=[address])
            assert e["event"] == "pulled" and e["version"] == self.version, e
            assert e["served"].get("holders", 0) == 0, e  # not one bad chunk got through
        # (no "synced" event if the kill came too late: the node held the version already)
        synced = [x for x in node.events if x.get("event") == "synced"]
        met = bool(synced) and synced[-1]["stats"]["peer_failures"] > 0  # it asked, and benched it
        self.waits.setdefault(f"{fault}_receiver_pull_s", []).append(round(e["seconds"], 2))
        if met:
            self.waits.setdefault(f"{fault}_node_sync_s", []).append(synced[-1]["seconds"])
        return "failed-over" + ("-node-met-it" if met else "")

    # -- the end ------------------------------------------------------------------------------
    def every_version_intact(self) -> None:
        """Walk a fresh receiver through every committed version: each one's bits are the state
        it was asked to commit (none lost, none changed)."""
        assert catalog.list_versions(self.store) == sorted(self.prints)
        target = StateDictTarget({})
        receiver = Receiver(self.store, target)
        for v in sorted(self.prints):
            receiver.sync(v)
            assert fingerprint(dict(target.state)) == self.prints[v], f"version {v}"

    def summary(self, seconds: float) -> dict[str, Any]:
        faults = Counter(r["fault"] for r in self.rounds)
        held = Counter(x for r in self.rounds for x in r["held"].values())
        return {"seed": SEED, "rounds": len(self.rounds), "versions": self.version + 1,
                "faults": dict(sorted(faults.items())), "outcomes": dict(sorted(self.outcomes.items())),
                "held_after_round": dict(held), "processes_started": self.c.started,
                "slowest_round_s": max(r["seconds"] for r in self.rounds),
                "bad_holder_max_s": {k: max(v) for k, v in sorted(self.waits.items())},
                # temporaries killed publishers left in the store (issue 17 item 6 cleans them)
                "store_tmp_files": sum(1 for _ in self.c.store.rglob(".tmp-*")),
                "seconds": round(seconds, 1), "per_round": self.rounds}


def test_chaos_rounds_keep_every_receiver_at_a_committed_version(cluster: Cluster) -> None:
    t0 = time.monotonic()
    c = cluster
    c.warm(len(c.ids) + 2)  # the nodes, the publisher, the receiver: importing in parallel
    c.start_hub()
    for i in c.ids:
        c.start_node(i)
    c.start_publisher()
    c.start_receiver()
    for n in c.nodes.values():
        n.listening()
    chaos = Chaos(c, SEED)
    chaos.publish(chaos.state)
    chaos.settle(0, 0)

    for fault in [*schedule(SEED, ROUNDS), "none"]:  # the last refit is clean: all must reach it
        chaos.round(fault)
    chaos.every_version_intact()
    # a graceful stop must not hang either
    for i, n in c.nodes.items():
        os.killpg(n.proc.pid, signal.SIGTERM)
        assert n.proc.wait(BOUND_S) is not None, i
    assert c.hub is not None and c.hub.stop(BOUND_S) == 0

    doc = chaos.summary(time.monotonic() - t0)
    line = {k: v for k, v in doc.items() if k != "per_round"}
    print(f"\nchaos summary: {json.dumps(line, sort_keys=True)}")
    if os.environ.get("WEIGHTHUB_CHAOS_SUMMARY"):
        Path(os.environ["WEIGHTHUB_CHAOS_SUMMARY"]).write_text(json.dumps(doc, indent=1, sort_keys=True))
    assert doc["rounds"] == ROUNDS + 1
    assert len(FAULTS) > ROUNDS or set(doc["faults"]) == set(FAULTS), doc["faults"]
