"""Fuzz chunk frames (format/chunk.py): real frames from encode_chunk, fields and bytes edited."""

from __future__ import annotations

import pytest
from hypothesis import given

from .strategies import chunk_frame, ci_settings
from .targets import check


@pytest.mark.slow
@ci_settings(1000)
@given(chunk_frame())
def test_chunk_frames_parse_or_refuse_within_bounds(frame: bytes) -> None:
    check("chunk", frame)


@ci_settings(150)
@given(chunk_frame(resum=False))
def test_chunk_frames_with_a_stale_trailer_are_refused(frame: bytes) -> None:
    check("chunk", frame)
