"""`weighthub bench net`: refits through the hub's relay tree vs every receiver from the store.

Real processes throughout: a hub (`python -m weighthub.cluster.hub`), a publisher agent
(bench.net_agents: a NetPublisher), and `weighthub serve node` daemons with in-memory targets.
The state is the real MiniLM fine-tuning pair (bench.shaped_agents.real_pair) tiled to
`size_mib`; v0 is its first state, v1 the real step, later versions synthetic 3% steps.

    loopback   (a) refit time vs receivers (8, 4, 2): nodes following the store alone vs nodes
               in the hub's relay tree (fan-out 2), from the publisher starting the version until
               the last node committed it (store nodes: their 0.1 s poll included; relay nodes
               are woken by the relayed manifest and poll the hub only every 2 s as a fallback)
               (c) elastic join of a newcomer: dense bits from the holders vs the store's route
               (the full v0 plus every delta since), as timed by the node
               (d) a relay (the tree's first root) killed with kill -9 mid-refit: refit time of
               the survivors vs the same refit with no failure
    shaped     (b) root only: the store (SeaweedFS S3), hub and publisher in namespace "a", the
               nodes in namespace "b", one veth between them shaped with tc tbf (a region
               boundary): bytes crossing it per refit (kernel counters, both ways, frames with
               headers) and refit time, store vs relay, for 2 and 4 receivers

Every refit is checked: each node's committed root equals the publisher's manifest root (the
nodes verify every tensor digest against it before committing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .net_procs import (
    START_S,
    STEP_S,
    Agent,
    BenchError,
    Cluster,
    Lines,
    Node,
    Progress,
    Spawn,
    spawner,
)
from .netlab import NetLab, require_root
from .shaped_agents import BUCKET, MiB

DEGREE = 2


def _start_hub(spawn: Spawn, tmp: Path, secret_file: Path, host: str) -> tuple[Lines, str]:
    hub = Lines(spawn([sys.executable, "-m", "weighthub.cluster.hub", "--db", str(tmp / f"hub-{host}.db"),
                        "--secret-file", str(secret_file), "--host", host, "--port", "0",
                        "--lease-ttl", "5", "--fanout", str(DEGREE)], {}), "hub")
    _t, line = hub.get(START_S)
    m = re.search(r"listening on (\S+:\d+)", line)
    if m is None:
        raise BenchError(f"hub: unexpected first line {line!r}")
    return hub, m.group(1)


def _refit(agent: Agent, nodes: Sequence[Node], *, link: Any = None,
           kill: dict[str, int] | None = None) -> dict[str, Any]:
    """Publish the next version; wait until every (surviving) node committed it; check roots."""
    before = link.wire_bytes() if link is not None else 0
    t0 = w0 = time.monotonic()
    pub = agent.call("publish", kill=kill, kill_after=2) if kill else agent.call("publish")
    survivors = [n for n in nodes if n.address not in pub["killed"]]
    done = [n.synced(pub["version"]) for n in survivors]
    refit_s = max(t for t, _e in done) - t0
    bad = [n.name for n, (_t, e) in zip(survivors, done, strict=True) if e["root"] != pub["root"]]
    if bad:
        raise BenchError(f"version {pub['version']}: nodes {bad} committed another root")
    out = {"version": pub["version"], "refit_s": round(refit_s, 3),
           "publish_s": round(pub["seconds"], 3), "payload_bytes": pub["payload_bytes"],
           "chunks": pub["chunks"], "planned": pub["planned"], "dead": pub["dead"],
           "killed": pub["killed"], "receivers": len(survivors)}
    for k in ("from_cache", "from_peers", "from_backing"):
        out[k] = sum(e["stats"][k] for _t, e in done)
    if link is not None:
        time.sleep(0.2)  # counters settle (acks in flight)
        out["wire_bytes"] = link.wire_bytes() - before
        out["window_s"] = round(time.monotonic() - w0, 3)
        out["wire_x_payload"] = round(out["wire_bytes"] / max(1, pub["payload_bytes"]), 2)
    return out


Extra = Callable[[list[Node]], dict[str, Any]]


def _run_modes(agent: Agent, cluster: Cluster, hub: str, counts: Sequence[int], say: Progress, *,
               reps: int, link: Any = None, rate: float | None = None,
               extra: Extra | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Relay-mode nodes (with the hub), then store-mode nodes (without): `reps` refits per count,
    the median kept (noisy on a loaded machine); `extra` runs once at the largest count."""
    rows: list[dict[str, Any]] = []
    extras: dict[str, Any] = {}
    for mode in ("relay", "store"):
        nodes = cluster.start(hub if mode == "relay" else None, max(counts), f"{mode[0]}{cluster.region}")
        try:
            if link is not None:
                link.unshape()
            target = _latest(nodes)
            for nd in nodes:
                nd.synced(target, START_S)
            if link is not None and rate is not None:
                link.shape(rate)
            for n in sorted(counts, reverse=True):
                while len(nodes) > n:
                    nodes.pop().stop()
                idle = _idle_rate(link) if link is not None else None
                tries = sorted((_refit(agent, nodes, link=link) for _ in range(reps)),
                               key=lambda r: r["refit_s"])
                row = {"mode": mode, **tries[len(tries) // 2],
                       "refit_all_s": [r["refit_s"] for r in tries]}
                if idle is not None:  # control traffic (store or hub polls, heartbeats) with no refit
                    row["idle_link_bytes_per_s"] = idle
                    net = row["wire_bytes"] - idle * row["window_s"]
                    row["net_x_payload"] = round(net / max(1, row["payload_bytes"]), 2)
                say(f"  {mode:5} {n} receivers: refit {row['refit_s']:.2f}s"
                    + (f", {row['wire_bytes'] / MiB:.2f} MiB over the link" if link is not None else ""))
                rows.append(row)
                if mode == "relay" and n == max(counts) and extra is not None:
                    extras = extra(nodes)
                    nodes = [nd for nd in nodes if nd.proc.poll() is None]
        finally:
            for nd in nodes:
                nd.stop()
            if link is not None:
                link.unshape()
    return rows, extras


def _idle_rate(link: Any, seconds: float = 2.0) -> int:
    """Bytes per second crossing the link while nothing is published (the control plane)."""
    before = link.wire_bytes()
    time.sleep(seconds)
    return int((link.wire_bytes() - before) / seconds)


def _latest(nodes: Sequence[Node]) -> int:
    """The version a fresh node set syncs to first: what the first node reports."""
    _t, e = nodes[0].until(lambda e: e.get("event") == "synced", START_S)
    return int(e["version"])


def run_net_bench(counts: Sequence[int] = (2, 4, 8), *, size_mib: int = 48, rate_mbit: float = 100.0,
                  shaped_counts: Sequence[int] = (2, 4), shaped: bool | None = None, reps: int = 3,
                  loopback: bool = True, progress: Progress | None = None) -> dict[str, Any]:
    """Run (a), (c), (d) on loopback and, as root, (b) over a shaped link. Returns a JSON-able doc.

    Args:
        counts: receiver counts on loopback.
        size_mib: state size (the MiniLM pair tiled; at least one copy, ~45 MiB).
        rate_mbit: the shaped link's rate.
        shaped_counts: receiver counts behind the shaped link.
        shaped: run (b) (default: when root); True when not root raises NetLabUnavailable.
        reps: refits per (mode, receivers); the median is reported.
        loopback: run (a), (c), (d) on loopback (False: only the shaped part).
        progress: one line per step (default: stderr).
    """
    say = progress or (lambda m: print(m, file=sys.stderr, flush=True))
    if any(not 1 <= n <= 16 for n in (*counts, *shaped_counts)) or size_mib < 1 or rate_mbit <= 0 \
            or reps < 1:
        raise UsageError("receiver counts must be 1-16, --size-mib and --reps >= 1, --rate > 0")
    run_shaped = (os.geteuid() == 0) if shaped is None else shaped
    if run_shaped:
        require_root()
    tmp = Path(tempfile.mkdtemp(prefix="wh-bench-net-"))
    secret_file = tmp / "secret"
    secret_file.write_text(secrets.token_hex(32))
    doc: dict[str, Any] = {"host": {"cpus": os.cpu_count(), "load": os.getloadavg()},
                           "size_mib": size_mib, "degree": DEGREE, "loopback": [], "shaped": None}
    t0 = time.perf_counter()
    try:
        if loopback:
            doc.update(_loopback(tmp, secret_file, counts, size_mib, reps, say))
        if run_shaped:
            doc["shaped"] = _shaped(tmp, secret_file, shaped_counts, size_mib, rate_mbit, reps, say)
        else:
            doc["shaped_skipped"] = ("skipped (--no-shaped)" if shaped is False else "not root: the "
                                     "shaped-link part needs network namespaces (run as root)")
            say(f"shaped-link part {doc['shaped_skipped']}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    return doc


def _loopback(tmp: Path, secret_file: Path, counts: Sequence[int], size_mib: int, reps: int,
              say: Progress) -> dict[str, Any]:
    spawn = spawner()
    hub, hub_addr = _start_hub(spawn, tmp, secret_file, "127.0.0.1")
    agent = Agent(spawn([sys.executable, "-m", "weighthub.bench.net_agents", "publisher"], {}), "publisher")
    try:
        store = str(tmp / "store")
        agent.call("start", timeout=START_S, store=store, hub=hub_addr, secret_file=str(secret_file),
                   labels="region=a,zone=z1,host=pub", host="127.0.0.1", degree=DEGREE)
        loaded = agent.call("load", timeout=START_S, size_mib=size_mib)
        say(f"loopback: {loaded['dense_bytes'] / MiB:.0f} MiB state ({loaded['source']}); v0 full")
        agent.call("publish")
        agent.call("publish")  # v1, the real step: the timed refits are all synthetic 3% steps
        cluster = Cluster(spawn, store, secret_file, "127.0.0.1", "a", {})
        rows, extras = _run_modes(agent, cluster, hub_addr, counts, say, reps=reps,
                                  extra=_join_and_kill(agent, cluster, hub_addr, say))
        return {"loopback": rows, **extras, "state": loaded}
    finally:
        agent.stop()
        hub.stop()


def _join_and_kill(agent: Agent, cluster: Cluster, hub: str, say: Progress, *, link: Any = None,
                   kill: bool = True) -> Extra:
    """(c) a newcomer joins from the holders, another from the store; (d) a relay killed mid-refit."""
    def run(nodes: list[Node]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for how, hub_or_none in (("holders", hub), ("store", None)):
            [newcomer] = cluster.start(hub_or_none, 1, f"join-{how}-")
            before = link.wire_bytes() if link is not None else 0
            _t, e = newcomer.until(lambda e: e.get("event") == "synced", STEP_S)
            out[f"join_{how}"] = {"seconds": e["seconds"], "how": e["how"], "bytes": e["bytes"],
                                  "holders": len(e.get("by_holder", {}))}
            if link is not None:
                out[f"join_{how}"]["wire_bytes"] = link.wire_bytes() - before
            say(f"  elastic join from {how}: {e['seconds']:.2f}s ({e['how']})")
            newcomer.stop()
        if kill:
            row = _refit(agent, nodes, kill={n.address: n.proc.pid for n in nodes})
            out["relay_killed"] = row
            say(f"  relay {row['killed']} killed mid-refit: survivors done in {row['refit_s']:.2f}s")
        return out
    return run


def _shaped(tmp: Path, secret_file: Path, counts: Sequence[int], size_mib: int, rate: float,
            reps: int, say: Progress) -> dict[str, Any]:
    from .seaweed import SeaweedServer

    with NetLab() as lab:
        a, b = lab.namespace("a"), lab.namespace("b")
        link = lab.link(a, b)
        link.wire_bytes()
        with SeaweedServer.start(bucket=BUCKET, lab=lab, ns=a, host=link.a_addr,
                                 workdir=tmp / "seaweed") as s3:
            env = s3.env()
            spawn_a, spawn_b = spawner(lab, a), spawner(lab, b)
            _hub, hub_addr = _start_hub(spawn_a, tmp, secret_file, link.a_addr)
            agent = Agent(spawn_a([sys.executable, "-m", "weighthub.bench.net_agents", "publisher"], env),
                           "publisher-a")
            store = f"s3://{BUCKET}/net"
            agent.call("start", timeout=START_S, store=store, hub=hub_addr, secret_file=str(secret_file),
                       labels="region=a,zone=z1,host=pub", host=link.a_addr, degree=DEGREE)
            loaded = agent.call("load", timeout=START_S, size_mib=size_mib)
            agent.call("publish")
            agent.call("publish")  # v1: the nodes start from a delta chain, like a live system
            say(f"shaped: store+hub+publisher in {a.name}, nodes in {b.name}, {rate:g} Mbit/s tbf")
            cluster = Cluster(spawn_b, store, secret_file, link.b_addr, "b", env)
            rows, extras = _run_modes(agent, cluster, hub_addr, counts, say, reps=reps, link=link,
                                      rate=rate,
                                      extra=_join_and_kill(agent, cluster, hub_addr, say, link=link,
                                                           kill=False))
            agent.stop()
    return {"rate_mbit": rate, "rows": rows, **extras, "state": loaded}


def format_table(doc: dict[str, Any]) -> str:
    state, host = doc.get("state") or doc["shaped"]["state"], doc["host"]
    lines = ["(link MiB: both ways, frames with headers; net x: minus the idle control traffic "
             "(polls, heartbeats) over the same window, over the payload)",
             f"state {state['dense_bytes'] / MiB:.0f} MiB ({state['source']}, then synthetic 3% steps), "
             f"relay fan-out {doc['degree']}; load average {host['load'][0]:.1f} on {host['cpus']} cpus",
             "", f"{'where':<10} {'mode':<6} {'recv':>4} {'payload KiB':>11} {'refit s':>8} "
             f"{'link MiB':>9} {'x payload':>9} {'net x':>6} {'cache/peer/store chunk reads':>29}"]
    rows = [("loopback", r) for r in doc["loopback"]]
    if doc.get("shaped"):
        rows += [(f"{doc['shaped']['rate_mbit']:g}Mbit/s", r) for r in doc["shaped"]["rows"]]
    for where, r in rows:
        link = f"{r['wire_bytes'] / MiB:>9.2f} {r['wire_x_payload']:>9.2f} {r['net_x_payload']:>6.2f}" \
            if "net_x_payload" in r else f"{'':>9} {'':>9} {'':>6}"
        reads = f"{r['from_cache']}/{r['from_peers']}/{r['from_backing']}"
        if "idle_link_bytes_per_s" in r:
            reads += f"  idle {r['idle_link_bytes_per_s'] / 1024:.0f} KiB/s"
        lines.append(f"{where:<10} {r['mode']:<6} {r['receivers']:>4} {r['payload_bytes'] / 1024:>11.0f} "
                     f"{r['refit_s']:>8.2f} {link} {reads:>29}")
    for where, part in (("loopback", doc), ("shaped", doc.get("shaped") or {})):
        for how in ("holders", "store"):
            j = part.get(f"join_{how}")
            if j:
                wire = f", {j['wire_bytes'] / MiB:.1f} MiB over the link" if "wire_bytes" in j else ""
                lines.append(f"{where}: elastic join from {how}: {j['seconds']:.2f}s ({j['how']}, "
                             f"{j['bytes'] / MiB:.1f} MiB, {j['holders']} holders{wire})")
    k = doc.get("relay_killed")
    if k:
        same = [r["refit_s"] for r in doc["loopback"]
                if r["mode"] == "relay" and r["receivers"] == k["receivers"] + 1]
        ref = f" (no failure, {k['receivers'] + 1} receivers: {same[0]:.2f}s)" if same else ""
        lines.append(f"loopback: relay killed mid-refit ({k['killed']}): {k['receivers']} survivors "
                     f"committed in {k['refit_s']:.2f}s{ref}; dead reported {k['dead']}")
    if doc.get("shaped_skipped"):
        lines.append(doc["shaped_skipped"])
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `weighthub bench net`."""
    p.add_argument("--receivers", default="2,4,8", metavar="N,N", help="receiver counts on loopback")
    p.add_argument("--shaped-receivers", default="2,4", metavar="N,N", help="receivers behind the link")
    p.add_argument("--size-mib", type=int, default=48, help="state size (MiniLM tiled; default 48)")
    p.add_argument("--rate", type=float, default=100.0, metavar="MBIT", help="shaped link rate")
    p.add_argument("--reps", type=int, default=3, help="refits per scenario, median reported (default 3)")
    p.add_argument("--no-shaped", action="store_true", help="skip the shaped-link part (needs root)")
    p.add_argument("--no-loopback", action="store_true", help="skip the loopback part (a, c, d)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the JSON document here")


def cmd_net(args: argparse.Namespace) -> int:
    try:
        counts = [int(x) for x in args.receivers.split(",") if x]
        shaped_counts = [int(x) for x in args.shaped_receivers.split(",") if x]
    except ValueError as exc:
        raise UsageError(f"--receivers/--shaped-receivers take comma-separated numbers: {exc}") from exc
    out = Path(args.json).expanduser() if args.json else None
    if out is not None:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.touch()
        except OSError as exc:
            raise UsageError(f"cannot write --json {out}: {exc.strerror or exc}") from None
    doc = run_net_bench(counts, size_mib=args.size_mib, rate_mbit=args.rate, shaped_counts=shaped_counts,
                        shaped=False if args.no_shaped else None, reps=args.reps,
                        loopback=not args.no_loopback)
    if out is not None:
        out.write_text(json.dumps(doc, indent=1, sort_keys=True))
    print(format_table(doc))
    return 0
