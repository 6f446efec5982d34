"""SDK v3's ``sagemaker.train.distributed``."""

from __future__ import annotations

from ..distributed import MPI, SMP, DistributedConfig, Torchrun

__all__ = ["DistributedConfig", "MPI", "SMP", "Torchrun"]
