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
