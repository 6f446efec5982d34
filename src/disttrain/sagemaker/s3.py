"""``sagemaker.s3``: ``S3Uploader``, ``S3Downloader``, ``parse_s3_url``, ``s3_path_join``, as notebooks
use them, over :class:`~disttrain.sagemaker.session.Session` (so the default bucket works without AWS)."""

from __future__ import annotations

from .buckets import split_s3
from .session import Session


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` → (bucket, key)."""
    return split_s3(url)


def is_s3_url(url: str) -> bool:
    return isinstance(url, str) and url.startswith("s3://")


def s3_path_join(*args: str, with_end_slash: bool = False) -> str:
    """The SDK's join: parts joined by single slashes, ``s3://`` kept, no slash at the end unless asked."""
    parts = [str(a) for a in args if a not in (None, "")]
    if not parts:
        return ""
    head = parts[0]
    scheme = "s3://" if head.startswith("s3://") else ""
    parts[0] = head[len(scheme):]
    joined = scheme + "/".join(p.strip("/") for p in parts if p.strip("/"))
    return joined + "/" if with_end_slash else joined


class S3Uploader:
    @staticmethod
    def upload(local_path: str, desired_s3_uri: str, kms_key: str | None = None, sagemaker_session=None,
               callback=None) -> str:
        bucket, key_prefix = split_s3(desired_s3_uri)
        return (sagemaker_session or Session()).upload_data(path=local_path, bucket=bucket, key_prefix=key_prefix)

    @staticmethod
    def upload_string_as_file_body(body: str, desired_s3_uri: str | None = None, kms_key: str | None = None,
                                   sagemaker_session=None) -> str:
        bucket, key = split_s3(desired_s3_uri)
        return (sagemaker_session or Session()).upload_string_as_file_body(body, bucket, key)


class S3Downloader:
    @staticmethod
    def download(s3_uri: str, local_path: str, kms_key: str | None = None, sagemaker_session=None) -> list[str]:
        bucket, key_prefix = split_s3(s3_uri)
        return (sagemaker_session or Session()).download_data(path=local_path, bucket=bucket, key_prefix=key_prefix)

    @staticmethod
    def read_file(s3_uri: str, sagemaker_session=None) -> str:
        bucket, key = split_s3(s3_uri)
        return (sagemaker_session or Session()).read_s3_file(bucket, key)

    @staticmethod
    def list(s3_uri: str, sagemaker_session=None) -> list[str]:
        bucket, key_prefix = split_s3(s3_uri)
        keys = (sagemaker_session or Session()).list_s3_files(bucket, key_prefix)
        return [f"s3://{bucket}/{key}" for key in keys]


__all__ = ["S3Downloader", "S3Uploader", "is_s3_url", "parse_s3_url", "s3_path_join"]
