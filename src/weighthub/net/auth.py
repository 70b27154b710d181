"""Shared-secret request authentication for the hub and the chunk servers.

Every request carries a token: `WH1 <timestamp> <nonce> <signature>` (ASCII: a decimal timestamp
of at most 20 digits, a lowercase hex nonce of at most 64 digits and 64 lowercase hex digits of
signature; anything else is refused as malformed before any parsing), where the signature is
HMAC-SHA256(secret, "WH1\\n{method}\\n{path}\\n{timestamp}\\n{nonce}\\n{body_digest}"). The server
recomputes it and compares in constant time, refuses timestamps outside a skew window (an old
captured token is useless), and, given a `ReplayGuard`, refuses a nonce it has already seen inside
that window (a captured token cannot be replayed while still fresh).

`body_digest` binds the request's content. Callers choose what it is, stably on both sides: a
hash of a small body, or, for a streamed chunk push, a description such as "key:size:checksum"
(the receiving node verifies the body against that checksum before staging it, so the signature
still covers every bit without buffering the body to hash it first). Empty for no content.

The secret comes from a file or the WEIGHTHUB_SECRET environment variable (`load_secret`).
Transports put the token where they like: HTTP in the `AUTH_HEADER` header, framed TCP in the
request frame. This module is transport-free and its API is stable (the hub imports it).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat
import threading
import time
from collections import OrderedDict

from ..errors import AuthError, UsageError

AUTH_HEADER = "X-Weighthub-Auth"
SECRET_ENV = "WEIGHTHUB_SECRET"
MIN_SECRET_BYTES = 16
DEFAULT_SKEW_S = 60.0
_SCHEME = "WH1"
_MAX_TOKEN = 256  # refuse oversized tokens before parsing them
_MAX_SECRET_FILE = 64 << 10
# A token as `sign` writes it: the scheme, a decimal timestamp, hex nonce and hex signature;
# anything else (non-ASCII digits, "--5", surrogates from undecodable header bytes) is malformed.
_TOKEN_RE = re.compile(r"WH1 (-?[0-9]{1,20}) ([0-9a-f]{1,64}) ([0-9a-f]{64})")


def load_secret(path: str | os.PathLike[str] | None = None) -> bytes:
    """The shared secret: the file at `path` (surrounding whitespace stripped), else $WEIGHTHUB_SECRET.

    Raises:
        UsageError: no secret configured, the file is unreadable, or the secret is shorter than
            MIN_SECRET_BYTES (a short secret is guessable; generate one with `openssl rand -hex 32`).
    """
    if path is not None:
        secret = _read_secret_file(path).strip()
        where = f"secret file {path}"
    else:
        env = os.environ.get(SECRET_ENV)
        if env is None:
            raise UsageError(f"no weighthub secret: set {SECRET_ENV} or pass a secret file "
                             "(the same on the hub and every node; e.g. `openssl rand -hex 32`)")
        secret = os.fsencode(env).strip()  # the variable's bytes, whatever their encoding
        where = f"${SECRET_ENV}"
    if len(secret) < MIN_SECRET_BYTES:
        raise UsageError(f"the weighthub secret in {where} has {len(secret)} bytes; use at least "
                         f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)")
    return secret


def _read_secret_file(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a regular file of at most _MAX_SECRET_FILE bytes, without blocking.

    O_NONBLOCK: opening a FIFO for reading would wait for a writer forever; a device or a
    directory is refused by its type, an endless or huge file by the size read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise UsageError(f"cannot read the weighthub secret file {path}: {why}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"the weighthub secret file {path} is not a regular file; "
                             "point --secret-file at a file holding the secret")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(_MAX_SECRET_FILE + 1)
    except OSError as exc:
        raise UsageError(f"cannot read the weighthub secret file {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)
    if len(data) > _MAX_SECRET_FILE:
        raise UsageError(f"the weighthub secret file {path} is over {_MAX_SECRET_FILE} bytes: "
                         "not a secret (e.g. `openssl rand -hex 32` writes 65)")
    return data


def body_digest(data: bytes | memoryview) -> str:
    """SHA-256 hex of a (small) request body, for `sign`/`verify`'s body_digest."""
    return hashlib.sha256(data).hexdigest()


def _mac(secret: bytes, method: str, path: str, ts: int, nonce: str, digest: str) -> str:
    # surrogatepass: a path taken from undecodable request bytes still signs (and fails) cleanly
    msg = f"{_SCHEME}\n{method}\n{path}\n{ts}\n{nonce}\n{digest}".encode(errors="surrogatepass")
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def sign(secret: bytes, method: str, path: str, body_digest: str = "", *,
         now: float | None = None) -> str:
    """A token for one request (fresh nonce each call).

    Args:
        secret: from `load_secret`.
        method: HTTP method or frame op name (e.g. "GET", "push").
        path: HTTP path or the object addressed (e.g. "/versions", "v3/c0001.whc").
        body_digest: what binds the content (see module docstring); "" for none.
        now: the clock (seconds since the epoch); tests pass it to make stale tokens.
    """
    ts = int(time.time() if now is None else now)
    nonce = secrets.token_hex(12)
    return f"{_SCHEME} {ts} {nonce} {_mac(secret, method, path, ts, nonce, body_digest)}"


class ReplayGuard:
    """Nonces seen within the skew window; a server keeps one to refuse replayed tokens.

    Bounded: entries older than the window are dropped, and past `max_entries` the oldest go
    (a token whose nonce was dropped early is still refused once its timestamp is stale).
    Thread-safe.
    """

    def __init__(self, window_s: float = DEFAULT_SKEW_S, max_entries: int = 100_000):
        self._window = window_s
        self._max = max_entries
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def check_and_add(self, nonce: str, now: float) -> bool:
        """True if `nonce` is new (and remember it); False if it was seen within the window."""
        with self._lock:
            while self._seen:
                oldest, t = next(iter(self._seen.items()))
                if now - t <= 2 * self._window and len(self._seen) < self._max:
                    break
                del self._seen[oldest]
            if nonce in self._seen:
                return False
            self._seen[nonce] = now
            return True


def verify(secret: bytes, token: str | None, method: str, path: str, body_digest: str = "", *,
           skew_s: float = DEFAULT_SKEW_S, replay: ReplayGuard | None = None,
           now: float | None = None) -> None:
    """Check a request's token; return None if valid.

    Raises:
        AuthError: missing, malformed, expired (timestamp outside ±skew_s), wrongly signed, or
            replayed (nonce already seen by `replay`). The message says which, never the secret.
    """
    if not token:
        raise AuthError(f"{method} {path}: no auth token (set {SECRET_ENV} or a secret file on the client)")
    if len(token) > _MAX_TOKEN:
        raise AuthError(f"{method} {path}: auth token too long ({len(token)} chars)")
    match = _TOKEN_RE.fullmatch(token)
    if match is None:
        raise AuthError(f"{method} {path}: malformed auth token (expected '{_SCHEME} <ts> "
                        "<hex nonce> <hex signature>')")
    ts_text, nonce, sig = match.groups()
    ts = int(ts_text)
    t = time.time() if now is None else now
    expected = _mac(secret, method, path, ts, nonce, body_digest)
    # Compare the signature before the clock so a wrong secret is reported as such.
    if not hmac.compare_digest(expected.encode(), sig.encode()):
        raise AuthError(f"{method} {path}: bad signature (client and server secrets differ, "
                        "or the request was altered)")
    if abs(t - ts) > skew_s:
        raise AuthError(f"{method} {path}: token expired or from the future (timestamp {ts}, "
                        f"now {int(t)}, allowed skew {skew_s:g}s); check clocks")
    if replay is not None and not replay.check_and_add(nonce, t):
        raise AuthError(f"{method} {path}: replayed token (nonce {nonce} already used)")
