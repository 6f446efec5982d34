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
from typing import Any

from ..errors import UsageError

BUCKETS_ENV = "DISTTRAIN_BUCKETS"
ACCOUNT = "000000000000"
DEFAULT_REGION = "us-east-1"


def region() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or DEFAULT_REGION


def endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


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


def split_s3(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` → (bucket, key); anything else is a one-line error."""
    if not isinstance(url, str) or not url.startswith("s3://") or len(url) <= 5:
        raise UsageError(f"expected an s3://bucket/key URL, got {url!r}")
    bucket, _, key = url[5:].partition("/")
    return bucket, key


def is_local(bucket: str) -> bool:
    """A bucket kept under :func:`root` (no endpoint, and the default bucket or one made here)."""
    if endpoint():
        return False
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
    return _join(root(), bucket, key)


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
    if endpoint():
        fs, _ = _fs(f"s3://{bucket}")
        try:
            if not fs.exists(bucket):
                fs.mkdir(bucket)
        except Exception as err:  # credentials, endpoint: one line naming them
            raise UsageError(f"cannot create bucket {bucket} at {endpoint()}: {type(err).__name__}: {err}") from None
        return
    fs, path = _fs(_join(root(), bucket))
    fs.makedirs(path, exist_ok=True)


def open_location(url: str):
    """(filesystem, path) for an ``s3://`` URL (or any location), local buckets included."""
    return _fs(resolve(url))
