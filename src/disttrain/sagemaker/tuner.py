"""SDK v2's ``sagemaker.tuner``: ``HyperparameterTuner`` over an estimator, and the ranges.

``HyperparameterTuner(estimator, objective_metric_name, hyperparameter_ranges, metric_definitions=None,
strategy="Bayesian", objective_type="Maximize", max_jobs=None, max_parallel_jobs=1, ...)``; ``fit()``
runs the tuning job (each trial one recorded job of the estimator with the trial's
hyperparameters), then ``best_training_job()``, ``best_estimator()``, ``analytics()``,
``describe()``, ``stop_tuning_job()``. See :mod:`.tuning` for how strategies map onto Optuna.
"""

from __future__ import annotations

from typing import Any

from ..errors import UsageError
from .estimator import EstimatorBase
from .parameter import CategoricalParameter, ContinuousParameter, IntegerParameter, ParameterRange
from .tunerbase import TunerBase, TuningJob

GRID_SEARCH = "Grid"
HYPERBAND = "Hyperband"


def merge_definitions(*groups: list[dict[str, str]] | None) -> list[dict[str, str]]:
    """Metric definitions by name, later groups winning (the tuner's over the estimator's)."""
    merged: dict[str, dict[str, str]] = {}
    for group in groups:
        for entry in group or []:
            if isinstance(entry, dict) and "Name" in entry:
                merged[entry["Name"]] = {"Name": entry["Name"], "Regex": entry.get("Regex")}
            else:
                raise UsageError(f"metric_definitions: each entry must be {{'Name': ..., 'Regex': ...}}, got {entry!r}")
    return list(merged.values())


class HyperparameterTuner(TunerBase):
    def __init__(self, estimator: EstimatorBase, objective_metric_name: str,
                 hyperparameter_ranges: dict[str, ParameterRange], metric_definitions: list | None = None,
                 strategy: str = "Bayesian", objective_type: str = "Maximize", max_jobs: int | None = None,
                 max_parallel_jobs: int = 1, max_runtime_in_seconds: int | None = None, tags: list | None = None,
                 base_tuning_job_name: str | None = None, warm_start_config=None, strategy_config=None,
                 completion_criteria_config=None, early_stopping_type: str = "Off", estimator_name: str | None = None,
                 random_seed: int | None = None, autotune: bool = False,
                 hyperparameters_to_keep_static: list[str] | None = None) -> None:
        if estimator_name is not None:
            raise UsageError("HyperparameterTuner: several estimators in one tuning job (estimator_name, create()) "
                             "are not supported here; tune each estimator on its own")
        if not isinstance(estimator, EstimatorBase):
            raise UsageError(f"HyperparameterTuner: estimator must be an Estimator, PyTorch or TensorFlow, got "
                             f"{estimator!r} (for a ModelTrainer: from sagemaker.train.tuner import "
                             f"HyperparameterTuner)")
        self.estimator = estimator
        self._init(objective_metric_name=objective_metric_name, hyperparameter_ranges=hyperparameter_ranges,
                   metric_definitions=metric_definitions, strategy=strategy, objective_type=objective_type,
                   max_jobs=max_jobs, max_parallel_jobs=max_parallel_jobs,
                   max_runtime_in_seconds=max_runtime_in_seconds, base_tuning_job_name=base_tuning_job_name,
                   early_stopping_type=early_stopping_type, random_seed=random_seed, autotune=autotune,
                   ignored={"tags": tags, "warm_start_config": warm_start_config, "strategy_config": strategy_config,
                            "completion_criteria_config": completion_criteria_config,
                            "hyperparameters_to_keep_static": hyperparameters_to_keep_static})

    def _definitions(self) -> list[dict[str, str]]:
        return merge_definitions(self.estimator.args.get("metric_definitions"), self.metric_definitions)

    def _static(self) -> dict[str, Any]:
        return self.estimator.hyperparameters()

    def _base_name(self) -> str:
        return self.estimator.base_job_name or self.estimator.default_base_name

    def _job(self, inputs: Any, name: str) -> dict[str, Any]:
        fields = self.estimator._spec_fields(inputs, name)
        fields["metric_definitions"] = self._definitions()
        return fields

    def _config(self, **kwargs: Any):
        config = super()._config(**kwargs)
        cls = type(self.estimator)
        import dataclasses

        return dataclasses.replace(config, estimator_class=f"{cls.__module__}:{cls.__qualname__}")

    def fit(self, inputs: Any = None, job_name: str | None = None, include_cls_metadata: bool = False,
            estimator_kwargs: dict | None = None, wait: bool = True, **kwargs: Any) -> None:
        """Start the tuning job (and with ``wait``, follow it to its end)."""
        self._start(inputs, job_name, wait)

    def best_estimator(self, best_training_job: dict | None = None) -> EstimatorBase:
        """An estimator attached to the best trial's job (``model_data`` is its model)."""
        best = best_training_job or self._get_best_training_job()
        from .estimator import Estimator

        cls = type(self.estimator) if self.estimator is not None else getattr(self, "_estimator_cls", None)
        return (cls or Estimator).attach(best["TrainingJobName"])

    @classmethod
    def attach(cls, tuning_job_name: str, sagemaker_session=None, job_details=None, estimator_cls=None
               ) -> HyperparameterTuner:
        """A tuner for a recorded tuning job (then ``best_training_job()``, ``analytics()``, ``resume()``...)."""
        import importlib

        from . import tuning
        from .parameter import from_dict

        _, config = tuning.load_study(tuning_job_name)
        tuner = cls.__new__(cls)
        if estimator_cls is None and config.estimator_class:
            module, _, qualname = config.estimator_class.partition(":")
            estimator_cls = getattr(importlib.import_module(module), qualname)
        tuner.estimator, tuner._estimator_cls = None, estimator_cls
        tuner.objective_metric_name = config.objective_metric_name
        tuner._hyperparameter_ranges = {name: from_dict(data) for name, data in config.ranges.items()}
        tuner.metric_definitions = config.job.get("metric_definitions")
        tuner.strategy, tuner.objective_type = config.strategy, config.objective_type
        tuner.max_jobs, tuner.max_parallel_jobs = config.max_jobs, config.max_parallel_jobs
        tuner.max_runtime_in_seconds, tuner.base_tuning_job_name = config.max_runtime_in_seconds, None
        tuner.early_stopping_type, tuner.random_seed = config.early_stopping_type, config.random_seed
        tuner.latest_tuning_job = TuningJob(tuning_job_name)
        tuner._current_job_name = tuning_job_name
        return tuner


__all__ = ["CategoricalParameter", "ContinuousParameter", "GRID_SEARCH", "HYPERBAND", "HyperparameterTuner",
           "IntegerParameter", "ParameterRange"]
