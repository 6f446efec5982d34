"""SDK v3's ``sagemaker.train.tuner`` (served by :mod:`.sdkpaths`): ``HyperparameterTuner`` over a ``ModelTrainer``.

``HyperparameterTuner(model_trainer, objective_metric_name, hyperparameter_ranges, ...)`` with the
ranges of ``sagemaker.core.parameter``; ``tune(inputs=None, job_name=None, wait=True)`` runs the
tuning job, each trial one ModelTrainer job (SDK v3's container contract) with the trial's
hyperparameters. The rest is the v2 tuner's (``best_training_job()``, ``analytics()``, ...).
"""

from __future__ import annotations

import copy
from typing import Any

from ..errors import UsageError
from .modeltrainer import ModelTrainer
from .parameter import CategoricalParameter, ContinuousParameter, IntegerParameter, ParameterRange
from .resources import HyperParameterTuningJob, TrainingJob
from .tuner import merge_definitions
from .tunerbase import TunerBase, TuningJob

GRID_SEARCH = "Grid"


class HyperparameterTuner(TunerBase):
    kind = "model_trainer"

    def __init__(self, model_trainer: ModelTrainer, objective_metric_name: str,
                 hyperparameter_ranges: dict[str, ParameterRange], metric_definitions: list | None = None,
                 strategy: str = "Bayesian", objective_type: str = "Maximize", max_jobs: int | None = None,
                 max_parallel_jobs: int = 1, max_runtime_in_seconds: int | None = None, tags: list | None = None,
                 base_tuning_job_name: str | None = None, warm_start_config=None, strategy_config=None,
                 completion_criteria_config=None, early_stopping_type: str = "Off",
                 model_trainer_name: str | None = None, random_seed: int | None = None, autotune: bool = False,
                 hyperparameters_to_keep_static: list[str] | None = None) -> None:
        if model_trainer_name is not None:
            raise UsageError("HyperparameterTuner: several model trainers in one tuning job (model_trainer_name, "
                             "create()) are not supported here; tune each on its own")
        if not isinstance(model_trainer, ModelTrainer):
            raise UsageError(f"HyperparameterTuner: model_trainer must be a ModelTrainer, got {model_trainer!r} "
                             f"(for an estimator: from sagemaker.tuner import HyperparameterTuner)")
        self.model_trainer = model_trainer
        self._init(objective_metric_name=objective_metric_name, hyperparameter_ranges=hyperparameter_ranges,
                   metric_definitions=metric_definitions, strategy=strategy, objective_type=objective_type,
                   max_jobs=max_jobs, max_parallel_jobs=max_parallel_jobs,
                   max_runtime_in_seconds=max_runtime_in_seconds, base_tuning_job_name=base_tuning_job_name,
                   early_stopping_type=early_stopping_type, random_seed=random_seed, autotune=autotune,
                   ignored={"tags": tags, "warm_start_config": warm_start_config, "strategy_config": strategy_config,
                            "completion_criteria_config": completion_criteria_config,
                            "hyperparameters_to_keep_static": hyperparameters_to_keep_static})

    def _definitions(self) -> list[dict[str, str]]:
        own = [{"Name": m.name, "Regex": m.regex} for m in self.model_trainer._metric_definitions or []]
        return merge_definitions(own, self.metric_definitions)

    def _static(self) -> dict[str, Any]:
        return dict(self.model_trainer.hyperparameters)

    def _base_name(self) -> str:
        return self.model_trainer.base_job_name

    def _job(self, inputs: Any, name: str) -> dict[str, Any]:
        fields = self.model_trainer._job_fields(inputs, name)
        fields["metric_definitions"] = self._definitions()
        return fields

    def tune(self, inputs: Any = None, job_name: str | None = None, model_trainer_kwargs: dict | None = None,
             wait: bool = True, **kwargs: Any) -> None:
        """Start the tuning job (and with ``wait``, follow it to its end)."""
        self._start(inputs, job_name, wait)

    def best_model_trainer(self) -> ModelTrainer:
        """A copy of the ModelTrainer whose ``_latest_training_job`` is the best trial's job."""
        trainer = copy.copy(self.model_trainer)
        trainer._latest_training_job = TrainingJob(self.best_training_job())
        return trainer

    best_estimator = best_model_trainer

    def describe(self) -> HyperParameterTuningJob:
        """SDK v3's return: the tuning job resource (``.hyper_parameter_tuning_job_status``, ...), not
        v2's dict (``sagemaker.tuner.HyperparameterTuner.describe()`` keeps that)."""
        return HyperParameterTuningJob.get(self._ensure_last_tuning_job().name)


__all__ = ["CategoricalParameter", "ContinuousParameter", "GRID_SEARCH", "HyperparameterTuner", "IntegerParameter",
           "TuningJob"]
