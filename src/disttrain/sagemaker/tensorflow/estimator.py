"""The SDK's ``sagemaker.tensorflow.estimator``: ``TensorFlow``."""

from __future__ import annotations

from typing import Any

from ..estimator import Framework

# What the SDK passes as --model_dir in local mode; with a private /opt/ml it is the instance's model folder.
LOCAL_MODEL_DIR = "/opt/ml/model"


class TensorFlow(Framework):
    """The SDK's TensorFlow estimator; ``distribution`` may be multi_worker_mirrored_strategy,
    parameter_server or mpi. As the SDK does, the script also gets ``--model_dir`` (here
    ``/opt/ml/model``) unless ``model_dir=False`` or another value is given."""

    framework = "tensorflow"
    default_base_name = "tensorflow-training"
    model_dir: Any = None  # also for an estimator made by attach()

    def __init__(self, model_dir: Any = None, **kwargs: Any) -> None:
        self.model_dir = model_dir
        super().__init__(**kwargs)

    def _hyperparameters_for_job(self) -> dict[str, Any]:
        hps = super()._hyperparameters_for_job()
        if self.model_dir is not False and "model_dir" not in hps:
            hps["model_dir"] = self.model_dir or LOCAL_MODEL_DIR
        return hps


__all__ = ["TensorFlow"]
