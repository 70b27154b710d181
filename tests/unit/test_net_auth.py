"""Shared-secret request tokens: valid ones pass; tampered, foreign, stale, replayed ones do not."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from weighthub.errors import AuthError, UsageError
from weighthub.net import auth

SECRET = b"0123456789abcdef0123456789abcdef"


def test_a_signed_request_verifies() -> None:
    token = auth.sign(SECRET, "GET", "/versions", "d1")
    auth.verify(SECRET, token, "GET", "/versions", "d1")
    assert auth.sign(SECRET, "GET", "/versions", "d1") != token  # a fresh nonce every time


@pytest.mark.parametrize("method,path,digest", [("PUT", "/versions", "d1"), ("GET", "/holders", "d1"),
                                                ("GET", "/versions", "d2")])
def test_a_token_is_bound_to_its_request(method: str, path: str, digest: str) -> None:
    token = auth.sign(SECRET, "GET", "/versions", "d1")
    with pytest.raises(AuthError, match="bad signature"):
        auth.verify(SECRET, token, method, path, digest)


def test_a_wrong_secret_is_refused() -> None:
    token = auth.sign(b"another secret, also 32 bytes!!!", "GET", "/x")
    with pytest.raises(AuthError, match="bad signature"):
        auth.verify(SECRET, token, "GET", "/x")


@pytest.mark.parametrize("age", [-61.0, 61.0, 3600.0])
def test_stale_or_future_tokens_are_refused(age: float) -> None:
    token = auth.sign(SECRET, "GET", "/x", now=time.time() - age)
    with pytest.raises(AuthError, match="expired"):
        auth.verify(SECRET, token, "GET", "/x", skew_s=60)


def test_tokens_inside_the_skew_window_pass() -> None:
    auth.verify(SECRET, auth.sign(SECRET, "GET", "/x", now=time.time() - 50), "GET", "/x", skew_s=60)


def test_a_replayed_token_is_refused() -> None:
    guard = auth.ReplayGuard()
    token = auth.sign(SECRET, "GET", "/x")
    auth.verify(SECRET, token, "GET", "/x", replay=guard)
    with pytest.raises(AuthError, match="replayed"):
        auth.verify(SECRET, token, "GET", "/x", replay=guard)
    auth.verify(SECRET, auth.sign(SECRET, "GET", "/x"), "GET", "/x", replay=guard)


def test_the_replay_guard_is_bounded() -> None:
    guard = auth.ReplayGuard(window_s=60, max_entries=3)
    now = time.time()
    for i in range(10):
        assert guard.check_and_add(f"n{i}", now)
    assert len(guard._seen) <= 3


@pytest.mark.parametrize("token", [None, "", "WH1 1 2", "WH2 1 n s", "WH1 x n s", "WH1 1 n s " + "x" * 300])
def test_malformed_tokens_are_refused(token: str | None) -> None:
    with pytest.raises(AuthError):
        auth.verify(SECRET, token, "GET", "/x")


def test_load_secret_from_file_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "secret"
    f.write_bytes(SECRET + b"\n")
    assert auth.load_secret(f) == SECRET
    monkeypatch.setenv(auth.SECRET_ENV, SECRET.decode())
    assert auth.load_secret() == SECRET


def test_load_secret_refuses_missing_short_or_unreadable(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    with pytest.raises(UsageError, match=auth.SECRET_ENV):
        auth.load_secret()
    monkeypatch.setenv(auth.SECRET_ENV, "short")
    with pytest.raises(UsageError, match="at least 16"):
        auth.load_secret()
    with pytest.raises(UsageError, match="cannot read"):
        auth.load_secret(tmp_path / "absent")
