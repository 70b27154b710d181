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

On CPUs with AMX tiles (Sapphire Rapids and later), vLLM also packs every linear weight of at
most 1 MiB for its SGL kernels, whether or not oneDNN may pack (SmolLM2's o_proj, 576 x 576),
so the same switch turns that packing off too; otherwise `bind` would report `in_place: False`
for those layers and every refit would go through the loader.

Importing this module must stay light (no numba, no weighthub machinery): see
`vllm_backend.register_backend`.
"""

from __future__ import annotations

import os

from ..errors import UsageError

PLAIN_CPU_WEIGHTS = "WEIGHTHUB_VLLM_PLAIN_CPU_WEIGHTS"


def register() -> None:
    """The entry point: the backend, then the CPU weight layout if the environment asks."""
    from .vllm_backend import register_backend

    register_backend()
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
    weights (before the model loads: vLLM decides per layer when it processes it after loading,
    in `layers.utils.dispatch_cpu_unquantized_gemm`, which looks both up at that time). Only
    that dispatch is changed: vLLM's int8 scaled-mm kernels import the SGL check under their own
    name and keep it."""
    import vllm._custom_ops as ops
    from vllm.model_executor.layers import utils as layer_utils

    ops._supports_onednn = False
    layer_utils.check_cpu_sgl_kernel = _no_sgl_packing


def _no_sgl_packing(n: int, k: int, dtype: object) -> bool:
    """Stands in for vLLM's `check_cpu_sgl_kernel` (AMX CPUs: pack weights of ≤ 1 MiB): never."""
    return False
