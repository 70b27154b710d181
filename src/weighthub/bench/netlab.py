"""Network namespaces joined by shaped veth links: a bandwidth-limited lab on one host.

    with NetLab() as lab:
        store = lab.namespace("store")             # wh-<pid>-store
        recv = lab.namespace("recv")
        link = lab.link(store, recv)               # veth pair, 10.213.<n>.1 / .2
        link.shape(1000)                           # tc tbf, 1 Gbit/s, both directions
        proc = lab.spawn(store, ["weed", "mini", ...])
        ... measure link.wire_bytes() before/after ...
    # every process spawned is killed and every namespace deleted, also on errors and Ctrl-C

Shaping uses `tc qdisc ... root tbf` on the egress of each veth end (netem is not available
here), which caps both directions at the rate. Addresses come from 10.213.0.0/16 and only ever
exist inside this lab's own namespaces, so nothing outside the lab can be reached or disturbed.

Creating namespaces needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2 (`ip`, `tc`);
without them `NetLab()` raises NetLabUnavailable saying so.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from ..errors import UsageError, WeighthubError

SUBNET_PREFIX = "10.213"  # /16 of private /24s, one per link, assigned only inside our namespaces
COMMAND_TIMEOUT_S = 20.0  # an `ip`/`tc` call that takes longer than this is stuck


class NetLabUnavailable(UsageError):
    """Namespaces cannot be created here: not root, or iproute2 missing."""


class NetLabError(WeighthubError):
    """An `ip`/`tc` command failed while building or measuring the lab."""


def _run(argv: Sequence[str], *, check: bool = True,
         timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              env=child_env())
    except FileNotFoundError as exc:
        raise NetLabUnavailable(f"{argv[0]!r} not found: the shaped-link lab needs iproute2 "
                                "(`ip`, `tc`); install it (apt-get install iproute2)") from exc
    except subprocess.TimeoutExpired as exc:
        raise NetLabError(f"`{' '.join(argv)}` did not finish in {timeout:.0f}s") from exc
    if check and proc.returncode != 0:
        raise NetLabError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): "
                          f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def require_root() -> None:
    """Raise NetLabUnavailable unless this process can create network namespaces."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        raise NetLabUnavailable("the shaped-link lab needs Linux network namespaces")
    if os.geteuid() != 0:
        raise NetLabUnavailable("the shaped-link lab creates network namespaces and tc qdiscs, "
                                "which needs root: run it as root (e.g. `sudo -E weighthub bench "
                                "shaped`) on a host with iproute2")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetLabUnavailable(f"{tool!r} not found: the shaped-link lab needs iproute2 "
                                    "(`ip`, `tc`); install it (apt-get install iproute2)")


def list_namespaces() -> list[str]:
    """Names of all network namespaces `ip netns` knows (to check cleanup)."""
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@dataclass(frozen=True, slots=True)
class Namespace:
    name: str

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run inside this namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: Sequence[str], *, check: bool = True,
            timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        return _run(self.exec_argv(argv), check=check, timeout=timeout)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for lab processes: ours, with this weighthub first on PYTHONPATH.

    Children must import the same weighthub as the orchestrator, whatever the install.
    """
    import weighthub

    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.abspath(weighthub.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


@dataclass(slots=True)
class Link:
    """A veth pair between two namespaces; `a_addr` lives in `a`, `b_addr` in `b`."""

    a: Namespace
    b: Namespace
    a_dev: str
    b_dev: str
    a_addr: str
    b_addr: str
    rate_mbit: float | None = field(default=None)

    def shape(self, rate_mbit: float, *, latency_ms: float = 50.0) -> None:
        """Cap both directions at `rate_mbit` Mbit/s with a token bucket (replaces any cap).

        burst: 4 ms of traffic, at least 64 KiB, so the bucket holds a few GSO super-packets and
        the link runs at ~95% of the rate (smaller buckets under-shoot at Gbit rates).
        latency bounds the queue (packets waiting longer are dropped, as on a real bottleneck).
        """
        if rate_mbit <= 0:
            raise UsageError(f"link rate must be > 0 Mbit/s, got {rate_mbit}")
        rate_bytes = rate_mbit * 1e6 / 8
        burst = max(int(rate_bytes * 0.004), 64 << 10)
        for ns, dev in ((self.a, self.a_dev), (self.b, self.b_dev)):
            ns.run(["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                    f"{int(rate_mbit * 1000)}kbit", "burst", str(burst),
                    "latency", f"{latency_ms:g}ms"])
        self.rate_mbit = rate_mbit

    def unshape(self) -> None:
        """Remove the caps (the veth then runs at memory speed)."""
        for ns, dev in ((self.a, self.a_dev), (self.b, self.b_dev)):
            ns.run(["tc", "qdisc", "del", "dev", dev, "root"], check=False)
        self.rate_mbit = None

    def counters(self) -> dict[str, int]:
        """Bytes sent each way so far: {'a_to_b': …, 'b_to_a': …} (from the kernel's stats)."""
        return {"a_to_b": _tx_bytes(self.a, self.a_dev), "b_to_a": _tx_bytes(self.b, self.b_dev)}

    def wire_bytes(self) -> int:
        """Total bytes both ways (frames including headers) so far."""
        c = self.counters()
        return c["a_to_b"] + c["b_to_a"]


def _tx_bytes(ns: Namespace, dev: str) -> int:
    out = _run(["ip", "-n", ns.name, "-s", "-j", "link", "show", "dev", dev]).stdout
    try:
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])
    except (ValueError, KeyError, IndexError) as exc:
        raise NetLabError(f"cannot read the byte counters of {dev} in {ns.name}: {out[:200]!r}") \
            from exc


class NetLab:
    """Namespaces, links and processes that are all torn down on exit.

    Not thread-safe; one lab per process is the intended use. Names are `wh-<pid>-<role>`, so
    concurrent labs (other processes) never collide.
    """

    def __init__(self) -> None:
        require_root()
        self.prefix = f"wh-{os.getpid()}-"
        self.namespaces: list[Namespace] = []
        self.links: list[Link] = []
        self.processes: list[subprocess.Popen[Any]] = []
        self._closed = False

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def namespace(self, role: str) -> Namespace:
        """A fresh namespace with loopback up."""
        if not role.replace("-", "").isalnum():
            raise UsageError(f"namespace role {role!r}: use letters, digits and '-'")
        ns = Namespace(self.prefix + role)
        try:
            _run(["ip", "netns", "add", ns.name])
        except NetLabError as exc:
            if "Permission" in str(exc) or "Operation not permitted" in str(exc):
                raise NetLabUnavailable(f"cannot create network namespace {ns.name} ({exc}): the "
                                        "shaped-link lab needs root with CAP_SYS_ADMIN") from exc
            raise
        self.namespaces.append(ns)
        ns.run(["ip", "link", "set", "lo", "up"])
        return ns

    def link(self, a: Namespace, b: Namespace) -> Link:
        """A veth pair a <-> b with addresses 10.213.<n>.1/24 (in a) and .2/24 (in b)."""
        n = len(self.links)
        if n > 250:
            raise UsageError("a lab holds at most 250 links")
        a_dev, b_dev = f"wh{n}a", f"wh{n}b"
        # both ends are created directly inside their namespaces: no name ever exists on the host
        _run(["ip", "link", "add", a_dev, "netns", a.name, "type", "veth",
              "peer", "name", b_dev, "netns", b.name])
        link = Link(a, b, a_dev, b_dev, f"{SUBNET_PREFIX}.{n}.1", f"{SUBNET_PREFIX}.{n}.2")
        self.links.append(link)
        for ns, dev, addr in ((a, a_dev, link.a_addr), (b, b_dev, link.b_addr)):
            ns.run(["ip", "addr", "add", f"{addr}/24", "dev", dev])
            ns.run(["ip", "link", "set", dev, "up"])
        return link

    def spawn(self, ns: Namespace, argv: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside `ns` in its own process group; it is killed when the lab closes."""
        popen.setdefault("env", child_env())
        proc = subprocess.Popen(ns.exec_argv(argv), start_new_session=True, **popen)
        self.processes.append(proc)
        return proc

    def close(self) -> None:
        """Kill every spawned process (TERM, then KILL), then delete every namespace. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # a second Ctrl-C during cleanup must not leave namespaces behind
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) \
            if _is_main_thread() else None
        try:
            for proc in self.processes:
                _signal_group(proc, signal.SIGTERM)
            deadline = time.monotonic() + 5.0
            for proc in self.processes:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(proc, signal.SIGKILL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=5.0)
                for f in (proc.stdin, proc.stdout, proc.stderr):
                    if f is not None:
                        f.close()
            for ns in reversed(self.namespaces):
                _kill_remaining(ns)
                _run(["ip", "netns", "del", ns.name], check=False)
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # the group: `ip netns exec` execs the program, which is its leader


def _kill_remaining(ns: Namespace) -> None:
    """Kill stragglers still inside one of *our* namespaces (e.g. a daemonized child)."""
    proc = _run(["ip", "netns", "pids", ns.name], check=False)
    for tok in proc.stdout.split():
        if tok.isdigit():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(tok), signal.SIGKILL)


# -- throughput check: a tiny iperf in Python ---------------------------------------------------

def measure_throughput(lab: NetLab, src: Namespace, dst: Namespace, dst_addr: str, *,
                       seconds: float = 2.0, port: int = 5201) -> float:
    """Bits per second one TCP stream achieves from `src` to `dst_addr` (inside `dst`)."""
    sink = lab.spawn(dst, [sys.executable, "-m", "weighthub.bench.netlab", "sink", dst_addr,
                           str(port)], stdout=subprocess.PIPE, text=True)
    try:
        ready = sink.stdout.readline() if sink.stdout else ""
        if ready.strip() != "ready":
            raise NetLabError(f"throughput sink in {dst.name} did not start (said {ready!r})")
        src.run([sys.executable, "-m", "weighthub.bench.netlab", "source", dst_addr, str(port),
                 f"{seconds:g}"], timeout=seconds + 30)
        out, _ = sink.communicate(timeout=seconds + 30)
    except subprocess.TimeoutExpired as exc:
        raise NetLabError(f"throughput test {src.name} -> {dst_addr} hung") from exc
    doc = json.loads(out.strip().splitlines()[-1])
    return 8 * doc["bytes"] / doc["seconds"]


def _sink(addr: str, port: int) -> None:
    with socket.create_server((addr, port)) as srv:
        print("ready", flush=True)
        srv.settimeout(30)
        conn, _ = srv.accept()
        conn.settimeout(30)
        buf = bytearray(1 << 20)
        total, first, last = 0, 0.0, 0.0
        with conn:
            while n := conn.recv_into(buf):
                now = time.perf_counter()
                if not total:
                    first = now
                total += n
                last = now
    # the first recv's bytes arrived before the clock started: leave them out
    print(json.dumps({"bytes": total, "seconds": max(last - first, 1e-9)}), flush=True)


def _source(addr: str, port: int, seconds: float) -> None:
    payload = os.urandom(1 << 20)
    with socket.create_connection((addr, port), timeout=30) as conn:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            conn.sendall(payload)


def _main(argv: Sequence[str]) -> int:
    if argv and argv[0] == "sink":
        _sink(argv[1], int(argv[2]))
        return 0
    if argv and argv[0] == "source":
        _source(argv[1], int(argv[2]), float(argv[3]))
        return 0
    if argv and argv[0] == "check":  # python -m weighthub.bench.netlab check [RATE_MBIT]
        rate = float(argv[1]) if len(argv) > 1 else 1000.0
        with NetLab() as lab:
            a, b = lab.namespace("a"), lab.namespace("b")
            link = lab.link(a, b)
            link.shape(rate)
            bps = measure_throughput(lab, a, b, link.b_addr)
            print(f"rate {rate:g} Mbit/s: measured {bps / 1e6:.1f} Mbit/s "
                  f"({bps / (rate * 1e6):.1%} of the cap)")
        return 0
    print("usage: python -m weighthub.bench.netlab check [RATE_MBIT]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
