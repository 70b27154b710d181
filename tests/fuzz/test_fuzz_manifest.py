"""Fuzz manifests (format/manifest.py): valid manifests with their JSON tree or bytes edited
(types, huge numbers, deep nesting, missing and unknown keys)."""

from __future__ import annotations

import pytest
from hypothesis import given

from .strategies import ci_settings, manifest_bytes
from .targets import check


@pytest.mark.slow
@ci_settings(800)
@given(manifest_bytes())
def test_manifests_parse_or_refuse_within_bounds(raw: bytes) -> None:
    check("manifest", raw)
