"""The agents of the shaped-link benchmark: the processes inside the lab's network namespaces.

bench.shaped (the orchestrator) starts each agent with `agent_argv(role, workdir)`, i.e.

    python -m weighthub.bench.shaped_agents serve ROLE WORKDIR

inside a namespace, then speaks JSON lines with it: one command per stdin line
(`{"op": "sync", "version": 2}`), one reply per stdout line (`{"ok": true, ...}` or
`{"ok": false, "error": "..."}`); commands run one at a time, in order. EOF on stdin ends the
agent. Library output goes to stderr (the agent's log), never to the reply channel.

    trainer   (store side) holds the states, publishes weighthub deltas, PUTs the full
              checkpoint, runs the shardcast origin
    receiver  (receiver side) a rollout worker's weights, refitted by each method
    relay     (receiver side) a shardcast middle node

The states are tiles of one real step (MiniLM fine-tuning, from bench.trajectories) plus
synthetic steps on top of it (bench.trajectories.synthetic).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import UsageError, WeighthubError

MiB = 1 << 20
BUCKET = "weighthub-bench"
PHASE_TIMEOUT_S = 600.0
# steps 2→3 of MiniLM at this lr change ~1.3% of the bf16 words (MEASUREMENTS.md); the standard
# 10-step trajectory at this lr (bench.trajectories.STANDARD) is shared with the other benchmarks
REAL_MODEL, REAL_LR, REAL_TRAJECTORY_STEPS = "minilm", 3e-6, 10
REAL_STEPS = (2, 3)


class AgentError(WeighthubError):
    """A benchmark agent process failed or did not answer in time."""


def agent_argv(role: str, workdir: Path) -> list[str]:
    """The command line that runs one agent (see `serve`)."""
    if role not in ROLES:
        raise UsageError(f"unknown agent role {role!r}; known: {sorted(ROLES)}")
    return [sys.executable, "-m", "weighthub.bench.shaped_agents", "serve", role, str(workdir)]


def _root(state: dict[str, Any]) -> str:
    from ..digest import digest_bits, root_digest
    from ..tensors import bits, specs_of

    return root_digest((s, digest_bits(bits(state[s.name]))) for s in specs_of(state)).hex()


def real_pair(cache_dir: Path | None = None) -> tuple[dict[str, Any], dict[str, Any], str]:
    """Two consecutive bf16 states of a real MiniLM fine-tuning run, and where they came from.

    Steps 2 and 3 of the bench.trajectories MiniLM trajectory at lr 3e-6 (built and cached by
    `trajectories.load` on first use: a few minutes on 2 cores, then instant).

    Args:
        cache_dir: the trajectories cache (default: bench.trajectories' default).

    Raises:
        UsageError: the trajectory is not cached and cannot be built here (transformers or the
            MiniLM wheel missing), with the command that installs them.
    """
    from . import trajectories

    spec = trajectories.TrajectorySpec(model=REAL_MODEL, lr=REAL_LR, steps=REAL_TRAJECTORY_STEPS,
                                       seed=0)
    try:
        traj = trajectories.load(spec, cache_dir=cache_dir)
    except UsageError as exc:
        where = cache_dir or trajectories.default_cache_dir()
        raise UsageError(f"the shaped benchmark's real delta is the trajectory {spec.name}, which "
                         f"is not cached under {where} and cannot be built here: {exc}") from exc
    old, new = (traj.state(k) for k in REAL_STEPS)
    source = f"MiniLM fine-tuning, lr {REAL_LR:g}, step {REAL_STEPS[0]}→{REAL_STEPS[1]}"
    return old, new, source


def tile(state: dict[str, Any], copies: int) -> dict[str, Any]:
    """`copies` independent copies of every tensor (names prefixed t00., t01., …)."""
    return {f"t{k:02d}.{name}": t.clone() for k in range(copies) for name, t in state.items()}


def synthetic_step(state: dict[str, Any], rate: float, seed: int) -> dict[str, Any]:
    """A new state with `rate` of the bf16 words moved like a real step (trajectories.synthetic)."""
    from .trajectories import synthetic

    return dict(synthetic(state, rate, seed))


class _TimedStore:
    """A store proxy that sums the time spent in put() (across threads): upload busy time."""

    def __init__(self, inner: Any) -> None:
        import threading

        self.inner, self.url, self.busy = inner, inner.url, 0.0
        self._lock = threading.Lock()

    def put(self, key: str, data: Any, *, create_only: bool = False,
            timeout: float | None = None) -> None:
        t0 = time.perf_counter()
        try:
            self.inner.put(key, data, create_only=create_only, timeout=timeout)
        finally:
            with self._lock:
                self.busy += time.perf_counter() - t0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class TrainerAgent:
    """Store side: holds the states, publishes them, serves the full checkpoint and shardcast."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.real: tuple[Any, Any] | None = None
        self.states: list[dict[str, Any]] = []
        self.origin: Any = None

    def op_load_real(self) -> dict[str, Any]:
        from .trajectories import change_rate

        a, b, source = real_pair()
        self.real = (a, b)
        return {"source": source, "changed_fraction": change_rate(a, b),
                "dense_bytes": sum(t.numel() * t.element_size() for t in a.values())}

    def op_build(self, size_mib: int, prefix: str, encode: str = "compact") -> dict[str, Any]:
        if self.real is None:
            raise AgentError("build: call load_real first (the states are tiles of the real pair)")
        a, b = self.real
        one = sum(t.numel() * t.element_size() for t in a.values())
        copies = max(1, round(size_mib * MiB / one))
        if self.states and len(self.states[0]) == copies * len(a):
            return self._publish_base(prefix, encode)  # same size as the last scenario: reuse them
        self.states = []  # free the previous size's states first
        base = tile(a, copies)
        # v0 is `base` with a synthetic 1% step undone, so v0→v1 (published untimed, unshaped)
        # warms every process up (numba kernels, connection pools) before the timed deltas
        v2 = tile(b, copies)
        v3 = synthetic_step(v2, 0.03, seed=1)
        self.states = [synthetic_step(base, 0.01, seed=0), base, v2, v3,
                       synthetic_step(v3, 0.05, seed=2)]
        return self._publish_base(prefix, encode)

    def _publish_base(self, prefix: str, encode: str) -> dict[str, Any]:
        from ..publish import ENCODE_PROFILES, Publisher
        from ..store import open_store

        self.store = _TimedStore(open_store(f"s3://{BUCKET}/{prefix}/wh"))
        self.full_url = f"s3://{BUCKET}/{prefix}/full"
        self.publisher = Publisher(self.store, policy=ENCODE_PROFILES[encode])
        r = self.publisher.publish(self.states[0])
        self.publisher.publish(self.states[1])
        return {"dense_bytes": r.dense_bytes, "payload_bytes": r.payload_bytes,
                "tensors": len(self.states[0]), "roots": [self._manifest_root(v) for v in (0, 1)]}

    def _manifest_root(self, version: int) -> str:
        from .. import catalog

        return catalog.primary_manifest(self.store.inner, version).root

    def op_publish(self, version: int) -> dict[str, Any]:
        self.store.busy = 0.0
        r = self.publisher.publish(self.states[version])
        if r.version != version:
            raise UsageError(f"published version {r.version}, expected {version}")
        return {"seconds": r.seconds, "payload_bytes": r.payload_bytes,
                "changed_fraction": r.changed_fraction, "upload_busy_seconds": self.store.busy,
                "stream_seconds": r.stream_seconds, "encode_busy_seconds": r.encode_seconds,
                "overlap": r.overlap,
                "root": self._manifest_root(version)}

    def op_digest(self, version: int) -> dict[str, Any]:
        return {"root": _root(self.states[version])}

    def op_put_full(self, version: int) -> dict[str, Any]:
        import safetensors.torch as st

        from ..store import open_store

        t0 = time.perf_counter()
        blob = st.save(self.states[version])
        key = f"v{version}-{int(time.time() * 1000)}.safetensors"
        open_store(self.full_url).put(key, blob)
        return {"key": f"{self.full_url}/{key}", "bytes": len(blob),
                "seconds": time.perf_counter() - t0}

    def op_shardcast_origin(self, port: int) -> dict[str, Any]:
        from shardcast import OriginServer

        data = self.workdir / "origin"
        data.mkdir(parents=True, exist_ok=True)
        (data / "data1.bin").write_bytes(b"\0" * 1024)  # clients probe it at init (not automatic)
        self.origin = OriginServer(str(data), port)
        return {}

    def op_broadcast(self, version: int) -> dict[str, Any]:
        import safetensors.torch as st

        t0 = time.perf_counter()
        path = self.workdir / "checkpoint.safetensors"
        st.save_file(self.states[version], str(path))
        name = self.origin.broadcast(str(path))
        path.unlink()
        return {"version": name, "seconds": time.perf_counter() - t0}


def _load_into(weights: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Copy a loaded checkpoint into the live weights (what load_state_dict does)."""
    if set(weights) != set(loaded):
        raise UsageError("the downloaded checkpoint's tensors differ from the receiver's")
    for name, t in loaded.items():
        weights[name].copy_(t)


class ReceiverAgent:
    """Receiver side: a rollout worker's weights, refitted by each method."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.client: Any = None

    def op_start(self, store: str) -> dict[str, Any]:
        from ..receive import Receiver
        from ..store import open_store
        from ..targets import StateDictTarget

        self.target = StateDictTarget({})
        self.receiver = Receiver(open_store(store), self.target)
        return {}

    def op_sync(self, version: int) -> dict[str, Any]:
        r = self.receiver.sync(version)
        held = self.target.held()
        return {"seconds": r.seconds, "stage_seconds": r.stage_seconds,
                "apply_seconds": r.apply_seconds, "pause_seconds": r.pause_seconds,
                "bytes_fetched": r.bytes_fetched,
                "root": held.root if held else ""}

    def op_digest(self) -> dict[str, Any]:
        return {"root": _root(self.target.state)}

    def op_get_full(self, key: str) -> dict[str, Any]:
        import safetensors.torch as st

        from ..store import open_store

        t0 = time.perf_counter()
        url, name = key.rsplit("/", 1)
        _load_into(self.target.state, st.load(open_store(url).get(name)))
        return {"seconds": time.perf_counter() - t0}

    def op_shardcast_init(self, server: str) -> dict[str, Any]:
        import shardcast.client as sc_client
        from shardcast import ClientNode

        # shardcast 0.3.2 downloads the distribution file to one fixed path inside its package
        # directory: receivers on one host would race on it. Same logic, a private path.
        private = self.workdir / "distribution.txt"

        def download_distribution_file(self_: Any) -> str | None:
            if self_.download_file(sc_client.SHARDCAST_DISTRIBUTION_FILE, str(private),
                                   update_metrics=False, log_error_on_failure=False):
                text = private.read_text()
                private.unlink()
                return text
            return None

        sc_client.ShardDownloader.download_distribution_file = download_distribution_file
        self.client = ClientNode([server], str(self.workdir / "shardcast"))
        return {}

    def op_shardcast_get(self, version: str) -> dict[str, Any]:
        import safetensors.torch as st

        t0 = time.perf_counter()
        out = self.workdir / "shardcast" / "checkpoint.safetensors"
        path = self.client.download_version(version, str(out))
        if path is None:
            raise AgentError(f"shardcast could not download {version} (see the agent log)")
        _load_into(self.target.state, st.load_file(path))
        Path(path).unlink()
        return {"seconds": time.perf_counter() - t0}


class RelayAgent:
    """A shardcast middle node on the receivers' side of the link."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.node: Any = None

    def op_start(self, port: int, upstream: str) -> dict[str, Any]:
        from shardcast import MiddleNode

        data = self.workdir / "relay"
        data.mkdir(parents=True, exist_ok=True)
        (data / "data1.bin").write_bytes(b"\0" * 1024)
        # check_interval 1 s: the smallest it takes (default 30 s); it bounds the relay's lag
        self.node = MiddleNode([upstream], str(data), port, check_interval=1)
        return {}

    def op_wait(self, version: str, timeout: float = PHASE_TIMEOUT_S) -> dict[str, Any]:
        t0 = time.perf_counter()
        while version not in self.node.processed_versions:
            if time.perf_counter() - t0 > timeout:
                raise AgentError(f"the shardcast relay did not fetch {version} in {timeout:.0f}s")
            time.sleep(0.01)
        return {"seconds": time.perf_counter() - t0}


def serve(role: str, workdir: Path) -> int:
    """Agent main loop: one JSON command per stdin line, one JSON reply per stdout line."""
    import traceback

    workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(workdir)
    os.environ.setdefault("SHARDCAST_LOG_LEVEL", "WARNING")
    handler = ROLES[role](workdir)
    replies, sys.stdout = sys.stdout, sys.stderr  # library prints go to the log, not the channel
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            doc = {"ok": True, **getattr(handler, f"op_{op}")(**cmd)}
        except Exception as exc:
            traceback.print_exc()
            doc = {"ok": False, "error": f"{op}: {type(exc).__name__}: {exc}"}
        replies.write(json.dumps(doc) + "\n")
        replies.flush()
    return 0


ROLES: dict[str, Any] = {"trainer": TrainerAgent, "receiver": ReceiverAgent, "relay": RelayAgent}


def _main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "serve" and argv[1] in ROLES:
        return serve(argv[1], Path(argv[2]))
    print(f"usage: python -m weighthub.bench.shaped_agents serve {{{','.join(ROLES)}}} WORKDIR",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
