"""What the v2 and v3 ``HyperparameterTuner`` share: arguments, the tuning job's start, its results.

A tuner checks its arguments, then at ``fit``/``tune`` turns the estimator or ModelTrainer into
the trials' job fields, checks one trial's job as ``disttrain.Job`` would (bad input: one line,
nothing recorded), creates the tuning job (:mod:`.tuning`) and starts its loop
(:mod:`.tunerloop`) in a child process whose output goes to the tuning job's log file, so the
tuning job outlives the notebook that started it; ``wait()`` follows that file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import DisttrainError, UsageError
from ..process_start import same_process
from . import tuning
from .parameter import ParameterRange
from .tuning import RUNNER, STATE, TuningConfig


class TuningJob:
    """``tuner.latest_tuning_job``: v2's ``.name``/``.wait()``/``.stop()``, v3's resource attributes
    (``hyper_parameter_tuning_job_name``, ``hyper_parameter_tuning_job_status``,
    ``best_training_job``, ``refresh()``)."""

    def __init__(self, name: str, process: subprocess.Popen | None = None) -> None:
        self.name = self.hyper_parameter_tuning_job_name = name
        self._process = process
        self.hyper_parameter_tuning_job_status: str | None = None
        self.best_training_job = None

    def __repr__(self) -> str:
        return f"<disttrain.sagemaker tuning job {self.name}>"

    def describe(self) -> dict[str, Any]:
        return tuning.describe(self.name)

    def refresh(self) -> TuningJob:
        from types import SimpleNamespace

        described = self.describe()
        self.hyper_parameter_tuning_job_status = described["HyperParameterTuningJobStatus"]
        top = described.get("BestTrainingJob")
        self.best_training_job = None if top is None else SimpleNamespace(
            training_job_name=top["TrainingJobName"], training_job_status=top["TrainingJobStatus"],
            tuned_hyper_parameters=top["TunedHyperParameters"], training_job_definition_name=None,
            final_hyper_parameter_tuning_job_objective_metric=SimpleNamespace(
                metric_name=top["FinalHyperParameterTuningJobObjectiveMetric"]["MetricName"],
                value=top["FinalHyperParameterTuningJobObjectiveMetric"]["Value"]))
        self.training_job_status_counters = described["TrainingJobStatusCounters"]
        return self

    def _done(self) -> bool:
        if self._process is not None:
            return self._process.poll() is not None
        study, _ = tuning.load_study(self.name)
        return study.user_attrs.get(STATE) != "InProgress" or not _runner_alive(study)

    def wait(self, logs: bool = True) -> None:
        """Until the tuning job ends, printing its log; raises when it Failed (Stopped returns)."""
        log, offset = log_path(self.name), 0
        while True:
            done = self._done()
            offset = _show(log, offset) if logs else offset
            if done:
                break
            time.sleep(0.5)
        state = self.refresh().hyper_parameter_tuning_job_status
        if state == "Failed":
            from .exceptions import UnexpectedStatusException

            raise UnexpectedStatusException(f"Error for HyperParameterTuning job {self.name}: Failed "
                                            f"(see {log})")

    def stop(self) -> None:
        """Stop the loop and its running trials (they are recorded Stopped); returns once stopped."""
        study, _ = tuning.load_study(self.name)
        runner = study.user_attrs.get(RUNNER)
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            self._process.wait()
        elif runner and _runner_alive(study):
            os.kill(runner["pid"], signal.SIGTERM)
            while _runner_alive(study):
                time.sleep(0.3)
        else:
            study.set_user_attr(STATE, "Stopped")


def _runner_alive(study) -> bool:
    import socket

    runner = study.user_attrs.get(RUNNER)
    if not runner or runner.get("host") != socket.gethostname():
        return False
    return same_process(runner["pid"], runner.get("started"))


def log_path(name: str) -> Path:
    return tuning.storage_path().parent / "tuning" / f"{name}.log"


def _show(path: Path, offset: int) -> int:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return offset
    if data:
        sys.stdout.write(data.decode(errors="replace"))
        sys.stdout.flush()
    return offset + len(data)


def start_loop(name: str) -> subprocess.Popen:
    """The tuning job's loop in its own process and session; its output appended to its log."""
    log = log_path(name)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "disttrain.sagemaker.tunerloop", name], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


class TunerBase:
    """Arguments and methods common to both SDK versions' ``HyperparameterTuner``."""

    kind = "estimator"

    def _init(self, *, objective_metric_name: str, hyperparameter_ranges: dict[str, ParameterRange],
              metric_definitions: list[dict[str, str]] | None, strategy: str, objective_type: str,
              max_jobs: int | None, max_parallel_jobs: int, max_runtime_in_seconds: int | None,
              base_tuning_job_name: str | None, early_stopping_type: str, random_seed: int | None,
              autotune: bool, ignored: dict[str, Any]) -> None:
        if autotune:
            raise UsageError("HyperparameterTuner: autotune=True is SageMaker's own range chooser, not available "
                             "here; give hyperparameter_ranges")
        named = [key for key, value in ignored.items() if value not in (None, False, [], {})]
        if named:
            print(f"disttrain: ignored on your own machines: {', '.join(named)}", file=sys.stderr, flush=True)
        if not isinstance(hyperparameter_ranges, dict) or not hyperparameter_ranges:
            raise UsageError("HyperparameterTuner: hyperparameter_ranges must be a non-empty dict of "
                             "ContinuousParameter/IntegerParameter/CategoricalParameter")
        for key, value in hyperparameter_ranges.items():
            if not isinstance(value, ParameterRange):
                raise UsageError(f"hyperparameter_ranges[{key!r}] must be a ContinuousParameter, IntegerParameter or "
                                 f"CategoricalParameter, got {value!r}")
        self.objective_metric_name = objective_metric_name
        self._hyperparameter_ranges = dict(hyperparameter_ranges)
        self.metric_definitions = metric_definitions
        self.strategy, self.objective_type = strategy, objective_type
        grid = strategy == "Grid"
        self.max_jobs = max_jobs if max_jobs is not None or grid else 1
        self.max_parallel_jobs, self.max_runtime_in_seconds = max_parallel_jobs, max_runtime_in_seconds
        self.base_tuning_job_name = base_tuning_job_name
        self.early_stopping_type, self.random_seed = early_stopping_type, random_seed
        self.latest_tuning_job: TuningJob | None = None
        self._current_job_name: str | None = None
        static = {k: v for k, v in self._static().items() if k not in self._hyperparameter_ranges}
        self._config(name="check", job={"metric_definitions": self._definitions(),
                                        "hyperparameters": static})  # the arguments, checked now

    # --- what each SDK version supplies ---
    def _definitions(self) -> list[dict[str, str]]:
        raise NotImplementedError

    def _static(self) -> dict[str, Any]:
        raise NotImplementedError

    def _job(self, inputs: Any, name: str) -> dict[str, Any]:
        raise NotImplementedError

    def _base_name(self) -> str:
        raise NotImplementedError

    # --- the tuning job ---
    def hyperparameter_ranges(self) -> dict[str, list[dict[str, Any]]]:
        ranges: dict[str, list] = {"ContinuousParameterRanges": [], "IntegerParameterRanges": [],
                                   "CategoricalParameterRanges": []}
        for name, value in self._hyperparameter_ranges.items():
            ranges[f"{value.kind}ParameterRanges"].append(value.as_tuning_range(name))
        return ranges

    def _config(self, *, name: str, job: dict[str, Any]) -> TuningConfig:
        ranges = {key: value.to_dict() for key, value in self._hyperparameter_ranges.items()}
        max_jobs = self.max_jobs
        if max_jobs is None:  # Grid: every combination
            max_jobs = len(TuningConfig(name="check", job=job, ranges=ranges, strategy="Grid",
                                        objective_metric_name=self.objective_metric_name).grid())
        return TuningConfig(name=name, job=job, ranges=ranges,
                            objective_metric_name=self.objective_metric_name, objective_type=self.objective_type,
                            strategy=self.strategy, max_jobs=max_jobs, max_parallel_jobs=self.max_parallel_jobs,
                            early_stopping_type=self.early_stopping_type, random_seed=self.random_seed,
                            max_runtime_in_seconds=self.max_runtime_in_seconds, kind=self.kind)

    def _start(self, inputs: Any, job_name: str | None, wait: bool) -> None:
        name = job_name or tuning.new_tuning_name(self.base_tuning_job_name or self._base_name())
        fields = self._job(inputs, name)
        fields["hyperparameters"] = {k: v for k, v in (fields.get("hyperparameters") or {}).items()
                                     if k not in self._hyperparameter_ranges}
        config = self._config(name=name, job=fields)
        _check_trial(config)
        tuning.create_study(config)
        self._current_job_name = name
        self.latest_tuning_job = TuningJob(name, start_loop(name))
        print(f"disttrain: tuning job {name}: {config.max_jobs} trial(s), {config.max_parallel_jobs} at a time, "
              f"{config.strategy}; `disttrain tune show {name}`", flush=True)
        if wait:
            self.latest_tuning_job.wait()

    def _ensure_last_tuning_job(self) -> TuningJob:
        if self.latest_tuning_job is None:
            raise UsageError("No tuning job available: call fit()/tune() first (or HyperparameterTuner.attach(name))")
        return self.latest_tuning_job

    def wait(self) -> None:
        self._ensure_last_tuning_job().wait()

    def stop_tuning_job(self) -> None:
        self._ensure_last_tuning_job().stop()

    def describe(self) -> dict[str, Any]:
        return self._ensure_last_tuning_job().describe()

    def _get_best_training_job(self) -> dict[str, Any]:
        described = self._ensure_last_tuning_job().describe()  # the dict, whichever shape describe() returns
        if "BestTrainingJob" not in described:
            raise DisttrainError(f"Best training job not available for tuning job: {self.latest_tuning_job.name}")
        return described["BestTrainingJob"]

    def best_training_job(self) -> str:
        return self._get_best_training_job()["TrainingJobName"]

    def analytics(self):
        from .analytics import HyperparameterTuningJobAnalytics

        return HyperparameterTuningJobAnalytics(self._ensure_last_tuning_job().name)

    def resume(self, wait: bool = True) -> None:
        """disttrain's own: go on with a tuning job whose loop was killed (``disttrain tune resume``)."""
        job = self._ensure_last_tuning_job()
        self.latest_tuning_job = TuningJob(job.name, start_loop(job.name))
        if wait:
            self.latest_tuning_job.wait()

    def deploy(self, *args: Any, **kwargs: Any):
        raise UsageError("deploy: endpoints are not part of disttrain (training only); the best model is at "
                         "best_estimator().model_data")


def _check_trial(config: TuningConfig) -> None:
    """One trial's job checked as ``disttrain.Job`` would (each range at its low end), before anything is made."""
    from .trainingjob import check_job

    sample = {}
    for name, value in config.parameter_ranges.items():
        sample[name] = value.values[0] if value.kind == "Categorical" else value.cast_to_type(value.min_value)
    fields = {**config.job, "hyperparameters": {**(config.job.get("hyperparameters") or {}), **sample}}
    check_job(fields, source=f"tuning job {config.name}")
