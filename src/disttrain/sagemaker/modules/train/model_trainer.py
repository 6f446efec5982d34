"""SDK v2's ``sagemaker.modules.train.model_trainer``."""

from __future__ import annotations

from ...modeltrainer import Mode, ModelTrainer

__all__ = ["Mode", "ModelTrainer"]
