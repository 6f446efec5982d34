"""SageMaker notebooks and scripts, unchanged, on your own machines.

Change only the import::

    import disttrain.sagemaker as sagemaker
    from disttrain.sagemaker.tensorflow import TensorFlow

    estimator = TensorFlow(entry_point="train.py", train_instance_type="ml.p3.8xlarge",
                           train_instance_count=1, role=sagemaker.get_execution_role(),
                           framework_version="2.1.0", py_version="py3", script_mode=True)
    estimator.fit({"data": "s3://bucket/data"})

Each ``fit`` is a recorded job (``disttrain jobs ls``): the container contract of SageMaker's
training toolkit, a private ``/opt/ml`` per instance, ``distribution=``, metrics, checkpoints.
"""

from __future__ import annotations

from .analytics import TrainingJobAnalytics
from .estimator import (
    Estimator,
    EstimatorBase,
    Framework,
    RenamedArgumentWarning,
    TrainingJob,
    UnexpectedStatusException,
)
from .inputs import TrainingInput
from .pytorch import PyTorch
from .session import get_execution_role
from .tensorflow import TensorFlow

__all__ = ["Estimator", "EstimatorBase", "Framework", "PyTorch", "TensorFlow", "TrainingInput", "TrainingJob",
           "TrainingJobAnalytics",
           "UnexpectedStatusException", "RenamedArgumentWarning", "get_execution_role"]
