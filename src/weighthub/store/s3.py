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
  a body), so a server that accepts and then says nothing ends in StoreTimeout, not a hang
  (an upload first waits up to 1 s, botocore's fixed wait, for `100 Continue`);
- transient failures (5xx, throttling, connection refused/reset, timeouts, truncated bodies) are
  retried with jittered exponential backoff, at most `attempts` times in all; 4xx never are;
- every botocore/urllib3 exception is mapped to the weighthub error tree once
  (`s3_errors.map_error`), with the endpoint, bucket and what to do in the message. Worst case
  for one request against a silent server: attempts × (connect_timeout + 1 s + read_timeout) +
  backoff (< attempts × max_backoff).
- a per-call `timeout` (default: the store's) is a deadline for the whole call, parts and
  retries included: no attempt starts after it, backoff never sleeps past it, and each
  attempt's timeouts shrink to the time left (a cached botocore client per timeout pair).
  Without one, a server trickling bytes just faster than the read timeout is not bounded.
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
from botocore.exceptions import BotoCoreError, ClientError

from ..errors import StoreError, StoreTimeout, UsageError
from .base import check_key, check_max_bytes, check_timeout, too_large
from .s3_errors import Retryable, map_error, ranged_body

T = TypeVar("T")

MiB = 1 << 20
_BUCKET_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789.-")
# per-attempt timeouts under a deadline are rounded down to one of these, so a store makes a
# handful of botocore clients (one per pair, cached), not one per call
_TIMEOUT_STEPS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0)


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
        timeout: default deadline per call (seconds, parts and retries included); None: only
            the per-attempt bounds above.
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
                 parallel: int = 4, timeout: float | None = None) -> None:
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
        self.timeout = check_timeout(timeout, None, f"store {self.url}")
        endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") \
            or os.environ.get("AWS_ENDPOINT_URL") or None
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") \
            or "us-east-1"
        config = Config(
            connect_timeout=connect_timeout, read_timeout=read_timeout,
            retries={"total_max_attempts": 1, "mode": "standard"},  # retries are ours: see _call
            max_pool_connections=max(16, 4 * parallel),
            # integrity is end to end (the manifest's SHA-256 of every chunk): skip the CRC pass
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": "path"} if endpoint_url else None,
        )
        self._config = config
        self._client_args: dict[str, Any] = {
            "endpoint_url": endpoint_url, "region_name": region,
            "aws_access_key_id": access_key_id, "aws_secret_access_key": secret_access_key}
        self._clients: dict[tuple[float, float], Any] = {}
        self._client = self._make_client(self.timeouts)
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
    def get(self, key: str, *, timeout: float | None = None,
            max_bytes: int | None = None) -> bytes:
        name = self._name(key)
        check_max_bytes(max_bytes, f"get {self._where(key)}")
        end = self._deadline("get", key, timeout)
        # the first part says the total (Content-Range): a larger object than max_bytes is
        # refused after at most max_bytes + 1 bytes, before any other part is asked for
        first_len = self.part_size if max_bytes is None else min(self.part_size, max_bytes + 1)
        first = self._call("get", key, end, lambda c: self._get_part(c, name, 0, first_len, None))
        if first is None:  # 416 on the first range: the object exists and is empty
            return b""
        head, total, etag = first
        if max_bytes is not None and total > max_bytes:
            raise too_large(total, max_bytes, f"get {self._where(key)}")
        if total <= len(head):
            return head
        starts = range(len(head), total, self.part_size)

        def part(start: int) -> bytes:
            got = self._call("get", key, end, lambda c: self._get_part(c, name, start,
                                                                       self.part_size, etag))
            if got is None or len(got[0]) != min(self.part_size, total - start):
                raise StoreTimeout(f"{self._where(key)}: short read at offset {start}: the "
                                   "server dropped the body; retry")
            return got[0]

        try:
            parts = list(self._executor().map(part, starts))
        except _Changed:
            # replaced while we read it: read the new object afresh, within what is left
            return self.get(key, timeout=None if end is None else max(1e-3, end - time.monotonic()),
                            max_bytes=max_bytes)
        return b"".join([head, *parts])

    def get_range(self, key: str, start: int, stop: int, *,
                  timeout: float | None = None) -> bytes:
        name = self._name(key)
        if start < 0 or stop < 0:
            raise UsageError(f"get_range({key!r}, {start}, {stop}): offsets must be >= 0")
        if stop <= start:
            self.size(key, timeout=timeout)  # an empty range still says whether it exists
            return b""
        end = self._deadline("get_range", key, timeout)
        got = self._call("get_range", key, end,
                         lambda c: self._get_part(c, name, start, stop - start, None))
        return b"" if got is None else got[0]

    def size(self, key: str, *, timeout: float | None = None) -> int:
        # a 1-byte ranged GET, not HEAD: HEAD errors carry no code, so a missing bucket or bad
        # credentials would look like a missing key
        name = self._name(key)
        end = self._deadline("size", key, timeout)
        got = self._call("size", key, end, lambda c: self._get_part(c, name, 0, 1, None))
        return 0 if got is None else got[1]

    def put(self, key: str, data: bytes | memoryview, *, create_only: bool = False,
            timeout: float | None = None) -> None:
        name = self._name(key)
        end = self._deadline("put", key, timeout)
        view = memoryview(data).cast("B")
        if create_only or len(view) < self.multipart_threshold:
            extra = {"IfNoneMatch": "*"} if create_only else {}
            body = bytes(view)
            self._call("put", key, end, lambda c: c.put_object(
                Bucket=self.bucket, Key=name, Body=body, **extra), create_only=create_only)
            return
        self._put_multipart(key, name, view, end)

    def delete(self, key: str, *, timeout: float | None = None) -> None:
        name = self._name(key)
        end = self._deadline("delete", key, timeout)
        self._call("delete", key, end, lambda c: c.delete_object(Bucket=self.bucket, Key=name))
        # Servers with a directory tree (SeaweedFS) keep emptied "folders" and list them as
        # prefixes. Deleting "dir/" removes a folder only when it is empty (S3 proper: a no-op,
        # our keys never end in '/'), so deleted versions leave nothing behind.
        parts = key.split("/")[:-1]
        while parts:
            folder = self._name("/".join(parts)) + "/"
            self._call("delete", key, end, partial(_delete_object, bucket=self.bucket, key=folder))
            parts.pop()

    def children(self, prefix: str, *, timeout: float | None = None) -> list[str]:
        base = self._name(prefix) + "/" if prefix else (self.prefix + "/" if self.prefix else "")
        end = self._deadline("children", prefix or "/", timeout)
        names: set[str] = set()
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base, "Delimiter": "/"}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call("list", prefix or "/", end, partial(_list_page, kwargs=kwargs))
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
    def _get_part(self, client: Any, name: str, start: int, length: int,
                  etag: str | None) -> tuple[bytes, int, str] | None:
        """Bytes [start, start+length) with the object's total size and ETag; None on 416."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": name,
                                  "Range": f"bytes={start}-{start + length - 1}"}
        if etag is not None:
            kwargs["IfMatch"] = etag
        try:
            resp = client.get_object(**kwargs)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code == "InvalidRange":
                return None
            if code in ("PreconditionFailed", "412") and etag is not None:
                raise _Changed() from exc
            raise
        data, total = ranged_body(resp, start, length, f"{name!r} in bucket {self.bucket}")
        return data, total, resp.get("ETag", "")

    def _put_multipart(self, key: str, name: str, view: memoryview, end: float | None) -> None:
        up = self._call("put", key, end, lambda c: c.create_multipart_upload(
            Bucket=self.bucket, Key=name))["UploadId"]
        starts = list(range(0, len(view), self.part_size))

        def part(i: int) -> dict[str, Any]:
            body = bytes(view[starts[i]: starts[i] + self.part_size])
            resp = self._call("put", key, end, lambda c: c.upload_part(
                Bucket=self.bucket, Key=name, UploadId=up, PartNumber=i + 1, Body=body))
            return {"ETag": resp["ETag"], "PartNumber": i + 1}

        try:
            parts = list(self._executor().map(part, range(len(starts))))
            self._call("put", key, end, lambda c: c.complete_multipart_upload(
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

    # -- clients under a deadline ----------------------------------------------------------------
    def _make_client(self, timeouts: tuple[float, float]) -> Any:
        config = self._config.merge(Config(connect_timeout=timeouts[0], read_timeout=timeouts[1]))
        try:
            with _SESSION_LOCK:  # a botocore session is not thread-safe; its clients are
                return _session().create_client("s3", config=config, **self._client_args)
        except (BotoCoreError, ValueError) as exc:
            raise UsageError(f"store {self.url}: cannot set up an S3 client for endpoint "
                             f"{self._client_args['endpoint_url'] or 'AWS'}: {exc}") from exc

    def _client_until(self, end: float | None) -> Any:
        """A client whose per-attempt timeouts end by `end` (rounded down to a step)."""
        if end is None:
            return self._client
        left = end - time.monotonic()
        step = max([s for s in _TIMEOUT_STEPS if s <= left], default=_TIMEOUT_STEPS[0])
        pair = (min(self.timeouts[0], step), min(self.timeouts[1], step))
        if pair == self.timeouts:
            return self._client
        with self._pool_lock:
            client = self._clients.get(pair)
        if client is None:
            client = self._make_client(pair)
            with self._pool_lock:
                client = self._clients.setdefault(pair, client)
        return client

    def _deadline(self, op: str, key: str, timeout: float | None) -> float | None:
        limit = check_timeout(timeout, self.timeout, f"{op} {self._where(key)}")
        return None if limit is None else time.monotonic() + limit

    # -- the seam: retries and error mapping -----------------------------------------------------
    def _name(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _where(self, key: str) -> str:
        return f"{key!r} in {self.url} (endpoint {self.endpoint})"

    def _call(self, op: str, key: str, end: float | None, fn: Callable[[Any], T], *,
              create_only: bool = False) -> T:
        """Run one S3 request with retries on transient failures, all before `end`; map every
        failure once (`s3_errors.map_error`)."""
        t0 = time.monotonic()
        for attempt in range(1, self.attempts + 1):
            if end is not None and time.monotonic() >= end:
                raise StoreTimeout(f"{op} {self._where(key)}: not done within "
                                   f"{end - t0:.2f}s ({attempt - 1} attempt(s)); the server is "
                                   "slow or unreachable: retry, or raise timeout")
            try:
                return fn(self._client_until(end))
            except _Changed:
                raise
            except Exception as exc:
                mapped = map_error(self, op, key, exc, create_only)
                if mapped is None:
                    raise
                if not isinstance(mapped, Retryable):
                    raise mapped from exc
                if attempt == self.attempts:
                    raise type(mapped.error)(f"{mapped.error} (gave up after {attempt} attempts, "
                                             f"{time.monotonic() - t0:.1f}s)") from exc
                last: StoreError = mapped.error
            # full jitter: concurrent receivers do not retry in lockstep
            pause = random.uniform(0, min(self.max_backoff, 0.1 * 2 ** attempt))
            if end is not None and time.monotonic() + pause >= end:
                raise type(last)(f"{last} (no time left for attempt {attempt + 1}: the call's "
                                 f"deadline of {end - t0:.2f}s passed)")
            time.sleep(pause)
        raise AssertionError("unreachable")  # pragma: no cover


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


def _delete_object(client: Any, *, bucket: str, key: str) -> Any:
    return client.delete_object(Bucket=bucket, Key=key)


def _list_page(client: Any, *, kwargs: dict[str, Any]) -> Any:
    return client.list_objects_v2(**kwargs)
