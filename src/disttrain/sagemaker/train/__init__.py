"""SDK v3's ``sagemaker.train``: ``ModelTrainer`` (and ``Session``/``get_execution_role``, as there)."""

from __future__ import annotations

from ..configs import Compute
from ..modeltrainer import Mode, ModelTrainer
from ..session import Session, get_execution_role

__all__ = ["Compute", "Mode", "ModelTrainer", "Session", "get_execution_role"]
