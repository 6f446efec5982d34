"""SDK v3's ``sagemaker.core.parameter``."""

from __future__ import annotations

from ..parameter import CategoricalParameter, ContinuousParameter, IntegerParameter, ParameterRange

__all__ = ["CategoricalParameter", "ContinuousParameter", "IntegerParameter", "ParameterRange"]
