"""The seed article's notebook cell, unchanged but for the import: SDK v1 argument names,
``sagemaker.get_execution_role()``, ``script_mode=True``, a ``{'data': ...}`` input.

    python examples/sagemaker_tf/notebook.py            # data generated next to this file
    DATA_URL=s3://my-bucket/toxic python examples/sagemaker_tf/notebook.py

The ml.p3.8xlarge instance runs on this machine (one instance, its own /opt/ml), the model
lands in ``output_path/<job name>/model.tar.gz``, and the job is in ``disttrain jobs ls``.
"""

import os
import sys
from pathlib import Path

import disttrain.sagemaker as sagemaker  # was: import sagemaker
from disttrain.sagemaker.tensorflow import TensorFlow  # was: from sagemaker.tensorflow import TensorFlow

here = Path(__file__).resolve().parent
sys.path.insert(0, str(here))
from make_data import make  # noqa: E402

data_s3 = os.environ.get("DATA_URL") or make(here / "data").as_uri()
inputs = {'data': data_s3}
output = os.environ.get("OUTPUT_URL")  # None: $DISTTRAIN_HOME/artifacts (was: "s3://<your-bucket>")

# create estimator
estimator = TensorFlow(entry_point=str(here / 'train.py'),
                       train_instance_type='ml.p3.8xlarge',
                       output_path=output,
                       train_instance_count=1,
                       role=sagemaker.get_execution_role(),
                       framework_version='2.1.0',
                       py_version='py3',
                       script_mode=True,
                       metric_definitions=[{'Name': 'valid:accuracy', 'Regex': 'valid_accuracy=([0-9.]+)'},
                                           {'Name': 'train:loss', 'Regex': r' - loss: ([0-9.e+-]+)'}])

estimator.fit(inputs)
print("model:", estimator.model_data)
