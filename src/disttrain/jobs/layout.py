"""The job directory: one class owns where everything of a job lives on disk, and who may read it.

The job's folder, each instance's and the logs' are made 0700: what they hold (hyperparameters,
which may be secrets, the logs, the model) is the job's owner's only, as the job store is.

::

    <job dir>/                         $DISTTRAIN_HOME/jobs/<job name>
      algo-1/                          instance 1, laid out as SageMaker's /opt/ml
        input/config/hyperparameters.json
        input/config/resourceconfig.json
        input/data/<channel>/          linked to a local input, or to the staged copy
        model/                         SM_MODEL_DIR  -> model.tar.gz
        output/data/                   SM_OUTPUT_DATA_DIR -> output.tar.gz
        output/intermediate/           SM_OUTPUT_INTERMEDIATE_DIR
        output/success | failure       how it ended (failure: the root cause)
        checkpoints/                   checkpoint_local_path (/opt/ml/checkpoints)
      algo-2/ ...
      channels/<channel>/              inputs copied from URLs, once for all instances
      code/                            source_dir when it was a tarball
      checkpoints/                     DISTTRAIN_CHECKPOINT_DIR (disttrain.resume, max_restarts)
      logs/                            the launch's run folder: job.log, plan.json, attempt_<k>/rank<R>.*
      packed/                          model.tar.gz, output.tar.gz before upload
      venv/                            the job's own environment (requirements.txt)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def instance_names(count: int) -> tuple[str, ...]:
    """SageMaker's host names: algo-1 .. algo-N."""
    return tuple(f"algo-{i}" for i in range(1, count + 1))


@dataclass(frozen=True)
class InstancePaths:
    """One instance's ``/opt/ml``."""

    root: Path

    @property
    def input(self) -> Path:
        return self.root / "input"

    @property
    def config(self) -> Path:
        return self.root / "input" / "config"

    @property
    def data(self) -> Path:
        return self.root / "input" / "data"

    def channel(self, name: str) -> Path:
        return self.data / name

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def output(self) -> Path:
        return self.root / "output"

    @property
    def output_data(self) -> Path:
        return self.root / "output" / "data"

    @property
    def output_intermediate(self) -> Path:
        return self.root / "output" / "intermediate"

    @property
    def failure(self) -> Path:
        return self.root / "output" / "failure"

    @property
    def success(self) -> Path:
        return self.root / "output" / "success"

    @property
    def checkpoints(self) -> Path:
        """``/opt/ml/checkpoints``: checkpoint_local_path's default, synced to checkpoint_s3_uri."""
        return self.root / "checkpoints"

    def create(self) -> None:
        private_folder(self.root)
        for folder in (self.config, self.data, self.model, self.output_data, self.output_intermediate,
                       self.checkpoints):
            folder.mkdir(parents=True, exist_ok=True)


@dataclass(frozen=True)
class JobLayout:
    root: Path
    instance_names: tuple[str, ...]  # algo-1 first

    def instance(self, name: str) -> InstancePaths:
        return InstancePaths(self.root / name)

    @property
    def instances(self) -> tuple[InstancePaths, ...]:
        return tuple(self.instance(h) for h in self.instance_names)

    @property
    def first(self) -> InstancePaths:
        return self.instance(self.instance_names[0])

    def staged_channel(self, name: str) -> Path:
        return self.root / "channels" / name

    @property
    def code(self) -> Path:
        return self.root / "code"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def transcript(self) -> Path:
        """Everything the job printed, as the terminal showed it (``disttrain jobs logs``)."""
        return self.logs / "job.log"

    @property
    def packed(self) -> Path:
        return self.root / "packed"

    @property
    def venv(self) -> Path:
        """The job's own environment, when its code has a requirements.txt."""
        return self.root / "venv"

    @property
    def venv_python(self) -> Path:
        return self.venv / "bin" / "python"

    def create(self) -> None:
        private_folder(self.root)  # first: nothing below it is reachable by another user from now on
        for instance in self.instances:
            instance.create()
        private_folder(self.logs)
        self.checkpoints.mkdir(parents=True, exist_ok=True)


def private_folder(path: Path) -> Path:
    """``path`` (and missing parents, with the usual mode) as a folder only its owner may enter."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir(mode=0o700, exist_ok=True)
    if path.stat().st_uid == os.getuid():
        path.chmod(0o700)  # it existed (a rerun of a named job, a Slurm batch step) with another mode
    return path
