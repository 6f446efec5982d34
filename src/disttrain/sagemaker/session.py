"""``sagemaker.Session`` and ``get_execution_role()``: the parts of the SDK's session notebooks use.

No AWS client is made: ``default_bucket()`` is the bucket of :mod:`.buckets` (a local folder,
or a bucket at an S3-compatible endpoint), and ``upload_data``/``download_data`` move files
there through fsspec. AWS-only constructor arguments (``boto_session``, ``sagemaker_client``,
...) are accepted and unused.
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path
from typing import Any

from ..errors import UsageError
from . import buckets

LOCAL_ROLE = f"arn:aws:iam::{buckets.ACCOUNT}:role/disttrain-local"


def get_execution_role(sagemaker_session=None, use_default: bool = False) -> str:
    """A placeholder role name: jobs run on your own machines as your own user, so no IAM role
    is assumed; estimators accept the value (and ignore it) so notebook cells run unchanged."""
    return LOCAL_ROLE


class Session:
    """``sagemaker.Session(default_bucket=None, default_bucket_prefix=None, ...)``."""

    def __init__(self, boto_session=None, sagemaker_client=None, sagemaker_runtime_client=None,
                 sagemaker_featurestore_runtime_client=None, default_bucket: str | None = None,
                 sagemaker_config: dict | None = None, settings=None, sagemaker_metrics_client=None,
                 default_bucket_prefix: str | None = None) -> None:
        self._default_bucket_name = default_bucket
        self.default_bucket_prefix = default_bucket_prefix
        self._boto_session = boto_session
        self.config = sagemaker_config
        self.local_mode = False

    def __repr__(self) -> str:
        return f"<disttrain.sagemaker.Session region={self.boto_region_name} bucket={self.default_bucket()}>"

    @property
    def boto_region_name(self) -> str:
        return buckets.region()

    @property
    def boto_session(self):
        """boto3's session for the region (boto3 is not needed for anything else here)."""
        if self._boto_session is None:
            try:
                import boto3
            except ImportError:
                raise UsageError("sagemaker.Session().boto_session needs boto3: pip install boto3") from None
            self._boto_session = boto3.Session(region_name=self.boto_region_name)
        return self._boto_session

    @property
    def sagemaker_client(self):
        raise UsageError("disttrain.sagemaker makes no SageMaker API client: jobs run on your own machines "
                         "(use the estimator, ModelTrainer or tuner objects, or `disttrain jobs`)")

    def account_id(self) -> str:
        return buckets.ACCOUNT

    def default_bucket(self) -> str:
        """The bucket name; made (a folder, or a bucket at the endpoint) on first use."""
        name = self._default_bucket_name or buckets.default_bucket_name()
        buckets.make_bucket(name)
        self._default_bucket_name = name
        return name

    # --- files ---
    def upload_data(self, path: str, bucket: str | None = None, key_prefix: str = "data", callback=None,
                    extra_args: dict | None = None) -> str:
        """A file or a folder's files to ``s3://bucket/key_prefix/...``; returns the SDK's URL:
        the file's own URL for a file, the prefix for a folder."""
        bucket = bucket or self.default_bucket()
        buckets.make_bucket(bucket)
        local = Path(path)
        if not local.exists():
            raise UsageError(f"upload_data: {path} does not exist")
        key_prefix = key_prefix.strip("/")
        if local.is_dir():
            files = [(f, f"{key_prefix}/{f.relative_to(local).as_posix()}") for f in sorted(local.rglob("*"))
                     if f.is_file()]
            url = f"s3://{bucket}/{key_prefix}"
        else:
            files = [(local, f"{key_prefix}/{local.name}" if key_prefix else local.name)]
            url = f"s3://{bucket}/{files[0][1]}"
        for source, key in files:
            self._put(str(source), f"s3://{bucket}/{key}")
        return url

    def upload_string_as_file_body(self, body: str, bucket: str, key: str, kms_key: str | None = None) -> str:
        buckets.make_bucket(bucket)
        url = f"s3://{bucket}/{key}"
        fs, target = buckets.open_location(url)
        fs.makedirs(posixpath.dirname(target), exist_ok=True)
        fs.pipe_file(target, body.encode() if isinstance(body, str) else body)
        return url

    def download_data(self, path: str, bucket: str, key_prefix: str = "", extra_args: dict | None = None) -> list[str]:
        """Every object under ``s3://bucket/key_prefix`` into the folder ``path``; their local paths."""
        keys = self.list_s3_files(bucket, key_prefix)
        downloaded = []
        for key in keys:
            tail = os.path.basename(key) if os.path.splitext(key_prefix)[1] else os.path.relpath(key, key_prefix)
            target = os.path.join(path, tail)
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            fs, remote = buckets.open_location(f"s3://{bucket}/{key}")
            fs.get_file(remote, target)
            downloaded.append(target)
        return downloaded

    def list_s3_files(self, bucket: str, key_prefix: str) -> list[str]:
        """The keys under ``key_prefix`` (a folder's files, or the one object of that name)."""
        fs, remote = buckets.open_location(f"s3://{bucket}/{key_prefix}")
        base = buckets.open_location(f"s3://{bucket}")[1].rstrip("/")
        try:
            found = fs.find(remote) if fs.isdir(remote) else ([remote] if fs.exists(remote) else [])
        except FileNotFoundError:
            found = []
        return [str(f).rstrip("/")[len(base) + 1:] for f in found]

    def read_s3_file(self, bucket: str, key_prefix: str) -> str:
        fs, remote = buckets.open_location(f"s3://{bucket}/{key_prefix}")
        try:
            return fs.cat_file(remote).decode()
        except FileNotFoundError:
            raise UsageError(f"s3://{bucket}/{key_prefix} does not exist") from None

    def _put(self, source: str, url: str) -> None:
        fs, target = buckets.open_location(url)
        fs.makedirs(posixpath.dirname(target), exist_ok=True)  # a local bucket's folders; no-op on S3
        fs.put_file(source, target)

    # --- jobs ---
    def describe_training_job(self, job_name: str) -> dict[str, Any]:
        from .estimator import TrainingJob

        return TrainingJob(job_name).describe()

    def logs_for_job(self, job_name: str, wait: bool = False, poll: int = 10, log_type: str = "All",
                     timeout=None) -> None:
        from .estimator import TrainingJob

        TrainingJob(job_name).logs(follow=wait)

    def wait_for_job(self, job: str, poll: int = 5) -> dict[str, Any]:
        from .estimator import TrainingJob

        TrainingJob(job).wait()
        return TrainingJob(job).describe()

    def describe_tuning_job(self, job_name: str) -> dict[str, Any]:
        from .tuning import describe_tuning_job

        return describe_tuning_job(job_name)
