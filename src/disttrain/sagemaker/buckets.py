"""Where ``s3://`` locations of a notebook live when there is no AWS: one owner for the mapping.

- With an S3-compatible endpoint (``AWS_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL_S3``, the usual
  AWS variables; MinIO, moto, Ceph, ...): every ``s3://`` URL is a real bucket there, and the
  default bucket is created there on first use.
- Without one: the default bucket, and every bucket a notebook made through :class:`Session`
  (``upload_data(bucket=...)``), is a folder under ``$DISTTRAIN_BUCKETS`` (a local folder or any
  fsspec URL; default ``$DISTTRAIN_HOME/buckets``, beside the job store and its artifacts), so
  ``s3://<default bucket>/...`` inputs, outputs and checkpoints work as written. Any other
  ``s3://`` URL is left to s3fs (real S3, with your credentials).

The default bucket's name is the SDK's: ``sagemaker-<region>-<account>``, the account being the
placeholder of :func:`~disttrain.sagemaker.session.get_execution_role`.
"""

from __future__ import annotations

import os
import posixpath
import re
from typing import Any

from ..checkpoint_url import s3_endpoint
from ..errors import UsageError

BUCKETS_ENV = "DISTTRAIN_BUCKETS"
ACCOUNT = "000000000000"
DEFAULT_REGION = "us-east-1"


def region() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or DEFAULT_REGION


def default_bucket_name() -> str:
    return f"sagemaker-{region()}-{ACCOUNT}"


def root() -> str:
    """The folder (or fsspec URL) that holds the local buckets."""
    from ..home import disttrain_home

    return os.environ.get(BUCKETS_ENV) or str(disttrain_home() / "buckets")


def _join(base: str, *parts: str) -> str:
    if "://" in base:
        return posixpath.join(base.rstrip("/"), *[p.strip("/") for p in parts if p])
    return os.path.join(base, *[p.strip("/") for p in parts if p])


# S3's rule for a bucket's name; a local bucket's name is also a folder's, so it must never be a path step.
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def check_bucket(bucket: str) -> str:
    """``bucket`` when it is a valid S3 bucket name; one line otherwise (``..``, ``/``, capitals)."""
    if not isinstance(bucket, str) or not _BUCKET_NAME.match(bucket) or ".." in bucket:
        raise UsageError(f"bucket name {bucket!r} is not a valid S3 bucket name (3-63 lowercase letters, digits, "
                         f"dots and hyphens, starting and ending with a letter or digit, no '..')")
    return bucket


def check_key(bucket: str, key: str) -> str:
    """``key`` when no step of it is ``.`` or ``..``: S3 keeps them as plain key text, but in a local
    bucket's folder they are path steps that would leave the bucket; refused, one line."""
    if any(step in (".", "..") for step in key.split("/")):
        raise UsageError(f"s3://{bucket}/{key}: a key (or key_prefix) with '.' or '..' between slashes would "
                         f"leave the bucket's folder here; name the key without them")
    return key


def split_s3(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` → (bucket, key); anything else is a one-line error."""
    if not isinstance(url, str) or not url.startswith("s3://") or len(url) <= 5:
        raise UsageError(f"expected an s3://bucket/key URL, got {url!r}")
    bucket, _, key = url[5:].partition("/")
    return bucket, key


def is_local(bucket: str) -> bool:
    """A bucket kept under :func:`root` (no endpoint, and the default bucket or one made here)."""
    if s3_endpoint():
        return False
    check_bucket(bucket)  # before its name is ever a folder's
    if bucket == default_bucket_name():
        return True
    fs, path = _fs(_join(root(), bucket))
    return fs.isdir(path)


def resolve(location: Any) -> Any:
    """The location fsspec should open for ``location``: an ``s3://`` URL of a local bucket becomes
    its folder (or URL) under :func:`root`; anything else is returned as it is."""
    if not isinstance(location, str) or not location.startswith("s3://"):
        return location
    bucket, key = split_s3(location)
    if not is_local(bucket):
        return location
    return _join(root(), bucket, check_key(bucket, key))


def resolve_input(channel: str, location: Any) -> Any:
    """:func:`resolve` for an input channel; a key missing from a local bucket is one line naming the
    URL the notebook wrote (not the folder behind it)."""
    resolved = resolve(location)
    if resolved is not location and isinstance(location, str):
        fs, path = _fs(resolved)
        if not fs.exists(path):
            raise UsageError(f"input channel {channel}: {location} does not exist (no such key in the local "
                             f"bucket; upload it first, e.g. Session().upload_data(path, key_prefix=...))")
    return resolved


def present(location: Any) -> Any:
    """The inverse of :func:`resolve` for what a job reports (``model.tar.gz``): a place under a
    local bucket is shown as its ``s3://`` URL, as the SDK would show it."""
    if not isinstance(location, str):
        return location
    base = root().rstrip("/") + "/"
    plain = location[len("file://"):] if location.startswith("file://") else location
    if not plain.startswith(base):
        return location
    bucket, _, key = plain[len(base):].partition("/")
    return f"s3://{bucket}/{key}" if bucket else location


def _fs(location: str):
    from ..jobs.staging import open_fs

    return open_fs(location, {}, "s3")


def make_bucket(bucket: str) -> None:
    """The bucket exists afterwards: a folder under :func:`root`, or a bucket at the endpoint."""
    if s3_endpoint():
        fs, _ = _fs(f"s3://{bucket}")
        try:
            if not fs.exists(bucket):
                fs.mkdir(bucket)
        except Exception as err:  # credentials, endpoint: one line naming them
            raise UsageError(f"cannot create bucket {bucket} at {s3_endpoint()}: {type(err).__name__}: {err}") from None
        return
    fs, path = _fs(_join(root(), check_bucket(bucket)))
    try:
        fs.makedirs(path, exist_ok=True)
    except OSError as err:  # a read-only or full DISTTRAIN_HOME: one line naming the folder and the fix
        raise UsageError(f"cannot create bucket {bucket} as the folder {path}: {err.strerror or err}; set "
                         f"{BUCKETS_ENV} (or DISTTRAIN_HOME) to a writable folder, or AWS_ENDPOINT_URL to an "
                         f"S3 endpoint") from None


def open_location(url: str):
    """(filesystem, path) for an ``s3://`` URL (or any location), local buckets included."""
    return _fs(resolve(url))
