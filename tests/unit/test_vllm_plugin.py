"""WEIGHTHUB_VLLM_PLAIN_CPU_WEIGHTS: parsed strictly, since a typo would silently keep packing."""

from __future__ import annotations

import pytest

from weighthub.engines.vllm_plugin import PLAIN_CPU_WEIGHTS, plain_cpu_weights_asked
from weighthub.errors import UsageError


@pytest.mark.parametrize(("value", "asked"), [(None, False), ("", False), ("0", False), ("1", True)])
def test_plain_cpu_weights_values(monkeypatch: pytest.MonkeyPatch, value: str | None,
                                  asked: bool) -> None:
    if value is None:
        monkeypatch.delenv(PLAIN_CPU_WEIGHTS, raising=False)
    else:
        monkeypatch.setenv(PLAIN_CPU_WEIGHTS, value)
    assert plain_cpu_weights_asked() is asked


@pytest.mark.parametrize("value", ["true", "yes", " 1", "2"])
def test_plain_cpu_weights_refuses_other_values(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(PLAIN_CPU_WEIGHTS, value)
    with pytest.raises(UsageError, match=f"{PLAIN_CPU_WEIGHTS}=.*set it to 1"):
        plain_cpu_weights_asked()


def test_importing_the_plugin_loads_no_numba() -> None:
    """vLLM's CPU worker breaks on llvmlite's globals at start-up: the plugin must stay light."""
    import subprocess
    import sys

    code = ("import sys, weighthub.engines.vllm_plugin; "
            "print('numba' in sys.modules or 'llvmlite' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_plugin_leaves_vllms_packing_alone_unless_plain_weights_are_asked() -> None:
    """The entry point (`register`, run in every vLLM process) changes neither of vLLM CPU's
    linear-weight packings by itself; with the switch at 1 it turns off both, oneDNN's and on
    CPUs with AMX the SGL kernels' (weights of at most 1 MiB, packed whatever oneDNN may do),
    while vLLM's int8 scaled-mm kernels keep their own SGL check. Run in child processes: the
    switch changes vLLM's modules for the life of the process."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("vllm") is None:
        why = "vLLM is not installed: pip install 'weighthub[vllm]' (see the README)"
        if os.environ.get("CI"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    code = """
import vllm._custom_ops as ops
from vllm.model_executor.layers import utils
from vllm.model_executor.kernels.linear.scaled_mm import cpu as scaled_mm
from weighthub.engines.vllm_plugin import register
original, onednn = utils.check_cpu_sgl_kernel, ops._supports_onednn
register()
print(ops._supports_onednn is onednn, utils.check_cpu_sgl_kernel is original,
      scaled_mm.check_cpu_sgl_kernel is original, onednn)
"""
    for plain in ("", "1"):
        env = {**os.environ, PLAIN_CPU_WEIGHTS: plain}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        onednn_kept, sgl_kept, int8_kept, had_onednn = out.stdout.split()[-4:]
        assert (sgl_kept, int8_kept) == ("False" if plain else "True", "True"), (plain, out.stdout)
        # a vLLM build without oneDNN has nothing for the switch to turn off
        assert onednn_kept == ("False" if plain and had_onednn == "True" else "True"), plain
