"""The commit vote on a real tensor-parallel vLLM engine (CPU build, TP 2, two worker processes).

Both ranks of one engine commit a version together or neither does (`engines.vote`): a failure
injected into one rank's push leaves both at the previous version bit-exactly and serving; a
vote whose decision never comes (the driver, or another rank, died mid-vote) is aborted by each
rank on its own within the timeout.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_vllm import _vllm_env, outputs  # noqa: F401 (a fixture, used by name)
from vllm_model import random_state, rl_step, save_checkpoint

from weighthub import catalog
from weighthub.engines.vllm import EXTENSION, bind, refit
from weighthub.errors import ApplyError
from weighthub.publish import Publisher
from weighthub.store import LocalStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _fail_after_push_on_rank_1(worker: Any) -> None:
    """Rank 1's next push goes through into its engine shard, then fails (once)."""
    if worker.rank != 1:
        return
    placement = worker._weighthub[1].placement
    real = placement.push

    def push(*args: Any, **kwargs: Any) -> Any:
        placement.push = real
        real(*args, **kwargs)
        raise RuntimeError("injected failure after rank 1's push")

    placement.push = push


def _assert_ranks_at(llm: Any, store: LocalStore, version: int) -> None:
    manifest = {e.name: e.digest for e in catalog.primary_manifest(store, version).tensors}
    root = catalog.primary_manifest(store, version).root
    held = llm.collective_rpc("weighthub_held")
    assert [(h["version"], h["root"]) for h in held] == [(version, root)] * 2
    for got in llm.collective_rpc("weighthub_digests"):  # each rank's engine shard and mirror
        assert got["engine"] | got["mirror"] == manifest


def test_tp2_ranks_commit_together_or_not_at_all(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import cloudpickle
    from vllm import LLM

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    # one core per rank: vLLM binds each CPU worker to a NUMA node, and this machine has one
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    states = [random_state(1)]
    states += [rl_step(states[-1], s, fraction=0.02) for s in (1, 2)]
    store = LocalStore(tmp_path / "store")
    pub = Publisher(store)
    for state in states:
        pub.publish(state)
    shm_before = _tp_shared_memory()
    llm = LLM(str(save_checkpoint(states[0], tmp_path / "ckpt-v0")), skip_tokenizer_init=True,
              enforce_eager=True, max_model_len=320, dtype="bfloat16", max_num_seqs=4, seed=0,
              tensor_parallel_size=2, distributed_executor_backend="mp",
              worker_extension_cls=EXTENSION)
    try:
        bind(llm, store.url, 0)
        before = outputs(llm)
        # one rank fails after pushing into its shard: both ranks stay at v0, and serve it
        llm.collective_rpc(_fail_after_push_on_rank_1)
        with pytest.raises(ApplyError, match=r"rank 1 of 2: .*injected failure"):
            refit(llm, 1)
        _assert_ranks_at(llm, store, 0)
        assert outputs(llm) == before
        refit(llm, 1)
        _assert_ranks_at(llm, store, 1)
        at_v1 = outputs(llm)
        assert at_v1 != before
        # every rank prepared v2, then no decision comes: each aborts by itself in the timeout
        t0 = time.monotonic()
        votes = llm.collective_rpc("weighthub_prepare", args=(2, None, 2.0))
        assert [v["state"] for v in votes] == ["prepared", "prepared"]
        time.sleep(3.0)
        late = llm.collective_rpc("weighthub_decide", args=(True,))  # too late: aborted
        assert all("no commit decision within 2 s" in r["message"] for r in late), late
        assert time.monotonic() - t0 < 30
        _assert_ranks_at(llm, store, 1)
        assert outputs(llm) == at_v1
        refit(llm, 2)
        _assert_ranks_at(llm, store, 2)
    finally:
        llm.llm_engine.engine_core.shutdown()
        for leftover in _tp_shared_memory() - shm_before:  # the ranks' shared memory, which
            leftover.unlink(missing_ok=True)  # vLLM removes only when its workers exit cleanly


def _tp_shared_memory() -> set[Path]:
    """The shared-memory files of vLLM CPU tensor-parallel groups (`vllm_dist_<id>-…-cpushm*`)."""
    shm = Path("/dev/shm")
    return set(shm.glob("vllm_dist_*-cpushm*")) if shm.is_dir() else set()
