"""Generation throughput with and without a staging in flight (issue #15: ≥ 95% of idle).

One engine generates the same batch back to back, every completion to its token limit (the
same work each time, whatever the version answers), alternating: idle, then while it stages a
new version (one more trained step), then idle again after its refit, `rounds` times. Each
staging generate is compared with the idle ones on both sides of it, so a drift of the machine
over the probe shows in neither condition alone, and the verdict is the median of the rounds:
a single generate's rate varies by several percent from run to run, more than a staging that
covers a few percent of the generate can take from it.
"""

from __future__ import annotations

import statistics
from typing import Any


def probe_figures(idle: list[float], staging: list[float], *, gen_s: list[float],
                  stage_s: list[float]) -> dict[str, Any]:
    """The probe's result from its rates (tokens/s): `idle` has one more reading than
    `staging` (idle, staging, idle, ..., staging, idle); `gen_s` and `stage_s` are each staging
    round's generate and staging seconds.

    Raises ValueError for readings that do not alternate so, or a rate that is not positive.
    """
    if not staging or len(idle) != len(staging) + 1 or len(gen_s) != len(staging) \
            or len(stage_s) != len(staging):
        raise ValueError(f"probe: {len(idle)} idle and {len(staging)} staging readings "
                         f"({len(gen_s)} generate and {len(stage_s)} staging times) do not "
                         "alternate idle, staging, ..., idle")
    if min(idle + staging) <= 0:
        raise ValueError(f"probe: a rate is not positive (idle {idle}, staging {staging})")
    ratios = [s / ((idle[i] + idle[i + 1]) / 2) for i, s in enumerate(staging)]
    return {"rounds": len(staging), "ratio": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios), "ratios": ratios,
            "tps_idle": idle, "tps_staging": staging,
            # the idle readings' own spread: how far apart two generates read with no staging
            "idle_spread": max(idle) / min(idle) - 1,
            "gen_s": gen_s, "stage_s": stage_s,
            "stage_share": statistics.median(s / g for s, g in zip(stage_s, gen_s, strict=True))}


def generation_probe(loop: Any, step: int, rounds: int) -> dict[str, Any]:
    """Run the probe on `loop`'s first engine (a started `GRPOLoop`), training `rounds` more
    steps from `step` on; every engine ends at the last version trained."""
    import ray

    if rounds < 1:
        raise ValueError(f"probe rounds must be ≥ 1, got {rounds}")
    c = loop.config
    engine = loop.engines[0]
    batch: list[Any] = []
    tokens: list[int] = []

    def tps() -> tuple[float, float]:
        # every completion to max_tokens: each reading does the same work, whichever version
        # generates it (a policy that learns to stop early would otherwise read as slower)
        b = ray.get(engine.generate.remote(batch, samples=c.samples, max_tokens=c.max_tokens,
                                           seed=c.seed, ignore_eos=True))
        tokens.append(int(b["tokens"]))
        return float(b["tokens"] / b["seconds"]), float(b["seconds"])

    idle: list[float] = []
    staging: list[float] = []
    gen_s: list[float] = []
    stage_s: list[float] = []
    for r in range(rounds):
        prompts, futures = loop.generate(step + r)
        version = ray.get(loop.trainer.step.remote(prompts, ray.get(futures)))["version"]
        if not batch:
            batch = [p for p, _ in prompts]
            idle.append(tps()[0])
        engine.weighthub_stage.remote(version)
        rate, seconds = tps()
        refit = ray.get(engine.weighthub_refit.remote(version))
        ray.get([e.weighthub_refit.remote(version) for e in loop.engines[1:]])
        staged = refit["staged"] or {}
        staging.append(rate)
        gen_s.append(seconds)
        stage_s.append(staged.get("stage_s", 0.0) + staged.get("node_wait_s", 0.0))
        idle.append(tps()[0])
    return probe_figures(idle, staging, gen_s=gen_s, stage_s=stage_s) | {"tokens": tokens}
