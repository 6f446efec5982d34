"""SDK v3's ``sagemaker.core.resources``: the training and tuning job resources."""

from __future__ import annotations

from ..resources import HyperParameterTuningJob, TrainingJob

__all__ = ["HyperParameterTuningJob", "TrainingJob"]
