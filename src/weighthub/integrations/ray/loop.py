"""The GRPO loop on Ray: a trainer actor, rollout actors on vLLM, weighthub between them.

    run_grpo(RLConfig(model="smollm2", steps=5, engines=2))

Per step: the engines generate the step's rollouts (each batch attested), the trainer checks
the attestations and the drift, updates and publishes; every engine stages the new version in
the background and refits (paused only to apply). With `lag=0` and `early_decode` the engines
are told to stage the update before the trainer starts it: each decodes the chunks as they are
pushed to its node, while the trainer is still publishing, and the staging after the commit
takes them.
With `lag=1` the engines generate the next batch with the previous version while the trainer
updates, and stage while they generate (the trainer's importance ratios and ledger account for
the one version of staleness).

Then, side by side in the same step, the usual route: the trainer's full bf16 state through
Ray's object store into every engine's vLLM loader (`weighthub_load_state`; the same bits, so
the engines stay on the version). Per step the loop reports reward, drift, the refit (publish
start → every engine serving), the pause, bytes moved by each route, and the version and root
each engine attested.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...errors import UsageError
from .heap import REFIT_RUNTIME_ENV
from .rollout import VLLMRollout
from .sync import WeightSync
from .trainer import GRPOTrainer

DEAD_GRACE_S = 10.0  # how long a rollout actor must read as dead before it is replaced
SETTLE_TIMEOUT_S = 60.0  # the longest wait for a quiet link after the baseline


@dataclass(slots=True)
class RLConfig:
    model: str | dict[str, Any] = "smollm2"
    store_url: str = ""
    work_dir: str = ""
    steps: int = 4
    engines: int = 2
    prompts: int = 8  # per step, split over the engines
    samples: int = 4  # per prompt (the GRPO group)
    max_tokens: int = 16
    lr: float = 1e-5
    lag: int = 0  # 0: on-policy; 1: generate the next batch while training (stage during it)
    encode: str = "fast"
    seed: int = 0
    baseline: bool = True
    # lag 0: the engines told to stage each update before the trainer starts it, decoding its
    # chunks as they are pushed to their node (`Receiver.decode_early`). Off by default: on
    # one shared 2-core host it slowed the publish more than it saved (README, "RL on Ray")
    early_decode: bool = False
    # rounds of the generation probe after the steps (lag 0): idle against staging (`probe`)
    probe_rounds: int = 3
    plain_cpu_weights: bool = False  # vLLM CPU without oneDNN packing: refits apply in place
    # "all": engines spread over every Ray node; "others": only over nodes without the trainer
    # (disaggregated: every refit crosses the network, as on a real cluster)
    rollout_nodes: str = "all"
    engine_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.lag not in (0, 1) or self.steps < 1 or self.engines < 1 \
                or self.prompts < self.engines or self.samples < 2 or self.probe_rounds < 0:
            raise UsageError(f"RLConfig: need lag 0 or 1, steps ≥ 1, engines ≥ 1, prompts ≥ "
                             f"engines, samples ≥ 2, probe rounds ≥ 0; got {self.lag}, "
                             f"{self.steps}, {self.engines}, {self.prompts}, {self.samples}, "
                             f"{self.probe_rounds}")
        if self.rollout_nodes not in ("all", "others"):
            raise UsageError(f"RLConfig.rollout_nodes must be 'all' or 'others', got "
                             f"{self.rollout_nodes!r}")


def _engine_figures(refit: dict[str, Any]) -> dict[str, float]:
    """Where one engine's part of a refit went, in order: waiting for its node's daemon to hold
    the version, staging, waiting for its pause turn (serving), waiting for a generation in
    flight to end, the pause."""
    staged = refit["staged"] or {}
    return {"node_wait_s": staged.get("node_wait_s", 0.0),
            "stage_s": staged.get("stage_s", refit["stage_s"]),
            # CPU the engine's worker process used meanwhile (all its threads): near stage_s,
            # staging ran on a core of its own; far above, vLLM's threads ran alongside
            "stage_process_cpu_s": staged.get("stage_process_cpu_s", float("nan")),
            "stage_process_sys_s": staged.get("stage_process_sys_s", float("nan")),
            "stage_minor_faults": staged.get("stage_minor_faults", -1),
            # chunks decoded while they were being published (before the commit)
            "early_chunks": staged.get("early_chunks", 0),
            "turn_wait_s": refit["turn_wait_s"], "serve_wait_s": refit["serve_wait_s"],
            "pause_s": refit["pause_s"],
            # of the pause: writing the staged words, checking the digests (the rest: commit)
            "pause_apply_s": refit.get("mirror_apply_s", float("nan")),
            "pause_verify_s": refit.get("verify_s", float("nan"))}


def settle(wire: Callable[[], int], *, quiet_bytes: int = 64 << 10, interval_s: float = 0.5,
           timeout_s: float = SETTLE_TIMEOUT_S) -> float:
    """Wait until the link is quiet (fewer than `quiet_bytes` in an `interval_s`); the seconds
    waited. Gives up after `timeout_s` (the bytes still count where they are measured)."""
    t0 = time.perf_counter()
    last = wire()
    while time.perf_counter() - t0 < timeout_s:
        time.sleep(interval_s)
        now = wire()
        if now - last < quiet_bytes:
            break
        last = now
    return time.perf_counter() - t0


def _pinned(cls: type, node_id: str, **options: Any) -> Any:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(cls).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), **options)


class GRPOLoop:
    """The actors of one run (started by `start`, removed by `close`) and its steps."""

    def __init__(self, config: RLConfig, sync: WeightSync, *,
                 wire: Callable[[], int] | None = None) -> None:
        self.config = config
        self.sync = sync
        self.wire = wire  # bytes across the network link so far (both ways), when measured
        self.trainer: Any = None
        self.engines: list[Any] = []
        self.initial: dict[str, Any] = {}
        self.steps: list[dict[str, Any]] = []
        self._engine_args: dict[str, Any] = {}
        self._engine_nodes: list[str] = []

    def start(self) -> dict[str, Any]:
        import ray

        c = self.config
        nodes = sorted(self.sync.spec.nodes)
        here = ray.get_runtime_context().get_node_id()
        # the trainer and the engines publish or stage every step: they keep freed pages (`heap`)
        self.trainer = _pinned(GRPOTrainer, here, num_cpus=0, runtime_env=REFIT_RUNTIME_ENV).remote(
            c.model, self.sync.spec, c.work_dir, lr=c.lr, max_lag=c.lag, seed=c.seed, encode=c.encode)
        self.initial = ray.get(self.trainer.start.remote())
        args = {"skip_tokenizer_init": True, "enforce_eager": True, "max_model_len": 256,
                "dtype": "bfloat16", "max_num_seqs": 16, "seed": c.seed} | c.engine_args
        self._engine_args = args
        if c.rollout_nodes == "others":
            nodes = [n for n in nodes if n != here]
            if not nodes:
                raise UsageError("rollout_nodes='others' needs a Ray node besides the trainer's "
                                 "(the driver's); the cluster has only that one")
        self._engine_nodes = [nodes[i % len(nodes)] for i in range(c.engines)]  # spread over nodes
        self.engines = [self.engine_actor(i, node, args) for i, node in enumerate(self._engine_nodes)]
        # each attached itself at start-up; attaching again returns what it is bound to
        bound = [self.sync.attach_engine(e, version=self.initial["version"]) for e in self.engines]
        return {"initial": self.initial, "bound": bound}

    def engine_actor(self, i: int, node: str, args: dict[str, Any]) -> Any:
        """Rollout actor `i` on `node`, attached at start-up (so also after a Ray restart:
        `max_restarts`), from the initial checkpoint. max_concurrency 2: a refit stages beside
        a generation (both guarded inside the actor)."""
        return _pinned(VLLMRollout, node, num_cpus=0, max_concurrency=2, max_restarts=2,
                       runtime_env=REFIT_RUNTIME_ENV).remote(
            f"engine{i}", self.initial["checkpoint"], sync=self.sync.spec,
            version=self.initial["version"], plain_cpu_weights=self.config.plain_cpu_weights,
            **args)

    def ensure_engines(self, *, timeout: float = 300.0) -> list[int]:
        """Wait for every rollout actor to answer (one Ray is restarting re-attaches itself and
        refits to the newest version); replace those that are gone for good with a new actor
        on the same node. Returns the indices replaced."""
        import ray

        replaced = []
        deadline = time.monotonic() + timeout
        for i, e in enumerate(self.engines):
            dead_since = None
            while True:
                try:
                    ray.get(e.weighthub_attestation.remote(),
                            timeout=max(1.0, deadline - time.monotonic()))
                    break
                except (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError) as exc:
                    # a restart can read as "died" for a moment: dead only if it stays so
                    now = time.monotonic()
                    if isinstance(exc, ray.exceptions.ActorDiedError):
                        dead_since = dead_since or now
                        if now - dead_since >= DEAD_GRACE_S:  # out of restarts, or killed for good
                            e = self.engines[i] = self.engine_actor(i, self._engine_nodes[i],
                                                                    self._engine_args)
                            replaced.append(i)
                            dead_since = None
                            continue
                    else:
                        dead_since = None
                    if now >= deadline:
                        raise
                    time.sleep(0.5)
        return replaced

    # -- one step -------------------------------------------------------------------------------
    def generate(self, step: int) -> tuple[list[Any], list[Any]]:
        import ray

        c = self.config
        prompts = ray.get(self.trainer.prompts.remote(step, c.prompts))
        share = -(-len(prompts) // len(self.engines))
        futures = [e.generate.remote([p for p, _ in prompts[i * share:(i + 1) * share]],
                                     samples=c.samples, max_tokens=c.max_tokens, seed=c.seed + step)
                   for i, e in enumerate(self.engines)]
        return prompts, futures

    def run(self, steps: int | None = None,
            on_row: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        """Run `steps` more steps (default: the config's); every row so far. `on_row` sees
        each step's row as it completes (with lag 1: when the next step's batch is in)."""
        import ray

        c = self.config
        first = len(self.steps)
        last = first + (c.steps if steps is None else steps)
        pending = self.generate(first)
        refits: list[Any] = []
        for step in range(first, last):
            prompts, futures = pending
            batches = ray.get(futures)
            refit_results = ray.get(refits) if refits else []
            if c.lag == 1 and step + 1 < last:  # the next batch while the trainer updates
                pending = self.generate(step + 1)
            wire_before = self._wire()
            if c.lag == 0 and c.early_decode:  # each waits for the update, decoding its chunks
                upcoming = (self.steps[-1]["version"] if self.steps else self.initial["version"]) + 1
                for e in self.engines:
                    e.weighthub_stage.remote(upcoming, early=True)
            trained = ray.get(self.trainer.step.remote(prompts, batches))
            published_at = time.perf_counter()
            version = trained["version"]
            # each engine stages at once (beside a generation in flight, with lag 1), then
            # pauses only to apply
            refits = [e.weighthub_refit.remote(version) for e in self.engines]
            row = self._row(step, batches, trained, refit_results)
            if c.lag == 0:
                done = ray.get(refits)
                refits = []
                row |= self._refit_figures(trained, done, time.perf_counter() - published_at)
                if self.wire is not None:  # the update's publish and every engine's refit
                    row["refit_wire_bytes"] = self._wire() - wire_before
                if c.baseline:
                    row |= self._baseline()
                if step + 1 < last:
                    pending = self.generate(step + 1)
            if c.lag == 0 and on_row is not None:
                on_row(row)
            elif c.lag == 1 and self.steps and on_row is not None:
                on_row(self.steps[-1])
            self.steps.append(row)
        if refits:  # lag 1: the last version's refit
            final = ray.get(refits)
            self.steps[-1] |= {"pause_s": max(r["pause_s"] for r in final)}
            if on_row is not None:
                on_row(self.steps[-1])
        return self.steps

    def _row(self, step: int, batches: list[dict[str, Any]], trained: dict[str, Any],
             refit_results: list[dict[str, Any]]) -> dict[str, Any]:
        attested = [(b["attestation"].engine, b["attestation"].version, b["attestation"].root[:12])
                    for b in batches]
        tokens = sum(b["tokens"] for b in batches)
        gen_s = max(b["seconds"] for b in batches)
        row = {"step": step, "reward": trained["reward"], "loss": trained["loss"],
               "drift": trained["drift"], "lag": trained["lag"], "attested": attested,
               "version": trained["version"], "changed": trained["changed"],
               "publish_s": trained["publish_s"], "payload_bytes": trained["payload_bytes"],
               # the publish's chunk phase and its threads' busy time encoding (and the CPU
               # time of that: below it, the encoders were preempted) and uploading, within
               # the Publisher's own time (inner), between the hub calls for the relay plan
               # and the announcement
               **{k: trained[k] for k in ("publish_stream_s", "publish_encode_s",
                                          "publish_encode_cpu_s", "publish_upload_s",
                                          "publish_plan_s", "publish_announce_s",
                                          "publish_inner_s")},
               "dense_bytes": trained["dense_bytes"],
               "gen_tokens": tokens, "gen_s": gen_s}
        if refit_results:  # lag 1: the previous version's refit, overlapped with generation
            row |= {"prev_pause_s": max(r["pause_s"] for r in refit_results),
                    "prev_stage_s": max((r["staged"] or {}).get("stage_s", 0.0) for r in refit_results),
                    # > 0: staged before the generation it overlapped had ended
                    "prev_serve_wait_s": min(r["serve_wait_s"] for r in refit_results)}
        return row

    def _refit_figures(self, trained: dict[str, Any], done: list[dict[str, Any]],
                       after_publish_s: float) -> dict[str, Any]:
        fetched = sum(int(r["bytes_fetched"]) for r in done)
        # publish start -> the trainer's reply, then the driver's clock: only the reply's
        # transit is not counted
        return {"refit_s": trained["since_publish_s"] + after_publish_s,
                "pause_s": max(r["pause_s"] for r in done),
                "stage_s": max((r["staged"] or {}).get("stage_s", r["stage_s"]) for r in done),
                "engine_push_s": max(r["engine_s"] for r in done),  # vLLM's loader, in the pause
                # serving while another engine of the node paused (`pauses`: in turn)
                "turn_wait_s": max(r["turn_wait_s"] for r in done),
                "in_turn": all(r["in_turn"] for r in done),
                "prestaged": all(r["prestaged"] for r in done),
                # per engine: staged from chunks its daemon had been pushed, before its apply
                "node_relayed": [bool((r["staged"] or {}).get("node_relayed")) for r in done],
                # per engine: planned from the manifest relayed to its node, not the store's
                "relayed_manifest": [bool((r["staged"] or {}).get("relayed_manifest"))
                                     for r in done],
                "stage_errors": [r["stage_error"] for r in done if r["stage_error"]],
                "engine_bytes": fetched,
                "per_engine": [_engine_figures(r) for r in done],
                # chunks each source handed the engines so far (this node's daemon, the store)
                "served": [r["served"] for r in done]}

    def _baseline(self) -> dict[str, Any]:
        """The full bf16 state through Ray's object store into every engine's loader."""
        import ray

        wire_before = self._wire()
        t0 = time.perf_counter()
        ref = ray.get(self.trainer.state_ref.remote())[0]
        loaded = ray.get([e.weighthub_load_state.remote(ref) for e in self.engines])
        out = {"baseline_s": time.perf_counter() - t0,
               "baseline_load_s": max(r["seconds"] for r in loaded),
               "baseline_bytes": sum(int(r["bytes"]) for r in loaded)}
        if self.wire is not None:
            # Ray's object manager may still be sending (duplicate pushes after losses on a
            # shaped link): those bytes are the baseline's too, and must not land in the next
            # refit's window or compete with it
            out["baseline_settle_s"] = settle(self.wire)
            out["baseline_wire_bytes"] = self._wire() - wire_before
        return out

    def _wire(self) -> int:
        return 0 if self.wire is None else self.wire()

    def close(self) -> None:
        import ray

        for e in self.engines:
            with contextlib.suppress(Exception):  # a dead or hung actor is killed below
                ray.get(e.shutdown.remote(), timeout=60)
            ray.kill(e)
        if self.trainer is not None:
            with contextlib.suppress(Exception):  # a dead or hung actor is killed below
                ray.get(self.trainer.close.remote(), timeout=30)
            ray.kill(self.trainer)
        self.engines, self.trainer = [], None

