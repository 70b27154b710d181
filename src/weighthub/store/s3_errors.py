"""The S3 store's seam to the error tree: every botocore/urllib3 failure is mapped here, once.

    no answer in time, connection refused/reset/dropped, truncated body   → StoreTimeout
    an answer that says no: 4xx, bad credentials, missing bucket          → StoreRefused
    5xx and throttling (retried first; what is left after the retries)    → StoreRefused
    404 on a key                                                          → ObjectNotFound
    412 on a create-only put                                              → ObjectExists

Transient failures (the first row, 5xx and throttling) come back wrapped in `Retryable`, so the
caller retries them and raises the wrapped error only when the retries are spent.

A ranged GET's answer is read here too (`ranged_body`): never more bytes than asked for, however
large a body the server sends, and a server that ignores Range is refused, not spliced.
"""

from __future__ import annotations

from typing import Any, Protocol

from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from ..errors import ObjectExists, ObjectNotFound, StoreError, StoreRefused, StoreTimeout, UsageError

_THROTTLE = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
             "TooManyRequests", "RequestTimeout", "RequestTimeTooSkewed", "ServiceUnavailable",
             "InternalError", "ConditionalRequestConflict"}
_AUTH = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken",
         "ExpiredToken", "TokenRefreshRequired", "AuthorizationHeaderMalformed", "403"}


class Retryable:
    """One attempt failed transiently; `error` is what to raise if it was the last one."""

    def __init__(self, error: StoreError) -> None:
        self.error = error


class _Where(Protocol):
    url: str
    bucket: str
    endpoint: str
    timeouts: tuple[float, float]


def map_error(store: _Where, op: str, key: str, exc: Exception,
              create_only: bool) -> StoreError | Retryable | None:
    """The weighthub error for a backend exception; None to let it pass unchanged (ours)."""
    where = f"{key!r} in {store.url} (endpoint {store.endpoint})"
    if isinstance(exc, StoreError | UsageError):
        return None
    if isinstance(exc, NoCredentialsError):
        return StoreRefused(f"{op} {where}: no S3 credentials found; set "
                            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        message = err.get("Message", "") or code
        if code in ("NoSuchKey", "404") and status == 404:
            return ObjectNotFound(f"{key!r} is not in store {store.url}")
        if code == "NoSuchBucket":
            return StoreRefused(f"{op} {where}: bucket {store.bucket!r} does not exist at "
                                f"{store.endpoint}; create it (e.g. `aws s3 mb "
                                f"s3://{store.bucket}`) or fix the store URL")
        if create_only and (code in ("PreconditionFailed", "412") or status == 412):
            return ObjectExists(f"{key!r} already exists in store {store.url}")
        if code in _AUTH or status in (401, 403):
            return StoreRefused(f"{op} {where}: the S3 server at {store.endpoint} refused "
                                f"the credentials ({code}: {message}); check "
                                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and that they "
                                f"may access bucket {store.bucket!r}")
        if status >= 500 or status == 429 or code in _THROTTLE:
            return Retryable(StoreRefused(f"{op} {where}: server error {status} "
                                          f"{code}: {message}"))
        return StoreRefused(f"{op} {where}: S3 refused the request ({status} {code}: "
                            f"{message})")
    if isinstance(exc, BotoCoreError | OSError) or is_urllib3(exc):
        connect, read = store.timeouts
        return Retryable(StoreTimeout(
            f"{op} {where}: the S3 endpoint {store.endpoint} did not answer in time or "
            f"dropped the connection ({type(exc).__name__}: {exc}); check that it is up "
            f"and reachable (timeouts: connect {connect:g}s, read {read:g}s)"))
    return None  # not a backend failure (a bug of ours): let it surface as is


def is_urllib3(exc: Exception) -> bool:
    return type(exc).__module__.startswith(("urllib3", "http.client"))


def ranged_body(resp: Any, start: int, length: int, where: str) -> tuple[bytes, int]:
    """(at most `length` bytes of a ranged GET's body, the object's total size)."""
    with resp["Body"] as body:
        data = body.read(length)
    rng = resp.get("ContentRange")
    if rng is None and start > 0:  # the body is the object's head again, not this range
        raise StoreRefused(f"{where}: the server ignored the Range header of a ranged GET; use "
                           "an S3 server that honours ranged GETs")
    # "bytes 0-8388607/33554432"; without one (Range ignored) the body was the whole object
    tail = rng.rsplit("/", 1)[1] if rng and "/" in rng else ""
    return data, int(tail) if tail.isascii() and tail.isdigit() else int(resp.get("ContentLength", len(data)))
