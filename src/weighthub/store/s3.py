"""S3 object store (`s3://bucket/prefix`) over botocore: any S3-compatible server (AWS, SeaweedFS, …).

Same semantics as the local store: keys are '/'-separated under the store's prefix; a plain PUT
is atomic for readers; `create_only` is a conditional PUT with `If-None-Match: *` (HTTP 412 →
ObjectExists), the commit primitive. Large objects move as parallel parts: multipart uploads
above `multipart_threshold`, and a GET reads its first `part_size` bytes in one ranged request
whose Content-Range gives the total, then the rest as parallel ranged GETs pinned to the first
response's ETag (If-Match), so an object replaced mid-read is re-read, never spliced.

Configuration follows the AWS conventions: credentials from AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY (or any botocore credential source), region from AWS_REGION /
AWS_DEFAULT_REGION (default us-east-1), endpoint from the `endpoint_url` argument or
AWS_ENDPOINT_URL (path-style addressing is used whenever an endpoint is given).

Failure policy, applied in one place (`_call`), for every request:
- each attempt has a connect timeout and a read timeout (per socket read, also while streaming
  a body), so a server that accepts and then says nothing ends in StoreUnavailable, not a hang
  (an upload first waits up to 1 s, botocore's fixed wait, for `100 Continue`);
- transient failures (5xx, throttling, connection refused/reset, timeouts, truncated bodies) are
  retried with jittered exponential backoff, at most `attempts` times in all; 4xx never are;
- every botocore/urllib3 exception is mapped to the weighthub error tree here, with the
  endpoint, bucket and what to do in the message. Worst case for one request against a
  silent server: attempts × (connect_timeout + 1 s + read_timeout) + backoff (< attempts ×
  max_backoff). A server that trickles bytes just faster than the read timeout is not bounded
  by this (no total deadline per body).
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import botocore.session
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from ..errors import ObjectExists, ObjectNotFound, StoreError, StoreUnavailable, UsageError
from .base import check_key

T = TypeVar("T")

MiB = 1 << 20
_THROTTLE = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
             "TooManyRequests", "RequestTimeout", "RequestTimeTooSkewed", "ServiceUnavailable",
             "InternalError", "ConditionalRequestConflict"}
_AUTH = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken",
         "ExpiredToken", "TokenRefreshRequired", "AuthorizationHeaderMalformed", "403"}
_BUCKET_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789.-")


class _Retryable:
    """Internal: one attempt failed transiently; the error to raise if it was the last one."""

    def __init__(self, error: StoreError) -> None:
        self.error = error


def parse_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix` → ("bucket", "some/prefix"). Raises UsageError."""
    if not url.startswith("s3://"):
        raise UsageError(f"store {url!r} is not an s3:// URL")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    prefix = prefix.strip("/")
    if not (3 <= len(bucket) <= 63) or not set(bucket) <= _BUCKET_NAME_CHARS \
            or not bucket[0].isalnum() or not bucket[-1].isalnum():
        raise UsageError(f"store {url!r}: {bucket!r} is not a valid S3 bucket name (3-63 of "
                         "a-z 0-9 . -, starting and ending with a letter or digit); use "
                         "s3://BUCKET/PREFIX")
    if prefix:
        check_key(prefix)
    return bucket, prefix


class S3Store:
    """A store in an S3 bucket, under an optional key prefix. Thread-safe.

    Args:
        bucket: the bucket; it must exist (the store never creates buckets).
        prefix: key prefix inside the bucket ('' for the bucket root).
        endpoint_url: e.g. http://127.0.0.1:8333; default AWS_ENDPOINT_URL, else AWS.
        region: default AWS_REGION / AWS_DEFAULT_REGION, else us-east-1.
        access_key_id, secret_access_key: default the environment / botocore's credential chain.
        connect_timeout, read_timeout: seconds per attempt (read: per socket read).
        attempts: tries per request, including the first (transient failures only).
        part_size: bytes per multipart-upload part and per ranged GET.
        multipart_threshold: objects at least this big are uploaded in parallel parts.
        parallel: parts in flight per object (uploads and ranged GETs).
    """

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 region: str | None = None, access_key_id: str | None = None,
                 secret_access_key: str | None = None, connect_timeout: float = 5.0,
                 read_timeout: float = 30.0, attempts: int = 4, max_backoff: float = 2.0,
                 part_size: int = 8 * MiB, multipart_threshold: int = 16 * MiB,
                 parallel: int = 4) -> None:
        if attempts < 1 or parallel < 1 or connect_timeout <= 0 or read_timeout <= 0:
            raise UsageError("S3Store: attempts and parallel must be >= 1, timeouts > 0")
        if part_size < 5 * MiB or multipart_threshold < part_size:
            raise UsageError("S3Store: part_size must be >= 5 MiB (the S3 minimum part) and "
                             "multipart_threshold >= part_size")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.attempts = attempts
        self.max_backoff = max_backoff
        self.part_size = part_size
        self.multipart_threshold = multipart_threshold
        self.parallel = parallel
        self.timeouts = (connect_timeout, read_timeout)
        endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") \
            or os.environ.get("AWS_ENDPOINT_URL") or None
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") \
            or "us-east-1"
        config = Config(
            connect_timeout=connect_timeout, read_timeout=read_timeout,
            retries={"total_max_attempts": 1, "mode": "standard"},  # retries are ours: see _call
            max_pool_connections=max(16, 4 * parallel),
            # integrity is end to end (the manifest's xxh3 of every chunk): skip the CRC pass
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": "path"} if endpoint_url else None,
        )
        try:
            with _SESSION_LOCK:  # a botocore session is not thread-safe; its clients are
                self._client = _session().create_client(
                    "s3", endpoint_url=endpoint_url, region_name=region,
                    aws_access_key_id=access_key_id, aws_secret_access_key=secret_access_key,
                    config=config)
        except (BotoCoreError, ValueError) as exc:
            raise UsageError(f"store {self.url}: cannot set up an S3 client for endpoint "
                             f"{endpoint_url or 'AWS'}: {exc}") from exc
        self.endpoint = self._client.meta.endpoint_url
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> S3Store:
        """A store from `s3://bucket/prefix`; kwargs as for the constructor."""
        bucket, prefix = parse_s3_url(url)
        return cls(bucket, prefix, **kwargs)

    def close(self) -> None:
        """Release the part-transfer threads (the store stays usable; they restart on demand)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint={self.endpoint!r})"

    # -- Store protocol --------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        name = self._name(key)
        first = self._call("get", key, lambda: self._get_part(name, 0, self.part_size, None))
        if first is None:  # 416 on the first range: the object exists and is empty
            return b""
        head, total, etag = first
        if total <= len(head):
            return head
        starts = range(len(head), total, self.part_size)

        def part(start: int) -> bytes:
            got = self._call("get", key, lambda: self._get_part(name, start, self.part_size, etag))
            if got is None or len(got[0]) != min(self.part_size, total - start):
                raise StoreUnavailable(f"{self._where(key)}: short read at offset {start}")
            return got[0]

        try:
            parts = list(self._executor().map(part, starts))
        except _Changed:
            return self.get(key)  # replaced while we read it: read the new object afresh
        return b"".join([head, *parts])

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        name = self._name(key)
        if start < 0 or stop < 0:
            raise UsageError(f"get_range({key!r}, {start}, {stop}): offsets must be >= 0")
        if stop <= start:
            self.size(key)  # an empty range still says whether the object exists
            return b""
        got = self._call("get_range", key, lambda: self._get_part(name, start, stop - start, None))
        return b"" if got is None else got[0]

    def size(self, key: str) -> int:
        # a 1-byte ranged GET, not HEAD: HEAD errors carry no code, so a missing bucket or bad
        # credentials would look like a missing key
        name = self._name(key)
        got = self._call("size", key, lambda: self._get_part(name, 0, 1, None))
        return 0 if got is None else got[1]

    def put(self, key: str, data: bytes | memoryview, *, create_only: bool = False) -> None:
        name = self._name(key)
        view = memoryview(data).cast("B")
        if create_only or len(view) < self.multipart_threshold:
            extra = {"IfNoneMatch": "*"} if create_only else {}
            body = bytes(view)
            self._call("put", key, lambda: self._client.put_object(
                Bucket=self.bucket, Key=name, Body=body, **extra), create_only=create_only)
            return
        self._put_multipart(key, name, view)

    def delete(self, key: str) -> None:
        name = self._name(key)
        self._call("delete", key, lambda: self._client.delete_object(Bucket=self.bucket, Key=name))
        # Servers with a directory tree (SeaweedFS) keep emptied "folders" and list them as
        # prefixes. Deleting "dir/" removes a folder only when it is empty (S3 proper: a no-op,
        # our keys never end in '/'), so deleted versions leave nothing behind.
        parts = key.split("/")[:-1]
        while parts:
            folder = self._name("/".join(parts)) + "/"
            self._call("delete", key, partial(self._client.delete_object, Bucket=self.bucket,
                                              Key=folder))
            parts.pop()

    def children(self, prefix: str) -> list[str]:
        base = self._name(prefix) + "/" if prefix else (self.prefix + "/" if self.prefix else "")
        names: set[str] = set()
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base, "Delimiter": "/"}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call("list", prefix or "/", partial(self._client.list_objects_v2, **kwargs))
            for p in page.get("CommonPrefixes", []):
                names.add(p["Prefix"][len(base):].rstrip("/"))
            for o in page.get("Contents", []):
                names.add(o["Key"][len(base):])
            if not page.get("IsTruncated"):
                break
            token = page.get("NextContinuationToken")
        # '' and 'x/' are folder markers of tree-backed servers, not objects
        return sorted(n for n in names if n and "/" not in n)

    # -- parts -----------------------------------------------------------------------------------
    def _get_part(self, name: str, start: int, length: int,
                  etag: str | None) -> tuple[bytes, int, str] | None:
        """Bytes [start, start+length) with the object's total size and ETag; None on 416."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": name,
                                  "Range": f"bytes={start}-{start + length - 1}"}
        if etag is not None:
            kwargs["IfMatch"] = etag
        try:
            resp = self._client.get_object(**kwargs)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code == "InvalidRange":
                return None
            if code in ("PreconditionFailed", "412") and etag is not None:
                raise _Changed() from exc
            raise
        with resp["Body"] as body:
            data = body.read()
        total = _total_from_content_range(resp.get("ContentRange"), start + len(data))
        return data, total, resp.get("ETag", "")

    def _put_multipart(self, key: str, name: str, view: memoryview) -> None:
        up = self._call("put", key, lambda: self._client.create_multipart_upload(
            Bucket=self.bucket, Key=name))["UploadId"]
        starts = list(range(0, len(view), self.part_size))

        def part(i: int) -> dict[str, Any]:
            body = bytes(view[starts[i]: starts[i] + self.part_size])
            resp = self._call("put", key, lambda: self._client.upload_part(
                Bucket=self.bucket, Key=name, UploadId=up, PartNumber=i + 1, Body=body))
            return {"ETag": resp["ETag"], "PartNumber": i + 1}

        try:
            parts = list(self._executor().map(part, range(len(starts))))
            self._call("put", key, lambda: self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=name, UploadId=up, MultipartUpload={"Parts": parts}))
        except BaseException:
            # best effort: do not leave orphaned parts billing in the bucket
            with contextlib.suppress(BotoCoreError, ClientError):
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=up)
            raise

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.parallel, thread_name_prefix="weighthub-s3")
            return self._pool

    # -- the seam: retries and error mapping -----------------------------------------------------
    def _name(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _where(self, key: str) -> str:
        return f"{key!r} in {self.url} (endpoint {self.endpoint})"

    def _call(self, op: str, key: str, fn: Callable[[], T], *, create_only: bool = False) -> T:
        """Run one S3 request with retries on transient failures; map every failure once."""
        t0 = time.monotonic()
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except _Changed:
                raise
            except Exception as exc:
                mapped = self._map(op, key, exc, create_only)
                if mapped is None:
                    raise
                if not isinstance(mapped, _Retryable):
                    raise mapped from exc
                if attempt == self.attempts:
                    raise type(mapped.error)(f"{mapped.error} (gave up after {attempt} attempts, "
                                             f"{time.monotonic() - t0:.1f}s)") from exc
            # full jitter: concurrent receivers do not retry in lockstep
            time.sleep(random.uniform(0, min(self.max_backoff, 0.1 * 2 ** attempt)))
        raise AssertionError("unreachable")  # pragma: no cover

    def _map(self, op: str, key: str, exc: Exception,
             create_only: bool) -> StoreError | _Retryable | None:
        """The weighthub error for a backend exception; None to let it pass unchanged."""
        where = self._where(key)
        if isinstance(exc, StoreError | UsageError):
            return None
        if isinstance(exc, NoCredentialsError):
            return StoreUnavailable(f"{op} {where}: no S3 credentials found; set "
                                    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            message = err.get("Message", "") or code
            if code in ("NoSuchKey", "404") and status == 404:
                return ObjectNotFound(f"{key!r} is not in store {self.url}")
            if code == "NoSuchBucket":
                return StoreUnavailable(f"{op} {where}: bucket {self.bucket!r} does not exist at "
                                        f"{self.endpoint}; create it (e.g. `aws s3 mb "
                                        f"s3://{self.bucket}`) or fix the store URL")
            if create_only and (code in ("PreconditionFailed", "412") or status == 412):
                return ObjectExists(f"{key!r} already exists in store {self.url}")
            if code in _AUTH or status in (401, 403):
                return StoreUnavailable(f"{op} {where}: the S3 server at {self.endpoint} refused "
                                        f"the credentials ({code}: {message}); check "
                                        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and that they "
                                        f"may access bucket {self.bucket!r}")
            if status >= 500 or status == 429 or code in _THROTTLE:
                return _Retryable(StoreUnavailable(f"{op} {where}: server error {status} "
                                                   f"{code}: {message}"))
            return StoreUnavailable(f"{op} {where}: S3 refused the request ({status} {code}: "
                                    f"{message})")
        if isinstance(exc, BotoCoreError | OSError) or _is_urllib3(exc):
            return _Retryable(StoreUnavailable(
                f"{op} {where}: the S3 endpoint {self.endpoint} did not answer in time or "
                f"dropped the connection ({type(exc).__name__}: {exc}); check that it is up "
                f"and reachable (timeouts: connect {self.timeouts[0]:g}s, read "
                f"{self.timeouts[1]:g}s)"))
        return None  # not a backend failure (a bug of ours): let it surface as is


_SESSION_LOCK = threading.Lock()
_SESSION: botocore.session.Session | None = None


def _session() -> botocore.session.Session:
    """One botocore session per process: it caches the service model (a new one costs ~0.3 s)."""
    global _SESSION
    if _SESSION is None:
        _SESSION = botocore.session.get_session()
    return _SESSION


class _Changed(Exception):
    """Internal: the object's ETag changed between the parts of one get."""


def _is_urllib3(exc: Exception) -> bool:
    return type(exc).__module__.startswith(("urllib3", "http.client"))


def _total_from_content_range(value: str | None, fallback: int) -> int:
    # "bytes 0-8388607/33554432"; servers that ignore Range send none: the body is everything
    if value and "/" in value:
        tail = value.rsplit("/", 1)[1]
        if tail.isdigit():
            return int(tail)
    return fallback
