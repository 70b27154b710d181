"""Fuzz the chunk-server protocol (net/wire.py): signed request frames and response frames,
their prefix, JSON header or bytes edited, read as the server reads them (targets.wire_request)."""

from __future__ import annotations

import pytest
from hypothesis import given

from .strategies import ci_settings, request_frame, response_frame
from .targets import check


@pytest.mark.slow
@ci_settings(600)
@given(request_frame())
def test_request_frames_parse_or_refuse_within_bounds(frame: bytes) -> None:
    check("wire_request", frame)


@ci_settings(100)
@given(response_frame())
def test_response_frames_parse_or_refuse_within_bounds(frame: bytes) -> None:
    check("wire_response", frame)
