"""SageMaker-style jobs on your own machines: ``disttrain job run job.yaml`` or ``disttrain.Job(...).run()``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .spec import JobSpec, load_spec, spec_from_mapping


class Job:
    """A training job, SageMaker-estimator style::

        record = disttrain.Job(name="mnist", entry_point="train.py", instance_count=2,
                               inputs={"training": "s3://bucket/mnist"},
                               hyperparameters={"epochs": 3}).run()
        record.state, record.artifacts["model"], record.metrics

    Keys are those of a YAML job spec; relative paths are relative to the working
    directory. ``run()`` returns the job's record (Completed, Failed or Stopped).
    """

    def __init__(self, **fields: Any) -> None:
        self.spec: JobSpec = spec_from_mapping(fields, base_dir=os.getcwd(), source="disttrain.Job")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> Job:
        job = cls.__new__(cls)
        job.spec = load_spec(path)
        return job

    def run(self, *, store: str | os.PathLike | None = None):
        from .runner import run_job

        return run_job(self.spec, store=Path(store) if store else None)


__all__ = ["Job", "JobSpec", "load_spec", "spec_from_mapping"]
