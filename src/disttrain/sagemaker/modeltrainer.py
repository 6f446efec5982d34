"""SDK v3's ``ModelTrainer`` (``sagemaker.train.ModelTrainer``, v2's ``sagemaker.modules.train``).

Each ``train()`` is one recorded job (``disttrain jobs ls``) run in a child process, with
SDK v3's container contract (``contract: model_trainer``, see disttrain.jobs.sagemaker_v3):
v3's hyperparameter rendering, ``SM_HOST_COUNT``/``SM_CURRENT_HOST_RANK``/``SM_MASTER_ADDR``,
``/opt/ml/input/sm_training.env``, ``SourceCode(command=...)`` run through bash in each
instance. Both training modes run here, without Docker.

Arguments fall in three groups, as for the estimators: used (code, compute, distributed,
inputs, outputs, checkpoints, stopping condition, environment, hyperparameters, metrics);
accepted and named once as ignored (role, training image, networking, tags, ...); anything else
a ``TypeError`` naming it (the SDK's pydantic model refuses extra fields too).
"""

from __future__ import annotations

import enum
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from ..errors import UsageError
from . import buckets
from .configs import (
    Channel,
    CheckpointConfig,
    Compute,
    FileSystemDataSource,
    InputData,
    MetricDefinition,
    OutputDataConfig,
    S3DataSource,
    SourceCode,
    StoppingCondition,
    TensorBoardOutputConfig,
)
from .distributed import SMP, DistributedConfig, Torchrun
from .estimator import _instance_note, _placement
from .inputs import TrainingInput
from .resources import TrainingJob
from .trainingjob import check_job, start_job

DEFAULT_INSTANCE_TYPE = "ml.m5.xlarge"  # the SDK's default Compute
REQUIREMENTS = "requirements.txt"  # what the job installs from source_dir (disttrain.jobs.requirements)


class Mode(enum.Enum):
    LOCAL_CONTAINER = "LOCAL_CONTAINER"
    SAGEMAKER_TRAINING_JOB = "SAGEMAKER_TRAINING_JOB"


def _base_name(base_job_name: str | None, training_image: str | None, algorithm_name: str | None) -> str:
    """The SDK's default: the algorithm's name or the image's repository name; then what a job
    name may hold (letters, digits, hyphens)."""
    name = base_job_name or algorithm_name
    if not name and training_image:
        name = training_image.rsplit("/", 1)[-1].split(":", 1)[0].split("@", 1)[0]
    name = re.sub(r"[^A-Za-z0-9-]+", "-", name or "model-trainer").strip("-")[:42].rstrip("-")
    return name or "model-trainer"


def _location(channel: Any, where: str) -> tuple[str, str]:
    """An InputData, a Channel or a TrainingInput → (channel name, path or URL)."""
    if isinstance(channel, InputData):
        name, source = channel.channel_name, channel.data_source
    elif isinstance(channel, Channel):
        name = channel.channel_name
        data = channel.data_source
        source = data and (data.s3_data_source or data.file_system_data_source)
    else:
        raise UsageError(f"{where}: expected InputData or Channel objects, got {channel!r}")
    if isinstance(source, S3DataSource):
        source = source.s3_uri
    elif isinstance(source, FileSystemDataSource):
        source = source.directory_path
    elif isinstance(source, TrainingInput):
        source = source.location
    if not isinstance(name, str) or not name:
        raise UsageError(f"{where}: a channel needs a channel_name, got {channel!r}")
    if not isinstance(source, str) or not source:
        raise UsageError(f"{where}: channel {name} needs a data_source (a path, an s3:// URL or an S3DataSource)")
    return name, source


def channels(inputs: Any, where: str = "input_data_config") -> dict[str, str]:
    """A list of InputData/Channel objects, a dict {channel: location}, or one location (the
    ``training`` channel, as the tuner's ``tune(inputs="s3://...")``) → {channel: location}."""
    if inputs is None:
        return {}
    if isinstance(inputs, (str, TrainingInput)):
        inputs = {"training": inputs}
    if isinstance(inputs, dict):
        return {name: value.location if isinstance(value, TrainingInput) else value for name, value in inputs.items()}
    if not isinstance(inputs, (list, tuple)):
        raise UsageError(f"{where}: expected a list of InputData, got {inputs!r}")
    return dict(_location(channel, where) for channel in inputs)


def _hyperparameters(value: Any) -> dict[str, Any]:
    """A dict, or a JSON/YAML file of one (as the SDK reads it)."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    if not isinstance(value, str):
        raise UsageError(f"ModelTrainer: hyperparameters must be a dict or a JSON/YAML file, got {value!r}")
    try:
        text = Path(value).read_text()
    except OSError as err:
        raise UsageError(f"ModelTrainer: hyperparameters file {value}: {err.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            data = None
    if not isinstance(data, dict):
        raise UsageError(f"ModelTrainer: hyperparameters file {value} is not a JSON or YAML mapping")
    return data


class ModelTrainer:
    """``ModelTrainer(source_code=SourceCode(...), compute=Compute(...), distributed=Torchrun(), ...)``."""

    def __init__(self, *, training_mode: Mode | str = Mode.SAGEMAKER_TRAINING_JOB, sagemaker_session=None,
                 role: str | None = None, base_job_name: str | None = None, source_code: SourceCode | None = None,
                 distributed: DistributedConfig | None = None, compute: Compute | None = None, networking=None,
                 stopping_condition: StoppingCondition | None = None, training_image: str | None = None,
                 training_image_config=None, algorithm_name: str | None = None,
                 output_data_config: OutputDataConfig | None = None, input_data_config: list | None = None,
                 checkpoint_config: CheckpointConfig | None = None, training_input_mode: str | None = "File",
                 environment: dict[str, str] | None = None, hyperparameters: dict | str | None = None,
                 tags: list | None = None, local_container_root: str | None = None, model_package_config=None,
                 disttrain: dict[str, Any] | None = None) -> None:
        ignored = {"role": role, "training_image": training_image, "training_image_config": training_image_config,
                   "algorithm_name": algorithm_name, "networking": networking, "tags": tags,
                   "model_package_config": model_package_config,
                   "training_input_mode": None if training_input_mode == "File" else training_input_mode,
                   "distributed.smp": getattr(distributed, "smp", None)}
        named = [key for key, value in ignored.items() if value not in (None, False, [])]
        if named:
            print(f"disttrain: ignored on your own machines: {', '.join(named)}", file=sys.stderr, flush=True)
        try:
            self.training_mode = Mode(training_mode.value if isinstance(training_mode, Mode) else training_mode)
        except ValueError:
            raise UsageError(f"ModelTrainer: training_mode must be Mode.SAGEMAKER_TRAINING_JOB or "
                             f"Mode.LOCAL_CONTAINER, got {training_mode!r}") from None
        self._check_code(source_code, distributed)
        self.sagemaker_session = sagemaker_session
        self.role, self.training_image, self.algorithm_name = role, training_image, algorithm_name
        self.base_job_name = _base_name(base_job_name, training_image, algorithm_name)
        self.source_code, self.distributed = source_code, distributed
        self.compute = compute or Compute(instance_type=DEFAULT_INSTANCE_TYPE, instance_count=1)
        if self.compute.instance_groups:
            raise UsageError("ModelTrainer: compute.instance_groups (heterogeneous clusters) is not supported here; "
                             "give instance_type and instance_count")
        count = self.compute.instance_count
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise UsageError(f"ModelTrainer: Compute(instance_count={count!r}): a job needs at least 1 instance "
                             f"(SageMaker refuses InstanceCount < 1)")
        self.networking, self.tags = networking, tags
        self.stopping_condition = stopping_condition or StoppingCondition(max_runtime_in_seconds=3600)
        self.output_data_config, self.input_data_config = output_data_config, input_data_config
        self.checkpoint_config = checkpoint_config
        self.environment = dict(environment or {})
        self.hyperparameters = _hyperparameters(hyperparameters)
        self.local_container_root = local_container_root or os.getcwd()
        self.placement = _placement(disttrain)
        self._latest_training_job: TrainingJob | None = None
        self._metric_definitions: list[MetricDefinition] | None = None
        self._tensorboard_output_config: TensorBoardOutputConfig | None = None
        self._aws_only: dict[str, Any] = {}
        count = self.compute.instance_count or 1
        note = _instance_note(self.compute.instance_type or DEFAULT_INSTANCE_TYPE, count, self.placement)
        if note:
            print(note, file=sys.stderr, flush=True)

    @staticmethod
    def _check_code(source_code: SourceCode | None, distributed: DistributedConfig | None) -> None:
        if not isinstance(source_code, SourceCode):
            raise UsageError("ModelTrainer: source_code=SourceCode(source_dir=..., entry_script=... or command=...) "
                             "is required here (disttrain runs your code, not a container image)")
        if not source_code.entry_script and not source_code.command:
            raise UsageError("ModelTrainer: SourceCode needs entry_script or command")
        if (source_code.entry_script or source_code.requirements) and not source_code.source_dir:
            raise UsageError("ModelTrainer: SourceCode with entry_script or requirements needs source_dir")
        if distributed is not None and not source_code.entry_script:
            raise UsageError("ModelTrainer: distributed needs SourceCode(entry_script=...)")
        if distributed is not None and not isinstance(distributed, DistributedConfig) or isinstance(distributed, SMP):
            raise UsageError(f"ModelTrainer: distributed must be Torchrun(...) or MPI(...), got {distributed!r}")
        if source_code.requirements not in (None, REQUIREMENTS):
            raise UsageError(f"ModelTrainer: SourceCode.requirements={source_code.requirements!r}: here the job "
                             f"installs {REQUIREMENTS} from source_dir (rename the file, or leave requirements out)")

    def __repr__(self) -> str:
        return f"ModelTrainer(base_job_name={self.base_job_name!r}, training_mode={self.training_mode})"

    # --- builders (each returns the trainer, as the SDK's do) ---
    def with_metric_definitions(self, metric_definitions: list[MetricDefinition]) -> ModelTrainer:
        self._metric_definitions = list(metric_definitions)
        return self

    def with_checkpoint_config(self, checkpoint_config: CheckpointConfig | None = None) -> ModelTrainer:
        self.checkpoint_config = checkpoint_config or CheckpointConfig()
        return self

    def with_tensorboard_output_config(self, tensorboard_output_config: TensorBoardOutputConfig | None = None
                                       ) -> ModelTrainer:
        """Kept; every job already writes its metrics' TensorBoard event file in its folder."""
        self._tensorboard_output_config = tensorboard_output_config or TensorBoardOutputConfig()
        return self

    def _aws_builder(self, name: str, value: Any) -> ModelTrainer:
        print(f"disttrain: ignored on your own machines: {name}", file=sys.stderr, flush=True)
        self._aws_only[name] = value
        return self

    def with_retry_strategy(self, retry_strategy) -> ModelTrainer:
        return self._aws_builder("retry_strategy", retry_strategy)

    def with_infra_check_config(self, infra_check_config=None) -> ModelTrainer:
        return self._aws_builder("infra_check_config", infra_check_config)

    def with_session_chaining_config(self, session_chaining_config=None) -> ModelTrainer:
        return self._aws_builder("session_chaining_config", session_chaining_config)

    def with_remote_debug_config(self, remote_debug_config=None) -> ModelTrainer:
        return self._aws_builder("remote_debug_config", remote_debug_config)

    @classmethod
    def from_recipe(cls, *args: Any, **kwargs: Any) -> ModelTrainer:
        raise UsageError("ModelTrainer.from_recipe: SageMaker's training recipes (HyperPod/Nova images) are not "
                         "supported here; use source_code=SourceCode(...) with your own script")

    @classmethod
    def from_jumpstart_config(cls, *args: Any, **kwargs: Any) -> ModelTrainer:
        raise UsageError("ModelTrainer.from_jumpstart_config: JumpStart models live on AWS; not supported here")

    # --- the job ---
    def _default_bucket(self) -> str:
        session = self.sagemaker_session
        if session is None:
            from .session import Session

            session = Session()
        return session.default_bucket()

    def _job_fields(self, input_data_config: Any, job_name: str) -> dict[str, Any]:
        """The job (``disttrain.Job`` keys) one ``train()`` runs as ``job_name``."""
        code = self.source_code
        merged = channels(self.input_data_config)
        merged.update(channels(input_data_config))
        if self.output_data_config and self.output_data_config.s3_output_path:
            output = self.output_data_config.s3_output_path
        elif self.training_mode is Mode.LOCAL_CONTAINER:
            output = self.local_container_root
        else:
            output = f"s3://{self._default_bucket()}/{self.base_job_name}"
        fields: dict[str, Any] = {
            "name": self.base_job_name,
            "entry_point": code.entry_script or "",
            "source_dir": buckets.resolve(code.source_dir) if code.source_dir else os.getcwd(),
            "hyperparameters": dict(self.hyperparameters),
            "instance_count": 1 if self.compute.instance_count is None else self.compute.instance_count,
            "instance_type": self.compute.instance_type or DEFAULT_INSTANCE_TYPE,
            "inputs": {name: buckets.resolve_input(name, location) for name, location in merged.items()},
            "output_path": buckets.resolve(output),
            "env": {key: str(value) for key, value in self.environment.items()},
            "metric_definitions": [{"Name": m.name, "Regex": m.regex} for m in self._metric_definitions or []],
            "contract": "model_trainer",
            **self.placement,
        }
        if code.command:
            fields["command"] = code.command
        if self.distributed is not None:
            fields["distribution"] = self.distributed.distribution()
            if isinstance(self.distributed, Torchrun) and "processes_per_instance" not in fields:
                fields["processes_per_instance"] = self.distributed.process_count_per_node or _per_gpu()
        if self.stopping_condition.max_runtime_in_seconds:
            fields["max_run"] = self.stopping_condition.max_runtime_in_seconds
        if self.checkpoint_config is not None:
            uri = self.checkpoint_config.s3_uri or \
                f"s3://{self._default_bucket()}/{self.base_job_name}/{job_name}/checkpoints"
            fields["checkpoint_s3_uri"] = buckets.resolve(uri)
            fields["checkpoint_local_path"] = self.checkpoint_config.local_path or "/opt/ml/checkpoints"
        return fields

    def train(self, input_data_config: list | dict | None = None, wait: bool | None = True,
              logs: bool | None = True, dry_run: bool = False) -> None:
        """One job: checked here (bad input raises, one line, before anything is recorded); with
        ``wait``, until it ends (``FailedStatusError`` if it failed). ``_latest_training_job`` is it."""
        from ..jobs.runner import new_job_name
        from ..jobs.spec import check_name

        name = new_job_name(check_name(self.base_job_name, "base_job_name"))
        fields = self._job_fields(input_data_config, name)
        if dry_run:
            check_job(fields, source="ModelTrainer", job_name=name)
            return None
        job = start_job(fields, name, logs=bool(logs), source="ModelTrainer")
        self._latest_training_job = TrainingJob(name, job)
        if wait:
            try:
                self._latest_training_job.wait()
            finally:  # as the SDK's local container gathers them, failed or not
                if self.training_mode is Mode.LOCAL_CONTAINER:
                    from .localmode import leave_local_layout

                    record = job._wait_recorded()
                    leave_local_layout(self.local_container_root, record.job_dir,
                                       int(record.spec.get("instance_count") or 1))
        return None


def _per_gpu() -> int | str:
    """Torchrun's default, as the SDK's driver: one process per GPU, else one."""
    import glob

    return "auto" if glob.glob("/dev/nvidia[0-9]*") else 1


__all__ = ["Mode", "ModelTrainer"]
