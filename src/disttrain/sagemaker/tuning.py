"""Hyperparameter tuning jobs, kept in an Optuna study: what a tuning job is, and how it reads.

A tuning job is one Optuna study (its name is the study's), stored in SQLite beside the job
store (``jobs.db`` → ``jobs-tuning.db``). The study holds the job's configuration (the trials'
job fields, the ranges, the objective, the strategy) and its state; each Optuna trial holds
the name of the training job that ran it, and that job is an ordinary recorded job
(``disttrain jobs ls``; its name is ``<tuning job>-<NNN>-<8 hex>``, as SageMaker names them).
The loop that runs the trials is :mod:`.tunerloop`; the SDK-shaped tuners are :mod:`.tuner`
(v2, over an estimator) and ``train/tuner.py`` (v3, over a ModelTrainer).

Strategies map onto Optuna's samplers and pruners: ``Bayesian`` → TPE, ``Random`` → random
sampling, ``Grid`` → every combination in order (Categorical and Integer ranges),
``Hyperband`` → TPE with the Hyperband pruner over the objective's live series;
``early_stopping_type="Auto"`` → the median rule (SageMaker's: a trial whose objective is
behind the median of earlier trials at the same point is stopped).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .parameter import ParameterRange, from_dict

STRATEGIES = ("Bayesian", "Random", "Grid", "Hyperband")
OBJECTIVE_TYPES = ("Maximize", "Minimize")
EARLY_STOPPING_TYPES = ("Off", "Auto")
NAME_RULE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,31}$")  # SageMaker's, 32 characters
STATES = ("InProgress", "Completed", "Stopping", "Stopped", "Failed")
# The median rule: decide only once two trials have ended, and never on a trial's first point.
MEDIAN_STARTUP_TRIALS = 2
MEDIAN_WARMUP_POINTS = 1
CONFIG, STATE, RUNNER, CREATED, ENDED = ("disttrain:config", "disttrain:state", "disttrain:runner",
                                         "disttrain:created", "disttrain:ended")


@dataclass(frozen=True, kw_only=True)
class TuningConfig:
    """A tuning job's settings, validated once; errors name the SDK argument."""

    name: str
    job: dict[str, Any]  # the trials' job fields (disttrain.Job keys); hyperparameters: the static ones
    ranges: dict[str, dict[str, Any]]  # {hyperparameter: ParameterRange.to_dict()}
    objective_metric_name: str
    objective_type: str = "Maximize"
    strategy: str = "Bayesian"
    max_jobs: int = 1
    max_parallel_jobs: int = 1
    early_stopping_type: str = "Off"
    random_seed: int | None = None
    max_runtime_in_seconds: int | None = None
    kind: str = "estimator"  # estimator (v2) | model_trainer (v3): which SDK object made it
    estimator_class: str | None = None  # module:qualname of the v2 estimator (best_estimator after attach)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME_RULE.match(self.name):
            raise UsageError(f"tuning job name must be 1-32 letters, digits and hyphens (SageMaker's rule), "
                             f"got {self.name!r}")
        if not self.ranges:
            raise UsageError("hyperparameter_ranges is empty: give at least one range to tune")
        for name, data in self.ranges.items():
            from_dict(data).check(name)
        defined = [d["Name"] for d in self.job.get("metric_definitions") or []]
        if self.objective_metric_name not in defined:
            raise UsageError(f"objective_metric_name {self.objective_metric_name!r} has no metric definition "
                             f"(defined: {', '.join(defined) or 'none'}); add {{'Name': "
                             f"{self.objective_metric_name!r}, 'Regex': ...}} to metric_definitions")
        _choice("objective_type", self.objective_type, OBJECTIVE_TYPES)
        _choice("strategy", self.strategy, STRATEGIES)
        _choice("early_stopping_type", self.early_stopping_type, EARLY_STOPPING_TYPES)
        if self.strategy == "Hyperband" and self.early_stopping_type != "Off":
            raise UsageError("early_stopping_type must be 'Off' with strategy 'Hyperband' (Hyperband stops "
                             "trials itself)")
        if self.strategy == "Grid":
            kinds = [n for n, d in self.ranges.items() if d["type"] == "Continuous"]
            if kinds:
                raise UsageError(f"strategy 'Grid' needs Categorical or Integer ranges; {kinds[0]!r} is Continuous")
        for key in ("max_jobs", "max_parallel_jobs"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{key} must be a positive integer, got {value!r}")
        if self.max_runtime_in_seconds is not None and (not isinstance(self.max_runtime_in_seconds, int)
                                                        or self.max_runtime_in_seconds < 1):
            raise UsageError(f"max_runtime_in_seconds must be a positive integer, got {self.max_runtime_in_seconds!r}")
        static = set(self.job.get("hyperparameters") or {})
        both = sorted(static & set(self.ranges))
        if both:
            raise UsageError(f"hyperparameter {both[0]!r} is both static and tuned; keep it in one place")

    @property
    def parameter_ranges(self) -> dict[str, ParameterRange]:
        return {name: from_dict(data) for name, data in self.ranges.items()}

    @property
    def direction(self) -> str:
        return self.objective_type.lower()

    def grid(self) -> list[dict[str, Any]]:
        """Every combination of the ranges, in order (strategy Grid)."""
        axes = []
        for name, data in self.ranges.items():
            values = data["values"] if data["type"] == "Categorical" else list(range(int(data["min"]),
                                                                                      int(data["max"]) + 1))
            axes.append([(name, v) for v in values])
        return [dict(combo) for combo in itertools.product(*axes)]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TuningConfig:
        return cls(**json.loads(text))


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UsageError(f"{key} must be one of {', '.join(choices)}, got {value!r}")


def new_tuning_name(base: str) -> str:
    """``<base>-<yymmdd-HHMMSS>-<4 hex>`` in SageMaker's 32 characters."""
    import secrets

    base = re.sub(r"[^A-Za-z0-9-]+", "-", base).strip("-")[:13].rstrip("-") or "tuning"
    return f"{base}-{time.strftime('%y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


# --- the study ------------------------------------------------------------------------------

def _optuna():
    try:
        import optuna
    except ImportError:
        raise UsageError("HyperparameterTuner needs Optuna: pip install 'disttrain[tune]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def storage_path(store: str | Path | None = None) -> Path:
    """The tuning jobs' SQLite file: beside the job store (``jobs.db`` → ``jobs-tuning.db``)."""
    from ..store.db import default_store_path

    path = Path(store) if store else default_store_path()
    return path.with_name(f"{path.stem}-tuning.db")


def storage(store: str | Path | None = None):
    optuna = _optuna()
    path = storage_path(store)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return optuna.storages.RDBStorage(f"sqlite:///{path}", engine_kwargs={"connect_args": {"timeout": 30}})
    except Exception as err:  # SQLAlchemy/SQLite errors, named with the file; the first line of their text
        said = str(getattr(err, "orig", None) or err).splitlines()[0]  # SQLAlchemy's adds SQL and a link
        raise UsageError(f"cannot open the tuning store {path}: {type(err).__name__}: {said}") from None


def sampler_and_pruner(config: TuningConfig, asked: int = 0):
    """Optuna's sampler and pruner for the strategy; ``asked``: trials asked for already (a resumed
    loop's sampler does not replay the sequence a seed gave the first one)."""
    optuna = _optuna()
    seed = None if config.random_seed is None else config.random_seed + asked
    if config.strategy == "Random":
        sampler = optuna.samplers.RandomSampler(seed=seed)
    elif config.strategy == "Grid":  # every point is enqueued in order; the sampler is never asked
        sampler = optuna.samplers.RandomSampler(seed=seed)
    else:
        sampler = optuna.samplers.TPESampler(seed=seed)
    if config.strategy == "Hyperband":
        pruner = optuna.pruners.HyperbandPruner(min_resource=1, max_resource="auto")
    elif config.early_stopping_type == "Auto":
        pruner = optuna.pruners.MedianPruner(n_startup_trials=MEDIAN_STARTUP_TRIALS,
                                             n_warmup_steps=MEDIAN_WARMUP_POINTS)
    else:
        pruner = optuna.pruners.NopPruner()
    return sampler, pruner


def create_study(config: TuningConfig, store: str | Path | None = None):
    """A new tuning job (InProgress, no trials yet); an existing name is a one-line error."""
    optuna = _optuna()
    sampler, pruner = sampler_and_pruner(config)
    try:
        study = optuna.create_study(storage=storage(store), study_name=config.name, direction=config.direction,
                                    sampler=sampler, pruner=pruner)
    except optuna.exceptions.DuplicatedStudyError:
        raise UsageError(f"a tuning job named {config.name} exists already (disttrain tune show {config.name}; "
                         f"to go on with it: disttrain tune resume {config.name})") from None
    study.set_user_attr(CONFIG, config.to_json())
    study.set_user_attr(STATE, "InProgress")
    study.set_user_attr(CREATED, time.time())
    if config.strategy == "Grid":
        for params in config.grid()[:config.max_jobs]:
            study.enqueue_trial(params)
    return study


def load_study(name: str, store: str | Path | None = None):
    optuna = _optuna()
    try:
        summary = optuna.study.load_study(study_name=name, storage=storage(store))
    except KeyError:
        raise UsageError(f"no tuning job {name!r} in {storage_path(store)} (see `disttrain tune ls`)") from None
    config = TuningConfig.from_json(summary.user_attrs[CONFIG])
    sampler, pruner = sampler_and_pruner(config, asked=len(summary.trials))
    return optuna.study.load_study(study_name=name, storage=storage(store), sampler=sampler, pruner=pruner), config


def tuning_names(store: str | Path | None = None) -> list[str]:
    """Every tuning job, newest first (none where no tuning store exists yet: none is made to list them)."""
    from ..store import JobStore
    from ..store.db import default_store_path

    job_store = Path(store) if store else default_store_path()
    if job_store.exists():
        JobStore(job_store).close()  # a store that is not one (damaged, another program's) is named first
    if not storage_path(store).exists():
        return []
    optuna = _optuna()
    summaries = optuna.study.get_all_study_summaries(storage=storage(store), include_best_trial=False)
    summaries.sort(key=lambda s: s.user_attrs.get(CREATED, 0), reverse=True)
    return [s.study_name for s in summaries]


# --- reading a tuning job -------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class TrialSummary:
    """One trial as ListTrainingJobsForHyperParameterTuningJob shows it, from the study and the job store."""

    number: int
    job: str | None
    params: dict[str, Any]
    status: str  # the training job's TrainingJobStatus
    value: float | None  # FinalObjectiveValue: the objective's last point
    objective_status: str  # Succeeded | Pending | Failed
    early_stopped: bool
    started: float | None
    ended: float | None


def summaries(study, config: TuningConfig, store: str | Path | None = None) -> list[TrialSummary]:
    from ..jobs.control import refresh
    from ..store import JobStore
    from .trainingjob import STATUS

    optuna = _optuna()
    found = []
    with JobStore(store) as jobs:
        for trial in study.get_trials(deepcopy=False):
            if trial.state == optuna.trial.TrialState.WAITING:
                continue  # a grid point not started yet
            job = trial.user_attrs.get("job")
            try:
                record = refresh(jobs, jobs.get(job)) if job else None
            except UsageError:
                record = None
            status = STATUS.get(str(record.state), str(record.state)) if record else "InProgress"
            pruned = trial.state == optuna.trial.TrialState.PRUNED
            if trial.state == optuna.trial.TrialState.COMPLETE:
                objective = "Succeeded"
            elif trial.state == optuna.trial.TrialState.RUNNING:
                objective = "Pending"
            else:
                objective = "Failed"
            found.append(TrialSummary(
                number=trial.number, job=job, status=status,
                params={name: trial.params[name] for name in config.ranges if name in trial.params},
                value=trial.value if trial.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
                else None, objective_status=objective, early_stopped=pruned,
                started=record.started if record else None, ended=record.ended if record else None))
    return found


def best(trials: list[TrialSummary], config: TuningConfig) -> TrialSummary | None:
    """The completed trial with the best objective (SageMaker's BestTrainingJob)."""
    done = [t for t in trials if t.objective_status == "Succeeded" and t.value is not None]
    if not done:
        return None
    pick = max if config.objective_type == "Maximize" else min
    return pick(done, key=lambda t: t.value)


def _job_summary(trial: TrialSummary, config: TuningConfig) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "TrainingJobName": trial.job,
        "TrainingJobStatus": trial.status,
        "TunedHyperParameters": {k: str(v) for k, v in trial.params.items()},
        "ObjectiveStatus": trial.objective_status,
        "TrainingStartTime": trial.started,
        "TrainingEndTime": trial.ended,
    }
    if trial.value is not None:
        summary["FinalHyperParameterTuningJobObjectiveMetric"] = {"MetricName": config.objective_metric_name,
                                                                  "Value": trial.value}
    return summary


def describe(name: str, store: str | Path | None = None) -> dict[str, Any]:
    """DescribeHyperParameterTuningJob's shape, plus ``TrainingJobSummaries`` (the trials)."""
    study, config = load_study(name, store)
    trials = summaries(study, config, store)
    counters = {"Completed": 0, "InProgress": 0, "RetryableError": 0, "NonRetryableError": 0, "Stopped": 0}
    for trial in trials:
        key = {"Failed": "NonRetryableError"}.get(trial.status, trial.status)
        counters[key] = counters.get(key, 0) + 1
    objective = {"Succeeded": 0, "Pending": 0, "Failed": 0}
    for trial in trials:
        objective[trial.objective_status] += 1
    ranges: dict[str, list] = {"ContinuousParameterRanges": [], "IntegerParameterRanges": [],
                               "CategoricalParameterRanges": []}
    for param, parameter_range in config.parameter_ranges.items():
        ranges[f"{parameter_range.kind}ParameterRanges"].append(parameter_range.as_tuning_range(param))
    described = {
        "HyperParameterTuningJobName": name,
        "HyperParameterTuningJobStatus": study.user_attrs.get(STATE, "InProgress"),
        "HyperParameterTuningJobConfig": {
            "Strategy": config.strategy,
            "HyperParameterTuningJobObjective": {"Type": config.objective_type,
                                                 "MetricName": config.objective_metric_name},
            "ResourceLimits": {"MaxNumberOfTrainingJobs": config.max_jobs,
                               "MaxParallelTrainingJobs": config.max_parallel_jobs,
                               **({"MaxRuntimeInSeconds": config.max_runtime_in_seconds}
                                  if config.max_runtime_in_seconds else {})},
            "ParameterRanges": ranges,
            "TrainingJobEarlyStoppingType": config.early_stopping_type,
            **({"RandomSeed": config.random_seed} if config.random_seed is not None else {}),
        },
        "TrainingJobDefinition": {"StaticHyperParameters": {k: str(v) for k, v in
                                                            (config.job.get("hyperparameters") or {}).items()},
                                  "MetricDefinitions": list(config.job.get("metric_definitions") or [])},
        "TrainingJobStatusCounters": counters,
        "ObjectiveStatusCounters": objective,
        "CreationTime": study.user_attrs.get(CREATED),
        "HyperParameterTuningEndTime": study.user_attrs.get(ENDED),
        "TrainingJobSummaries": [_job_summary(t, config) for t in trials],
    }
    top = best(trials, config)
    if top is not None:
        described["BestTrainingJob"] = _job_summary(top, config)
    return described


def describe_tuning_job(name: str) -> dict[str, Any]:
    return describe(name)
