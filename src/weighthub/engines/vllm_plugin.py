"""weighthub's vLLM plugin: the `vllm.general_plugins` entry point, run in every vLLM process
(driver, engine core, workers) before the model loads.

It registers the "weighthub" weight-transfer backend (`engines.vllm_backend`), and on request
keeps vLLM CPU's linear weights plain:

    WEIGHTHUB_VLLM_PLAIN_CPU_WEIGHTS=1   vLLM CPU serves linear layers from their weights as
                                         loaded (torch's linear, vLLM's own fallback) instead of
                                         oneDNN handles packed from them. The engine then holds
                                         every canonical tensor as plain bits, so a refit
                                         applies the delta in place, with no host mirror and
                                         no reload through the loader (`engines.vllm`); the
                                         price is vLLM's slower CPU GEMM (measure both).
                                         GPU builds keep unquantized weights plain anyway.

On CPUs with AMX tiles (Sapphire Rapids and later) vLLM also packs every linear weight of at
most 1 MiB for its SGL kernels (SmolLM2's o_proj, 576 x 576), and its layerwise
`reload_weights` mis-serves such a layer reloaded on its own: measured with vLLM 0.32 on SmolLM2,
layer 0's o_proj reloaded alone with its own unchanged values changed the engine's greedy tokens
and log-probabilities, where a full reload did not, nor down_proj (oneDNN's packing) reloaded
alone. weighthub's loader refits reload only the changed groups, so the plugin turns that
packing off in every vLLM process, asked or not (`no_sgl_packing`): those layers then use
oneDNN, or with plain CPU weights torch's linear, as on CPUs without AMX.

Importing this module must stay light (no numba, no weighthub machinery): see
`vllm_backend.register_backend`.
"""

from __future__ import annotations

import os

from ..errors import UsageError

PLAIN_CPU_WEIGHTS = "WEIGHTHUB_VLLM_PLAIN_CPU_WEIGHTS"


def register() -> None:
    """The entry point: the backend, no SGL packing, then plain CPU weights if the environment
    asks."""
    from .vllm_backend import register_backend

    register_backend()
    no_sgl_packing()
    if plain_cpu_weights_asked():
        keep_cpu_weights_plain()


def plain_cpu_weights_asked() -> bool:
    """Whether WEIGHTHUB_VLLM_PLAIN_CPU_WEIGHTS asks for plain CPU weights ("1"; "0" or unset: no).

    Raises:
        UsageError: any other value (a typo would otherwise silently keep oneDNN packing).
    """
    value = os.environ.get(PLAIN_CPU_WEIGHTS, "")
    if value not in ("", "0", "1"):
        raise UsageError(f"{PLAIN_CPU_WEIGHTS}={value!r}: set it to 1 (plain CPU weights, "
                         "refits in place) or 0 / unset (vLLM's oneDNN packing)")
    return value == "1"


def keep_cpu_weights_plain() -> None:
    """Make this process's vLLM CPU build skip oneDNN's and the SGL kernels' packing of linear
    weights (before the model loads: vLLM decides per layer when it processes it after
    loading, in `layers.utils.dispatch_cpu_unquantized_gemm`, which looks both up then)."""
    import vllm._custom_ops as ops

    ops._supports_onednn = False
    no_sgl_packing()


def no_sgl_packing() -> None:
    """Make this process's vLLM CPU build skip the SGL kernels' packing of linear weights (AMX
    CPUs only; see the module docstring). Only the unquantized GEMM dispatch is changed: vLLM's
    int8 scaled-mm kernels import the SGL check under their own name and keep it."""
    from vllm.model_executor.layers import utils as layer_utils

    layer_utils.check_cpu_sgl_kernel = _no_sgl_packing


def _no_sgl_packing(n: int, k: int, dtype: object) -> bool:
    """Stands in for vLLM's `check_cpu_sgl_kernel` (AMX CPUs: pack weights of ≤ 1 MiB): never."""
    return False
