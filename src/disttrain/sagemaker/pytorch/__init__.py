"""``from disttrain.sagemaker.pytorch import PyTorch`` (the SDK's ``sagemaker.pytorch``)."""

from __future__ import annotations

from .estimator import PyTorch

__all__ = ["PyTorch"]
