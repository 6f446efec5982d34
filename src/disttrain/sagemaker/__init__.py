"""SageMaker notebooks and scripts, unchanged, on your own machines.

Change only the import::

    import disttrain.sagemaker as sagemaker
    from disttrain.sagemaker.tensorflow import TensorFlow

    estimator = TensorFlow(entry_point="train.py", train_instance_type="ml.p3.8xlarge",
                           train_instance_count=1, role=sagemaker.get_execution_role(),
                           framework_version="2.1.0", py_version="py3", script_mode=True)
    estimator.fit({"data": "s3://bucket/data"})

or change nothing: ``disttrain sagemaker run notebook.ipynb`` (or ``%load_ext disttrain.sagemaker``
in Jupyter) serves ``import sagemaker`` from this package, SDK v2 and v3 module paths alike
(``sagemaker.pytorch``, ``sagemaker.tuner``, ``sagemaker.train``, ``sagemaker.modules.train``,
``sagemaker.core.parameter``, ...).

Each ``fit``/``train`` is a recorded job (``disttrain jobs ls``): the container contract of
SageMaker's training toolkit (estimators) or of SDK v3 (ModelTrainer), a private ``/opt/ml`` per
instance, ``distribution=``, metrics, checkpoints; ``HyperparameterTuner`` runs its trials as
jobs, searched by Optuna. The SDK's module paths that hold nothing of their own are one table,
:mod:`.sdkpaths`.
"""

from __future__ import annotations

from . import image_uris, s3, sdkpaths, session
from .analytics import HyperparameterTuningJobAnalytics, TrainingJobAnalytics
from .estimator import (
    Estimator,
    EstimatorBase,
    Framework,
    RenamedArgumentWarning,
    TrainingJob,
    UnexpectedStatusException,
)
from .frameworks import PyTorch, TensorFlow
from .inputs import TrainingInput
from .session import Session, get_execution_role

sdkpaths.install()  # the SDK's other module paths (sagemaker.train, sagemaker.core.parameter, ...)

__all__ = ["Estimator", "EstimatorBase", "Framework", "HyperparameterTuningJobAnalytics", "PyTorch", "Session",
           "TensorFlow", "TrainingInput", "TrainingJob", "TrainingJobAnalytics", "UnexpectedStatusException",
           "RenamedArgumentWarning", "get_execution_role", "image_uris", "s3", "session",
           "load_ipython_extension", "unload_ipython_extension"]


def load_ipython_extension(ipython) -> None:
    """``%load_ext disttrain.sagemaker``: from here on, ``import sagemaker`` in this kernel is disttrain's."""
    from .sdkshim import install

    install(say=print)


def unload_ipython_extension(ipython) -> None:
    from .sdkshim import uninstall

    uninstall()
