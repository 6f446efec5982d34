"""SDK v3's ``sagemaker.core.s3``."""

from __future__ import annotations

from ...s3 import S3Downloader, S3Uploader, is_s3_url, parse_s3_url, s3_path_join

__all__ = ["S3Downloader", "S3Uploader", "is_s3_url", "parse_s3_url", "s3_path_join"]
