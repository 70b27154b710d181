"""The RL demo across a shaped link: `weighthub demo --rl --link-mbit RATE` (root).

On one machine the object-store baseline is a memcpy through shared memory, which is not what a
disaggregated cluster pays. Here the trainer's and the engines' Ray nodes sit in two network
namespaces joined by one veth, capped at RATE Mbit/s both ways with `tc tbf` (bench.netlab):

    ns "train": SeaweedFS (the store), the Ray head,     ns "roll": a Ray worker node: the
                the driver, the trainer actor, the hub               rollout engines and its daemon
          10.213.0.1  ─────────── veth, tbf RATE both ways ───────────  10.213.0.2

Both routes cross the link and nothing else does: weighthub's publisher pushes each chunk to the
roll node's daemon (the engines read it there), and the baseline's `ray.get` pulls the full state
into the roll node's object store once (both engines share it). The driver is this same command
re-entered inside "train" with `--address`, `--rollout-nodes others` and `--link-dev`, so each
step's row also shows the link's bytes per route. The engines start from the initial checkpoint
on the shared disk (as from a shared file system); every later version crosses the link.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ...bench.netlab import Namespace, NetLab, child_env, measure_throughput
from ...bench.seaweed import SeaweedServer
from ...errors import UsageError, WeighthubError
from .options import ENV

GCS_PORT = 6379  # per namespace: never collides with a Ray on the host
OBJECT_STORE_BYTES = 1 << 30
NODE_CPUS = 4  # logical: the actors ask for none; Ray's own tasks need some
START_TIMEOUT_S = 90.0
RUN_TIMEOUT_BASE_S, RUN_TIMEOUT_PER_STEP_S = 900.0, 300.0
WORK_PREFIX = "whrl-"


class ShapedRunError(WeighthubError):
    """The shaped-link run could not start or did not finish."""


def run_shaped(args: argparse.Namespace) -> int:
    """Build the lab, run the RL demo's driver inside it, add the link's figures to its JSON."""
    if args.link_mbit <= 0:
        raise UsageError(f"--link-mbit must be > 0 Mbit/s, got {args.link_mbit:g}")
    if args.address:
        raise UsageError("--link-mbit starts its own two-node Ray cluster: drop --address")
    if args.nodes != 2:
        raise UsageError(f"--link-mbit runs two Ray nodes (trainer, rollout), got --nodes {args.nodes}")
    ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    if ray_bin is None:
        raise UsageError("the `ray` command is not installed next to this Python: pip install "
                         "'weighthub[ray]'")
    # Ray's node logs and temp dir, and the store's directory; removed after a run that succeeds,
    # kept (its logs, named in the error; the store's data goes with the server) after one that
    # fails. A short name: Ray's sockets live in it, and a socket path has at most 107 bytes
    work = Path(tempfile.mkdtemp(prefix=WORK_PREFIX))
    try:
        doc = _run_in_lab(args, ray_bin, work)
    except BaseException:
        if not any(work.glob("ray-*.log")):  # failed before Ray started: nothing to read there
            shutil.rmtree(work, ignore_errors=True)
        raise
    shutil.rmtree(work, ignore_errors=True)
    s = doc["summary"]
    if s.get("refit_wire_bytes") is not None and s.get("baseline_wire_bytes"):
        print(f"link bytes per step (median): weighthub {s['refit_wire_bytes'] / 1e6:.1f} MB vs "
              f"object store {s['baseline_wire_bytes'] / 1e6:.1f} MB "
              f"({s['baseline_wire_bytes'] / max(s['refit_wire_bytes'], 1):.0f}x); "
              f"{doc['link']['wire_bytes_total'] / 1e6:.0f} MB crossed in the whole run"
              + (f"; figures in {args.json}" if args.json else ""), flush=True)
    return 0


def _run_in_lab(args: argparse.Namespace, ray_bin: str, work: Path) -> dict[str, Any]:
    """The lab, its store and Ray nodes, and the driver's run; its JSON with the link's figures
    (also written to --json)."""
    with NetLab() as lab:
        train, roll = lab.namespace("train"), lab.namespace("roll")
        link = lab.link(train, roll)
        link.shape(args.link_mbit)
        measured = measure_throughput(lab, train, roll, link.b_addr, seconds=2.0)
        print(f"link {link.a_addr} <-> {link.b_addr}: capped at {args.link_mbit:g} Mbit/s, "
              f"measured {measured / 1e6:.0f} Mbit/s; starting SeaweedFS and Ray", flush=True)
        with SeaweedServer.start(bucket="policy", lab=lab, ns=train, host=link.a_addr,
                                 workdir=work / "seaweed") as s3:
            # RAY_TMPDIR: Ray's sessions and its `ray_current_cluster` file go to `work`, not
            # /tmp/ray, where that file would point every later plain `ray.init()` on this
            # machine at this lab's cluster, gone with its namespace. Token auth with the lab's
            # own token on every node and the driver: left to itself, a head finding a token in
            # ~/.ray (any earlier local ray.init() writes one) turns it on and the roll node,
            # which does not, is refused
            env = child_env({**ENV, **s3.env(), "RAY_USAGE_STATS_ENABLED": "0",
                             "RAY_TMPDIR": str(work), "RAY_AUTH_MODE": "token",
                             "RAY_AUTH_TOKEN": secrets.token_hex(32)})
            head = f"{link.a_addr}:{GCS_PORT}"
            _ray_node(lab, train, ray_bin, env, ["--head", f"--port={GCS_PORT}",
                                                 "--include-dashboard=false"],
                      link.a_addr, "region=region-a,zone=zone-0", work / "ray-head.log")
            _wait_port(train, link.a_addr, GCS_PORT, START_TIMEOUT_S)
            _ray_node(lab, roll, ray_bin, env, [f"--address={head}"], link.b_addr,
                      "region=region-b,zone=zone-1", work / "ray-roll.log")
            json_path = Path(args.json) if args.json else work / "rl.json"
            before = link.wire_bytes()
            driver = lab.spawn(train, _driver_argv(args, head, s3.url("rl"), link.a_dev,
                                                   json_path), env=env)
            timeout = RUN_TIMEOUT_BASE_S + RUN_TIMEOUT_PER_STEP_S * (args.steps + args.probe_rounds)
            try:
                rc = driver.wait(timeout=timeout)
            except subprocess.TimeoutExpired as exc:
                raise ShapedRunError(f"the RL driver did not finish in {timeout:.0f} s; Ray's "
                                     f"logs: {work}/ray-*.log and {work}/ray/session_latest/logs") from exc
            total = link.wire_bytes() - before
    if rc != 0:
        raise ShapedRunError(f"the RL driver failed (exit {rc}; its error is above; Ray's "
                             f"logs: {work}/ray-*.log and {work}/ray/session_latest/logs)")
    doc: dict[str, Any] = json.loads(json_path.read_text())
    doc["link"] = {"rate_mbit": args.link_mbit, "measured_mbit": measured / 1e6,
                   "wire_bytes_total": total}
    json_path.write_text(json.dumps(doc, indent=1, default=str))
    return doc


def _ray_node(lab: NetLab, ns: Namespace, ray_bin: str, env: dict[str, str], extra: list[str],
              ip: str, labels: str, log: Path) -> None:
    """`ray start --block` inside `ns` (the lab kills it and its raylet's children on close)."""
    argv = [ray_bin, "start", "--block", *extra, f"--node-ip-address={ip}",
            f"--num-cpus={NODE_CPUS}", f"--object-store-memory={OBJECT_STORE_BYTES}",
            "--disable-usage-stats", f"--labels={labels}"]
    with log.open("wb") as out:  # the child keeps its own descriptor
        lab.spawn(ns, argv, env=env, stdout=out, stderr=subprocess.STDOUT)


def _wait_port(ns: Namespace, host: str, port: int, timeout: float) -> None:
    """Until something listens on host:port inside `ns` (Ray's GCS), or ShapedRunError."""
    probe = ("import socket, sys, time\n"
             f"end = time.monotonic() + {timeout}\n"
             "while time.monotonic() < end:\n"
             f"    try: socket.create_connection(({host!r}, {port}), timeout=1).close(); sys.exit(0)\n"
             "    except OSError: time.sleep(0.3)\n"
             "sys.exit(1)\n")
    if ns.run([sys.executable, "-c", probe], check=False, timeout=timeout + 10).returncode != 0:
        raise ShapedRunError(f"Ray's head did not listen on {host}:{port} in {ns.name} within "
                             f"{timeout:g} s")


def _driver_argv(args: argparse.Namespace, head: str, store: str, dev: str,
                 json_path: Path) -> list[str]:
    argv = [sys.executable, "-m", "weighthub.cli", "demo", "--rl", "--address", head,
            "--nodes", "2", "--store", store, "--rollout-nodes", "others", "--link-dev", dev,
            "--json", str(json_path), "--steps", str(args.steps), "--engines", str(args.engines),
            "--prompts", str(args.prompts), "--samples", str(args.samples),
            "--max-tokens", str(args.max_tokens), "--lr", repr(args.lr), "--lag", str(args.lag),
            "--encode", args.encode, "--seed", str(args.seed),
            "--probe-rounds", str(args.probe_rounds)]
    if args.no_baseline:
        argv.append("--no-baseline")
    if args.early_decode:
        argv.append("--early-decode")
    if args.plain_cpu_weights:
        argv.append("--plain-cpu-weights")
    return argv
