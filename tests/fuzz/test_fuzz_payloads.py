"""Fuzz the other parsers of outside bytes: LoGRA compact payloads (train/compact.py) and
safetensors headers (targets/safetensors_header.py)."""

from __future__ import annotations

import pytest
from hypothesis import given

from .strategies import ci_settings, logra_frame, safetensors_file
from .targets import check


@ci_settings(300)
@given(logra_frame())
def test_logra_payloads_parse_or_refuse_within_bounds(frame: bytes) -> None:
    check("logra", frame)


@pytest.mark.slow
@ci_settings(300)
@given(safetensors_file())
def test_safetensors_headers_parse_or_refuse_within_bounds(data: bytes) -> None:
    check("safetensors_header", data)
