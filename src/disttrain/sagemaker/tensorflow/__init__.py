"""``from disttrain.sagemaker.tensorflow import TensorFlow`` (the SDK's ``sagemaker.tensorflow``)."""

from __future__ import annotations

from .estimator import LOCAL_MODEL_DIR, TensorFlow

__all__ = ["LOCAL_MODEL_DIR", "TensorFlow"]
