"""SDK v3's ``sagemaker.core.image_uris``."""

from __future__ import annotations

from ..image_uris import retrieve

__all__ = ["retrieve"]
