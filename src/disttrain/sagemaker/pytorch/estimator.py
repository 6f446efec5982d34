"""The SDK's ``sagemaker.pytorch.estimator``: ``PyTorch``."""

from __future__ import annotations

from ..estimator import Framework


class PyTorch(Framework):
    """The SDK's PyTorch estimator; ``distribution`` may be torch_distributed, pytorchddp,
    smdistributed (run as torch_distributed) or mpi."""

    framework = "pytorch"
    default_base_name = "pytorch-training"


__all__ = ["PyTorch"]
