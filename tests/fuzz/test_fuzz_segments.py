"""Fuzz every segment coding (codec/apply.py) through chunk frames: xor/add/overwrite/dense with
gaps, groups and bitmap positions and varint, zigzag and raw values, in every dtype; streams,
counts, ranges and coding ids edited. Refusals must leave the destination restorable bit for
bit by the undo log (targets.segments)."""

from __future__ import annotations

import pytest
from hypothesis import given

from .strategies import ci_settings, segments_input
from .targets import check


@pytest.mark.slow
@ci_settings(1000)
@given(segments_input())
def test_segments_apply_or_refuse_and_roll_back_exactly(data: bytes) -> None:
    check("segments", data)
