"""The SDK's framework estimators: ``PyTorch`` (``sagemaker.pytorch``) and ``TensorFlow``
(``sagemaker.tensorflow``), each :class:`~disttrain.sagemaker.estimator.Framework` with its own
defaults. The SDK's module paths for them are served by :mod:`.sdkpaths`."""

from __future__ import annotations

from typing import Any

from .estimator import Framework


class PyTorch(Framework):
    """The SDK's PyTorch estimator; ``distribution`` may be torch_distributed, pytorchddp,
    smdistributed (run as torch_distributed) or mpi."""

    framework = "pytorch"
    default_base_name = "pytorch-training"


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


__all__ = ["LOCAL_MODEL_DIR", "PyTorch", "TensorFlow"]
