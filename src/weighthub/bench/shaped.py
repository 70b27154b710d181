"""Shaped-link benchmark: full checkpoint vs weighthub delta refit vs shardcast, over tc tbf.

Topology (bench.netlab), one host, root needed:

    ns "store": SeaweedFS (S3) + the trainer agent      ns "recv": 1-4 receiver agents
                + shardcast origin                                 + a shardcast relay (middle node)
          10.213.0.1  ───────── veth, tbf RATE both ways ─────────  10.213.0.2

All receivers share the one shaped link (the cross-region situation). Per scenario (rate,
receivers) the link is unshaped while the base version is published and every receiver syncs to
it, then shaped, and three ways of moving the next weights are timed, each from the moment the
trainer starts until the last receiver holds the new weights:

    full       the trainer serializes the bf16 state to one safetensors object and PUTs it to S3
               (S3Store: parallel multipart); each receiver GETs it (parallel ranged GETs),
               deserializes it and copies it into its weights
    shardcast  the trainer writes the safetensors file and `broadcast`s it from a shardcast origin;
               the relay in the receivers' namespace pulls it across the link once; the receivers
               download it from the relay (ClientNode), then load it as above
    weighthub  Publisher.publish(new state) to S3 (delta, streamed), then every receiver
               Receiver.sync() (stage: fetch + verify + decode; pause: apply + verify + commit)

weighthub runs on three deltas: the real MiniLM fine-tuning step (tiled to the benchmark size,
so each tile carries the real change pattern) and synthetic 3% and 5% steps on top of it. The
full/shardcast transfers do not depend on the delta and run once per scenario. Bytes on the wire
are the veth's kernel counters (both directions, frames with headers) around each phase. Every
receiver's result is checked bit-exact against the trainer's digests after each phase (untimed).

This module is the orchestrator (and the CLI); the processes inside the namespaces (trainer,
receivers, relay) are in bench.shaped_agents, driven over JSON lines.

Run: `weighthub bench shaped` (root), or run_shaped_bench(...) -> dict.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .netlab import Link, Namespace, NetLab, child_env, require_root
from .seaweed import SeaweedServer
from .shaped_agents import BUCKET, PHASE_TIMEOUT_S, AgentError, MiB, agent_argv

SHARDCAST_ORIGIN_PORT = 8000
SHARDCAST_RELAY_PORT = 8001
DEFAULT_SIZE_MIB = {1000: 512, 100: 128}  # big enough that the link dominates, small enough for ~10 min
DELTAS = (("real", None), ("synthetic 3%", 0.03), ("synthetic 5%", 0.05))

Progress = Callable[[str], None]


# -- orchestrator side ----------------------------------------------------------------------------

class Agent:
    """An agent process in `ns`, speaking JSON lines on stdin/stdout (shaped_agents.serve)."""

    def __init__(self, lab: NetLab, ns: Namespace, role: str, name: str, workdir: Path,
                 env: dict[str, str]) -> None:
        self.name = name
        self.log_path = workdir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.proc = lab.spawn(ns, agent_argv(role, workdir / name), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=self._log, env=child_env(env),
                              bufsize=0)
        self._buf = b""

    def send(self, op: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        self.proc.stdin.flush()

    def reply(self, timeout: float = PHASE_TIMEOUT_S) -> dict[str, Any]:
        import select

        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AgentError(f"agent {self.name} did not answer in {timeout:.0f}s "
                                 f"(log: {self.log_path})")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise AgentError(f"agent {self.name} exited ({self.proc.wait()}); log tail:\n"
                                     f"{self.log_path.read_text(errors='replace')[-2000:]}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        doc = json.loads(line)
        if not doc.pop("ok"):
            raise AgentError(f"agent {self.name}: {doc['error']}")
        return dict(doc)

    def call(self, op: str, timeout: float = PHASE_TIMEOUT_S, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.reply(timeout)

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()  # EOF: the agent exits
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self._log.close()


def fan_out(agents: Sequence[Agent], op: str, **args: Any) -> list[dict[str, Any]]:
    """Send `op` to every agent at once, then collect every reply (they run concurrently)."""
    for a in agents:
        a.send(op, **args)
    return [a.reply() for a in agents]


@dataclass
class _Lab:
    lab: NetLab
    store_ns: Namespace
    recv_ns: Namespace
    link: Link
    s3: SeaweedServer
    trainer: Agent
    relay: Agent | None
    workdir: Path

    def recv_env(self) -> dict[str, str]:
        return self.s3.env()


def _phase(lab: _Lab, run: Callable[[], Any]) -> tuple[float, int, Any]:
    """(wall seconds, wire bytes, result) of one timed phase."""
    before = lab.link.wire_bytes()
    t0 = time.perf_counter()
    out = run()
    seconds = time.perf_counter() - t0
    return seconds, lab.link.wire_bytes() - before, out


def _scenario(lab: _Lab, rate: float, n: int, size_mib: int, with_shardcast: bool,
              progress: Progress, encode: str) -> dict[str, Any]:
    tag = f"r{int(rate)}-n{n}-{int(time.time() * 1000) % 10**8}"
    lab.link.unshape()
    built = lab.trainer.call("build", size_mib=size_mib, prefix=tag, encode=encode)
    progress(f"  {rate:g} Mbit/s, {n} receiver(s): {built['dense_bytes'] / MiB:.0f} MiB state, "
             f"base published ({built['payload_bytes'] / MiB:.0f} MiB); starting receivers")
    receivers = [Agent(lab.lab, lab.recv_ns, "receiver", f"recv{i}-{tag}", lab.workdir,
                       lab.recv_env()) for i in range(n)]
    try:
        fan_out(receivers, "start", store=f"s3://{BUCKET}/{tag}/wh")
        for v in (0, 1):  # the base, then the untimed warm-up delta
            _check(fan_out(receivers, "sync", version=v), built["roots"][v], f"version {v}")
        if with_shardcast:
            for r in receivers:  # one at a time: shardcast's client init races on /tmp/dummy.bin
                r.call("shardcast_init", server=f"http://127.0.0.1:{SHARDCAST_RELAY_PORT}")
        lab.link.shape(rate)
        out: dict[str, Any] = {"rate_mbit": rate, "receivers": n, "dense_bytes": built["dense_bytes"],
                               "tensors": built["tensors"], "weighthub": []}
        # weighthub first: the full-checkpoint methods then carry the last version (the bits the
        # receivers already hold), so they can be loaded into the live weights without breaking
        # the receivers' committed version
        for version, (label, rate_syn) in enumerate(DELTAS, start=2):
            def refit(v: int = version) -> dict[str, Any]:
                pub = lab.trainer.call("publish", version=v)
                return {"publish": pub, "sync": fan_out(receivers, "sync", version=v)}

            seconds, wire, res = _phase(lab, refit)
            pub, syncs = res["publish"], res["sync"]
            _check(syncs, pub["root"], label)
            pause = max(s["pause_seconds"] for s in syncs)
            out["weighthub"].append({
                "delta": label, "synthetic_rate": rate_syn, "seconds": seconds, "wire_bytes": wire,
                "changed_fraction": pub["changed_fraction"], "payload_bytes": pub["payload_bytes"],
                "publish_seconds": pub["seconds"], "upload_busy_seconds": pub["upload_busy_seconds"],
                "encode_busy_seconds": pub["encode_busy_seconds"], "overlap": pub["overlap"],
                "stage_seconds": max(s["stage_seconds"] for s in syncs),
                "sync_seconds": max(s["seconds"] for s in syncs),
                "pause_seconds": pause, "pause_fraction": pause / seconds,
                "receiver_pause_fraction": max(s["pause_seconds"] / s["seconds"] for s in syncs)})
            progress(f"    weighthub {label} ({pub['changed_fraction']:.2%} changed): {seconds:.2f}s, "
                     f"{wire / MiB:.2f} MiB on the wire, pause {pause / seconds:.1%} of the refit, "
                     f"publish overlap {pub['overlap']:.2f}")
        last = len(DELTAS) + 1
        expected = lab.trainer.call("digest", version=last)["root"]

        def full() -> dict[str, Any]:
            put = lab.trainer.call("put_full", version=last)
            return {"put": put, "get": fan_out(receivers, "get_full", key=put["key"])}

        seconds, wire, res = _phase(lab, full)
        _check(fan_out(receivers, "digest"), expected, "full checkpoint")
        out["full"] = {"seconds": seconds, "wire_bytes": wire, "object_bytes": res["put"]["bytes"],
                       "upload_seconds": res["put"]["seconds"],
                       "receiver_seconds": max(g["seconds"] for g in res["get"])}
        progress(f"    full checkpoint via S3: {seconds:.2f}s, {wire / MiB:.1f} MiB on the wire")

        if with_shardcast:
            def shardcast() -> dict[str, Any]:
                b = lab.trainer.call("broadcast", version=last)
                assert lab.relay is not None
                relay = lab.relay.call("wait", version=b["version"])
                got = fan_out(receivers, "shardcast_get", version=b["version"])
                return {"broadcast": b, "relay": relay, "get": got}

            seconds, wire, res = _phase(lab, shardcast)
            _check(fan_out(receivers, "digest"), expected, "shardcast")
            out["shardcast"] = {"seconds": seconds, "wire_bytes": wire,
                                "broadcast_seconds": res["broadcast"]["seconds"],
                                "relay_seconds": res["relay"]["seconds"],
                                "receiver_seconds": max(g["seconds"] for g in res["get"])}
            progress(f"    shardcast relay: {seconds:.2f}s, {wire / MiB:.1f} MiB on the wire")
        for row in out["weighthub"]:
            row["speedup_vs_full"] = out["full"]["seconds"] / row["seconds"]
            if "shardcast" in out:
                row["speedup_vs_shardcast"] = out["shardcast"]["seconds"] / row["seconds"]
        return out
    finally:
        for r in receivers:
            r.close()


def _check(replies: list[dict[str, Any]], root: str, what: str) -> None:
    bad = [i for i, r in enumerate(replies) if r["root"] != root]
    if bad:
        raise AgentError(f"{what}: receiver(s) {bad} do not hold the trainer's bits "
                         f"(root {replies[bad[0]]['root'][:12]}… vs {root[:12]}…)")


def shardcast_available() -> bool:
    try:
        import shardcast  # noqa: F401
    except ImportError:
        return False
    return shutil.which("wget") is not None  # shardcast's downloader shells out to wget


def run_shaped_bench(rate_mbit: Sequence[float] = (1000, 100), receivers: Sequence[int] = (1, 4), *,
                     size_mib: dict[float, int] | int | None = None, shardcast: bool | None = None,
                     workdir: str | None = None, progress: Progress | None = None,
                     encode: str = "compact") -> dict[str, Any]:
    """Run every (rate, receivers) scenario; return a JSON-able document (see `format_table`).

    Args:
        rate_mbit: link rates to run, Mbit/s.
        receivers: receiver counts to run at each rate (1-8).
        size_mib: state size per rate (default 512 MiB at >= 1 Gbit/s, 128 MiB below), or one
            size for all.
        shardcast: include the shardcast baseline (default: if shardcast and wget are installed).
        workdir: scratch space (default: a temporary directory, removed afterwards).
        encode: the publisher's encode profile (publish.ENCODE_PROFILES: "compact" or "fast").
        progress: called with one line per step (default: print to stderr).

    Raises:
        NetLabUnavailable (a UsageError): not root, or iproute2 missing.
    """
    require_root()
    say = progress or (lambda m: print(m, file=sys.stderr, flush=True))
    if any(n < 1 or n > 8 for n in receivers) or any(r <= 0 for r in rate_mbit):
        raise UsageError("receivers must be 1-8 and rates > 0")
    with_sc = shardcast_available() if shardcast is None else shardcast
    if with_sc and not shardcast_available():
        raise UsageError("the shardcast baseline needs `pip install shardcast==0.3.2` and wget")
    tmp = Path(tempfile.mkdtemp(prefix="wh-shaped-", dir=workdir))
    from ..publish import ENCODE_PROFILES

    if encode not in ENCODE_PROFILES:
        raise UsageError(f"encode profile {encode!r} is not one of {sorted(ENCODE_PROFILES)}")
    doc: dict[str, Any] = {"host": {"cpus": os.cpu_count()}, "shardcast": with_sc, "encode": encode,
                           "scenarios": []}
    t0 = time.perf_counter()
    try:
        with NetLab() as netlab:
            store_ns, recv_ns = netlab.namespace("store"), netlab.namespace("recv")
            link = netlab.link(store_ns, recv_ns)
            say(f"lab: {store_ns.name} ({link.a_addr}) <-> {recv_ns.name} ({link.b_addr}); "
                "starting SeaweedFS")
            with SeaweedServer.start(bucket=BUCKET, lab=netlab, ns=store_ns, host=link.a_addr,
                                     workdir=tmp / "seaweed") as s3:
                trainer = Agent(netlab, store_ns, "trainer", "trainer", tmp, s3.env())
                relay = None
                if with_sc:
                    trainer.call("shardcast_origin", port=SHARDCAST_ORIGIN_PORT)
                    relay = Agent(netlab, recv_ns, "relay", "relay", tmp, {})
                    relay.call("start", port=SHARDCAST_RELAY_PORT,
                               upstream=f"http://{link.a_addr}:{SHARDCAST_ORIGIN_PORT}")
                lab = _Lab(netlab, store_ns, recv_ns, link, s3, trainer, relay, tmp)
                link.wire_bytes()  # the counters must be readable: fail now, not after a run
                real = trainer.call("load_real")
                doc["real_trajectory"] = real
                say(f"real trajectory: {real['source']}, {real['changed_fraction']:.2%} changed per step")
                for rate in rate_mbit:
                    size = (size_mib if isinstance(size_mib, int) else
                            (size_mib or {}).get(rate, DEFAULT_SIZE_MIB[1000 if rate >= 1000 else 100]))
                    for n in receivers:
                        doc["scenarios"].append(_scenario(lab, rate, n, size, with_sc, say, encode))
                    link.unshape()
                for a in (trainer, relay):
                    if a is not None:
                        a.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc["seconds"] = time.perf_counter() - t0
    return doc


def format_table(doc: dict[str, Any]) -> str:
    """The document as a plain-text table, one row per (scenario, method)."""
    head = (f"{'link':>9} {'recv':>4} {'state':>8} {'method':<24} {'changed':>8} {'time s':>8} "
            f"{'wire MiB':>9} {'x full':>7} {'x shardc':>8} {'pause':>6}")
    lines = [head, "-" * len(head)]
    for sc in doc["scenarios"]:
        pre = f"{sc['rate_mbit']:>5g}Mb/s {sc['receivers']:>4} {sc['dense_bytes'] / MiB:>5.0f}MiB"
        lines.append(f"{pre} {'full ckpt via S3':<24} {'':>8} {sc['full']['seconds']:>8.2f} "
                     f"{sc['full']['wire_bytes'] / MiB:>9.1f} {1.0:>7.1f} {'':>8} {'':>6}")
        if "shardcast" in sc:
            c = sc["shardcast"]
            lines.append(f"{pre} {'shardcast relay':<24} {'':>8} {c['seconds']:>8.2f} "
                         f"{c['wire_bytes'] / MiB:>9.1f} {sc['full']['seconds'] / c['seconds']:>7.1f} "
                         f"{1.0:>8.1f} {'':>6}")
        for w in sc["weighthub"]:
            vs_sc = f"{w['speedup_vs_shardcast']:>8.1f}" if "speedup_vs_shardcast" in w else f"{'':>8}"
            lines.append(f"{pre} {'weighthub ' + w['delta']:<24} {w['changed_fraction']:>8.2%} "
                         f"{w['seconds']:>8.2f} {w['wire_bytes'] / MiB:>9.2f} "
                         f"{w['speedup_vs_full']:>7.1f} {vs_sc} {w['pause_fraction']:>6.1%}")
    return "\n".join(lines)


# -- CLI --------------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `weighthub bench shaped`."""
    p.add_argument("--rates", default="1000,100", metavar="MBIT,MBIT", help="link rates (Mbit/s)")
    p.add_argument("--receivers", default="1,4", metavar="N,N", help="receiver counts per rate")
    p.add_argument("--size-mib", type=int, default=None,
                   help="state size for every rate (default 512 MiB at 1 Gbit/s, 128 below)")
    p.add_argument("--no-shardcast", action="store_true", help="skip the shardcast baseline")
    p.add_argument("--encode", choices=["compact", "fast"], default="compact",
                   help="weighthub's encode profile: 'fast' trades ~18%% more bytes for ~1.5x "
                        "faster encoding and staging (publish.ENCODE_PROFILES)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the JSON document here")


def cmd_shaped(args: argparse.Namespace) -> int:
    """`weighthub bench shaped`: needs root (network namespaces); prints the table."""
    try:
        rates = [float(x) for x in args.rates.split(",") if x]
        counts = [int(x) for x in args.receivers.split(",") if x]
    except ValueError as exc:
        raise UsageError(f"--rates/--receivers take comma-separated numbers: {exc}") from exc
    out = Path(args.json).expanduser() if args.json else None
    if out is not None:  # prove the output is writable before minutes of measuring
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.touch()
        except OSError as exc:
            raise UsageError(f"cannot write --json {out}: {exc.strerror or exc}") from None
    doc = run_shaped_bench(rates, counts, size_mib=args.size_mib,
                           shardcast=False if args.no_shardcast else None, encode=args.encode)
    if out is not None:
        out.write_text(json.dumps(doc, indent=1, sort_keys=True))
    print(format_table(doc))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m weighthub.bench.shaped")
    add_arguments(ap)
    sys.exit(cmd_shaped(ap.parse_args()))
