"""weighthub on Ray: a sync group's hub and node daemons as actors; trainer and rollout actors.

    import ray
    from weighthub.integrations.ray import REFIT_MALLOC_ENV, WeightSync, VLLMRollout

    ray.init()
    sync = WeightSync.create("s3://bucket/policy")    # hub + one node daemon per Ray node
    publisher = sync.publisher()                      # trainer: publisher.publish(state_dict)
    engine = ray.remote(VLLMRollout).options(max_concurrency=2, runtime_env={
        "env_vars": REFIT_MALLOC_ENV}).remote("e0", checkpoint_dir)
    sync.attach_engine(engine)
    engine.weighthub_stage.remote(version)            # background, while it generates
    ray.get(engine.weighthub_refit.remote(version))   # the pause: apply, verify, commit
    batch = ray.get(engine.generate.remote(prompts, samples=4, max_tokens=32))
    ledger.check(batch["attestation"])                # the trainer's PolicyLedger

    spec      SyncSpec: the group as a value (or a 0600 JSON file, for a trainer outside Ray)
    sync      WeightSync: create / connect / publisher / sharded_publisher / attach_engine /
              add_nodes / wait_daemons / close
    ranks     RankPublisher: a sharded trainer rank's publisher that announces to the hub
    daemons   the hub and node daemons as Ray actors, restartable at the same address
    rollout   RolloutEngine (mixin for a rollout actor owning a vllm.LLM) and VLLMRollout
    attest    Attestation, PolicyLedger, drift
    tasks     verifiable tasks (arithmetic for SmolLM2; a token task for tiny test models)
    trainer   GRPOTrainer: fp32 master, clipped GRPO step, bf16 publish, attestation checks
    loop      GRPOLoop / RLConfig: the end-to-end run and its side-by-side baseline
    cluster   local_cluster: real raylets on one machine
    heap      freeze_startup_heap: full collections skip the start-up heap (a trainer of your
              own: call it once the model, optimizer and publisher exist); REFIT_MALLOC_ENV:
              the environment that keeps freed pages for the next staging or publish
    example   `weighthub demo --rl`; options: its command-line options (light to import)
"""

from typing import TYPE_CHECKING

from ...lazy import lazy_exports

if TYPE_CHECKING:  # the names resolve on first use: the CLI imports `options` without Ray
    from .attest import Attestation, PolicyLedger, drift
    from .heap import REFIT_MALLOC_ENV, freeze_startup_heap
    from .rollout import RolloutEngine, VLLMRollout
    from .spec import NodeSpec, SyncSpec
    from .sync import WeightSync

__getattr__ = lazy_exports(globals(), {
    "attest": frozenset({"Attestation", "PolicyLedger", "drift"}),
    "heap": frozenset({"REFIT_MALLOC_ENV", "freeze_startup_heap"}),
    "rollout": frozenset({"RolloutEngine", "VLLMRollout"}),
    "spec": frozenset({"NodeSpec", "SyncSpec"}),
    "sync": frozenset({"WeightSync"}),
})
__all__ = ["REFIT_MALLOC_ENV", "Attestation", "NodeSpec", "PolicyLedger", "RolloutEngine",
           "SyncSpec", "VLLMRollout", "WeightSync", "drift", "freeze_startup_heap"]
