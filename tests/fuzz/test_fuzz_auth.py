"""Fuzz auth tokens (net/auth.py): real tokens with a field, a separator or their bytes edited,
for methods and paths decoded from arbitrary bytes as an HTTP server decodes them."""

from __future__ import annotations

from hypothesis import given

from .strategies import auth_input, ci_settings
from .targets import check


@ci_settings(400)
@given(auth_input())
def test_auth_tokens_verify_or_refuse(data: bytes) -> None:
    check("auth_token", data)
