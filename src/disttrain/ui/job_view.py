"""What ``disttrain ui`` shows of the job store and of the tuning jobs: read through their own readers
(:class:`disttrain.store.JobStore`, :func:`disttrain.sagemaker.tuning.describe`), never written."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..store import JobStore
from ..store.db import JobRecord
from .runs_list import cause_line, planned_world_size


@dataclass(frozen=True, kw_only=True)
class JobRow:
    """One line of the jobs list."""

    name: str
    status: str
    started: float | None
    ended: float | None
    hosts: tuple[str, ...]
    world_size: int | None
    exit_code: int | None
    cause: str | None
    objective: float | None = None  # a tuner's trial: its final objective value

    @property
    def duration(self) -> float | None:
        if self.started is None:
            return None
        return (self.ended if self.ended is not None else time.time()) - self.started


@dataclass(frozen=True, kw_only=True)
class TuningGroup:
    """A tuning job and its trials (each an ordinary job of the store)."""

    name: str
    status: str
    strategy: str
    objective: str  # "Minimize loss"
    best_job: str | None
    best_value: float | None
    trials: list[JobRow] = field(default_factory=list)
    created: float | None = None


def world_size(record: JobRecord) -> int | None:
    """The processes of the job: its last membership round's world size, else instances x processes."""
    for change in reversed(record.membership or []):
        if isinstance(change, dict) and isinstance(change.get("world_size"), int):
            return change["world_size"]
    spec = record.spec if isinstance(record.spec, dict) else {}
    count = spec.get("instance_count")
    per = spec.get("processes_per_instance")  # "auto": known once the job ran (its membership, above)
    if isinstance(count, int) and isinstance(per, int):
        return count * per
    return None


def host_name(host: Any) -> str:
    """A job's host as the store keeps it: a name, or ``{"instance": "algo-1", "host": "vm"}``."""
    if isinstance(host, dict):
        instance, machine = host.get("instance"), host.get("host")
        return f"{instance} ({machine})" if instance and machine else str(instance or machine or "?")
    return str(host)


def job_row(record: JobRecord) -> JobRow:
    size = world_size(record)
    if size is None and record.log_dir:  # its run's plan says it, once the job started
        size = planned_world_size(Path(record.log_dir))
    return JobRow(name=record.name, status=str(record.state), started=record.started or record.created,
                  ended=record.ended, hosts=tuple(host_name(h) for h in record.hosts or ()),
                  world_size=size, exit_code=record.exit_code, cause=cause_line(record.failure))


def read_jobs(store: Path) -> list[JobRecord]:
    """Every recorded job, newest first; none where no store exists (a view makes no store)."""
    if not store.is_file():
        return []
    with JobStore(store) as jobs:
        return jobs.list()


def read_job(store: Path, name: str) -> tuple[JobRecord, dict[str, list[tuple[float, float]]]]:
    with JobStore(store) as jobs:
        record = jobs.get(name)
        return record, jobs.metric_series(record.id)


def tuning_groups(store: Path, rows: dict[str, JobRow]) -> list[TuningGroup]:
    """Every tuning job of the store, newest first, with its trials' rows (taken out of ``rows``)."""
    from ..sagemaker.tuning import storage_path

    if not storage_path(store).is_file():
        return []  # no Optuna import where there is nothing to read
    from ..sagemaker.tuning import describe, tuning_names

    groups = []
    for name in tuning_names(store):
        d = describe(name, store)
        config = d["HyperParameterTuningJobConfig"]
        objective = config["HyperParameterTuningJobObjective"]
        best = d.get("BestTrainingJob") or {}
        trials = []
        for summary in d["TrainingJobSummaries"]:
            metric = summary.get("FinalHyperParameterTuningJobObjectiveMetric") or {}
            base = rows.pop(summary.get("TrainingJobName") or "", None)
            trial = JobRow(name=summary.get("TrainingJobName") or "-", status=summary.get("TrainingJobStatus") or "-",
                           started=summary.get("TrainingStartTime"), ended=summary.get("TrainingEndTime"),
                           hosts=base.hosts if base else (), world_size=base.world_size if base else None,
                           exit_code=base.exit_code if base else None, cause=base.cause if base else None,
                           objective=metric.get("Value"))
            trials.append(trial)
        metric = best.get("FinalHyperParameterTuningJobObjectiveMetric") or {}
        groups.append(TuningGroup(name=name, status=d["HyperParameterTuningJobStatus"], strategy=config["Strategy"],
                                  objective=f"{objective['Type']} {objective['MetricName']}",
                                  best_job=best.get("TrainingJobName"), best_value=metric.get("Value"),
                                  trials=trials, created=d.get("CreationTime")))
    return groups


def spec_items(record: JobRecord) -> list[tuple[str, Any]]:
    """The parts of a job's spec a person looks for first: hyperparameters, channels, instances, output."""
    spec = record.spec if isinstance(record.spec, dict) else {}
    keys = ("entry_point", "launcher", "instance_count", "processes_per_instance", "instance_type",
            "hyperparameters", "inputs", "output_path", "checkpoint_s3_uri")
    return [(k, spec[k]) for k in keys if spec.get(k) not in (None, {}, [])]
