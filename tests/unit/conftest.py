"""Unit-test settings: the hypothesis profile (bit-pattern generators live in tests/bit_patterns.py)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

# modest example counts: the whole unit suite stays well under two minutes
settings.register_profile(
    "unit", max_examples=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("unit")
