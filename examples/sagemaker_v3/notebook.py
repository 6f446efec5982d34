"""SageMaker SDK v3, as AWS's examples write it: a ModelTrainer (SourceCode, Compute, InputData, Torchrun)
on two instances, then a tuner over it. Run it untouched; `import sagemaker` is disttrain's there:

    disttrain sagemaker run examples/sagemaker_v3/notebook.py
"""

import os

from sagemaker.core.parameter import ContinuousParameter
from sagemaker.train import ModelTrainer
from sagemaker.train.configs import Compute, InputData, SourceCode
from sagemaker.train.distributed import Torchrun
from sagemaker.train.tuner import HyperparameterTuner

here = os.path.dirname(os.path.abspath(__file__))
os.makedirs(os.path.join(here, "data"), exist_ok=True)
with open(os.path.join(here, "data", "points.csv"), "w") as f:
    f.writelines(f"{i / 64},{3 * i / 64 + 0.5}\n" for i in range(64))  # y = 3x + 0.5

trainer = ModelTrainer(
    source_code=SourceCode(source_dir=os.path.join(here, "code"), entry_script="train.py"),
    compute=Compute(instance_type="local_cpu", instance_count=2),  # or ml.*: both run here
    distributed=Torchrun(process_count_per_node=1),
    input_data_config=[InputData(channel_name="train", data_source=os.path.join(here, "data"))],
    hyperparameters={"epochs": 3, "lr": 0.5},
    base_job_name="line",
)
trainer.train()  # one recorded job: 2 instances, torchrun across them
job = trainer._latest_training_job
print("status:", job.training_job_status)
print("model:", job.model_artifacts.s3_model_artifacts)

tuner = HyperparameterTuner(
    model_trainer=trainer,
    objective_metric_name="loss",
    hyperparameter_ranges={"lr": ContinuousParameter(0.05, 1.0)},
    metric_definitions=[{"Name": "loss", "Regex": "epoch 2 loss=([0-9.]+)"}],
    objective_type="Minimize",
    max_jobs=4,
    max_parallel_jobs=2,
    random_seed=7,
)
tuner.tune(wait=True)
best = tuner.describe().best_training_job
print("best:", best.training_job_name, best.tuned_hyper_parameters,
      best.final_hyper_parameter_tuning_job_objective_metric.value)
