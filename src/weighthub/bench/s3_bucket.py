"""An S3 bucket on a test server: a raw botocore client, and bucket creation that waits for it.

`python -m weighthub.bench.s3_bucket wait ENDPOINT BUCKET TIMEOUT` runs the wait inside a
network namespace, where a SeaweedFS endpoint is reachable and this process's is not.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

REGION = "us-east-1"


def client(endpoint: str, access_key: str | None, secret_key: str | None,
            config: Any = None) -> Any:
    """A raw S3 client from botocore (the `s3` extra's one dependency; boto3 is not required)."""
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=access_key,
        aws_secret_access_key=secret_key, config=config)


def create_bucket(endpoint: str, bucket: str, access_key: str | None, secret_key: str | None,
                   timeout: float, alive: Any = None) -> str | None:
    """Create `bucket` with a signed request, retrying until it works: None, or why it did not.

    The S3 gateway answers before the filer behind it takes writes, so early failures are
    expected; `alive()` returning False (weed exited) ends the wait at once.
    """
    from botocore.config import Config

    # no single request may outlive the wait: a read stalled on a half-started gateway would
    # otherwise keep the wait going for seconds past `timeout` (and it may then succeed)
    s3 = client(endpoint, access_key, secret_key,
                 Config(connect_timeout=min(1.0, timeout), read_timeout=min(5.0, timeout),
                        retries={"max_attempts": 0}))
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline and (alive is None or alive()):
        try:
            s3.create_bucket(Bucket=bucket)
            return None
        except Exception as exc:  # not up yet: connection refused, filer not ready
            code = getattr(exc, "response", {}).get("Error", {}).get("Code")
            if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                return None
            last = exc
            time.sleep(0.05)
    return f"could not create bucket {bucket!r}: {last}"


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "wait":  # run inside the namespace; keys from the env
        problem = create_bucket(argv[1], argv[2], os.environ.get("AWS_ACCESS_KEY_ID"),
                                 os.environ.get("AWS_SECRET_ACCESS_KEY"), float(argv[3]))
        if problem is not None:
            print(problem, flush=True)
            return 1
        return 0
    print("usage: python -m weighthub.bench.s3_bucket wait ENDPOINT BUCKET TIMEOUT", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
