"""SageMaker SDK estimators over disttrain's job runner: the notebook cell runs unchanged.

``Estimator``/``Framework``/``PyTorch``/``TensorFlow`` take the SDK's constructor arguments
(v2 names, and v1 names with the SDK's rename warning). Each ``fit`` becomes one recorded
job (``disttrain jobs ls``) run by ``disttrain.jobs.runner`` in a child process, so the
job's signal handling (stop, ``max_run``) never touches the notebook's kernel.

Arguments fall in three groups:

- used: what a job on your own machines can honour (entry point, code, inputs, outputs,
  instances, hyperparameters, distribution, limits, metrics, checkpoints, environment);
- accepted and said once to be ignored: AWS-only settings (IAM role, container image, EBS
  volume, spot capacity, VPC, KMS keys, debugger/profiler, ...);
- anything else: ``TypeError`` naming the argument, as the SDK does.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

from ..config.text import check_path
from ..errors import UsageError
from .buckets import resolve, resolve_input
from .inputs import channels
from .trainingjob import TrainingJob, UnexpectedStatusException, start_job

USED = (
    "entry_point", "source_dir", "dependencies", "hyperparameters", "instance_count", "instance_type",
    "output_path", "distribution", "environment", "max_run", "checkpoint_s3_uri",
    "checkpoint_local_path", "metric_definitions", "base_job_name", "framework_version", "py_version",
    "disttrain",
)
IGNORED = (
    "role", "image_uri", "volume_size", "volume_kms_key", "use_spot_instances", "max_wait",
    "keep_alive_period_in_seconds", "input_mode", "output_kms_key", "sagemaker_session", "tags",
    "subnets", "security_group_ids", "model_uri", "model_channel_name", "encrypt_inter_container_traffic",
    "enable_network_isolation", "rules", "debugger_hook_config", "tensorboard_output_config",
    "enable_sagemaker_metrics", "profiler_config", "disable_profiler", "max_retry_attempts", "git_config",
    "training_repository_access_mode", "training_repository_credentials_provider_arn", "enable_infra_check",
    "container_entry_point", "container_arguments", "disable_output_compression", "enable_remote_debug",
    "enable_session_tag_chaining", "script_mode", "compiler_config",
    "code_location", "container_log_level",  # the code runs from source_dir; the log level stays INFO
)
# SDK v1 → v2 (https://sagemaker.readthedocs.io/en/stable/v2.html).
RENAMED = {
    "train_instance_count": "instance_count",
    "train_instance_type": "instance_type",
    "train_max_run": "max_run",
    "train_use_spot_instances": "use_spot_instances",
    "train_max_wait": "max_wait",
    "train_volume_size": "volume_size",
    "train_volume_kms_key": "volume_kms_key",
    "image_name": "image_uri",
    "distributions": "distribution",
}
# Keys of the `disttrain=` argument: where the instances run (default: this machine).
PLACEMENT_KEYS = ("launcher", "hosts", "ssh_options", "python", "master_port", "slurm",
                  "processes_per_instance", "max_restarts", "storage_options", "private_opt_ml",
                  "min_instance_count",  # an elastic job: instance_count is the most, this the fewest
                  "track", "track_ranks")  # the job in MLflow, Trackio or W&B (docs/tracking.md)
PLACEMENT_ENV = "DISTTRAIN_PLACEMENT"  # a YAML file with those keys, for notebooks left unchanged


class RenamedArgumentWarning(UserWarning):
    """An SDK v1 argument name, accepted under its v2 name."""


def _placement(overrides: dict[str, Any] | None) -> dict[str, Any]:
    placement: dict[str, Any] = {}
    path = os.environ.get(PLACEMENT_ENV)
    if path:
        import yaml

        try:
            placement = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise UsageError(f"{PLACEMENT_ENV}={path}: cannot read it: {err}") from None
    placement.update(overrides or {})
    if "backend" in placement and "launcher" not in placement:  # the job spec's old name for it
        placement["launcher"] = placement.pop("backend")
    unknown = [key for key in placement if key not in PLACEMENT_KEYS]
    if unknown:
        raise UsageError(f"disttrain placement: unknown key {unknown[0]!r}; known: {', '.join(PLACEMENT_KEYS)}")
    return placement


def is_local_type(instance_type: Any) -> bool:
    """The SDK's local mode: every ``local*`` type (``local``, ``local_cpu``, ``local_gpu``, ...)."""
    return isinstance(instance_type, str) and instance_type.startswith("local")


def _instance_note(instance_type: str, count: Any, placement: dict[str, Any]) -> str | None:
    if is_local_type(instance_type):
        return None
    if not isinstance(instance_type, str) or not instance_type.startswith("ml."):
        raise UsageError(f"instance_type must be local, local_cpu, local_gpu (any local*) or an ml.* type, "
                         f"got {instance_type!r}")
    launcher = placement.get("launcher", "local")
    if launcher != "local":
        return f"disttrain: instance_type {instance_type} is mapped to {count} instance(s) on launcher {launcher}"
    import glob

    gpus = len(glob.glob("/dev/nvidia[0-9]*"))  # without importing torch in the notebook
    return (f"disttrain: instance_type {instance_type} is mapped to {count} instance(s) on this machine "
            f"({os.cpu_count()} CPUs, {gpus} GPUs, split between them; disttrain={{'launcher': 'ssh', ...}} "
            f"or {PLACEMENT_ENV} places them elsewhere)")


class EstimatorBase:
    """The shared flow of every estimator: arguments → a job spec → ``fit`` → a recorded job."""

    framework = "pytorch"
    default_base_name = "disttrain-training"

    def __init__(self, **kwargs: Any) -> None:
        args: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in RENAMED:
                new = RENAMED[key]
                warnings.warn(f"{key} has been renamed in sagemaker>=2: use {new} (accepted here under its new "
                              "name; see https://sagemaker.readthedocs.io/en/stable/v2.html)",
                              RenamedArgumentWarning, stacklevel=3)
                if new in kwargs:
                    raise TypeError(f"{type(self).__name__}() got both {key!r} and its v2 name {new!r}")
                key = new
            if key not in USED and key not in IGNORED:
                raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument {key!r}")
            args[key] = value
        ignored = sorted(k for k in args if k in IGNORED and args[k] not in (None, False))
        if ignored:
            print(f"disttrain: ignored on your own machines: {', '.join(ignored)}", file=sys.stderr, flush=True)
        self.args = args
        if not args.get("entry_point"):
            raise UsageError(f"{type(self).__name__}: entry_point is required (disttrain runs your script, "
                             "not a container image): entry_point='train.py'")
        self.instance_count = args.get("instance_count", 1)  # checked with the rest of the spec at fit
        self.instance_type = args.get("instance_type") or "local"
        self.placement = _placement(args.get("disttrain"))
        note = _instance_note(self.instance_type, self.instance_count, self.placement)
        if note:
            print(note, file=sys.stderr, flush=True)
        self.output_path = args.get("output_path")
        self.base_job_name = args.get("base_job_name")
        self.hyperparameters_ = dict(args.get("hyperparameters") or {})
        self.latest_training_job: TrainingJob | None = None
        self._framework_note()

    # --- the SDK's surface ---
    def hyperparameters(self) -> dict[str, Any]:
        return dict(self.hyperparameters_)

    def set_hyperparameters(self, **kwargs: Any) -> None:
        self.hyperparameters_.update(kwargs)

    def _framework_note(self) -> None:
        wanted = self.args.get("framework_version")
        have = _installed_version(self.framework)
        if wanted and have and str(wanted).split(".")[:2] != have.split("+")[0].split(".")[:2]:
            print(f"disttrain: framework_version {wanted} asked for; this machine runs {self.framework} {have}",
                  file=sys.stderr, flush=True)

    def _code(self, job_name: str) -> tuple[str, str]:
        """(source_dir, entry_point): the SDK's rules, plus ``dependencies`` copied beside the code."""
        entry = check_path("entry_point", self.args["entry_point"])
        source = self.args.get("source_dir")
        if source is not None:
            check_path("source_dir", source)
        if source is None:  # the entry point's own folder is the code
            source, entry = os.path.dirname(os.path.abspath(entry)), os.path.basename(entry)
        deps = self.args.get("dependencies") or []
        if not isinstance(deps, (list, tuple)):
            raise UsageError(f"dependencies must be a list of paths, got {deps!r}")
        deps = [check_path(f"dependencies[{index}]", dep) for index, dep in enumerate(deps)]
        if not deps:
            return str(source), entry
        from ..home import disttrain_home

        code = disttrain_home() / "code" / job_name
        if code.exists():
            shutil.rmtree(code)
        shutil.copytree(source, code, symlinks=True)
        for dep in deps:
            path = Path(dep)
            if not path.exists():
                raise UsageError(f"dependencies: {dep} does not exist")
            target = code / path.name
            if path.is_dir():
                shutil.copytree(path, target, symlinks=True, dirs_exist_ok=True)
            else:
                shutil.copy2(path, target)
        return str(code), entry

    def _hyperparameters_for_job(self) -> dict[str, Any]:
        return self.hyperparameters()

    def _spec_fields(self, inputs: Any, job_name: str) -> dict[str, Any]:
        source, entry = self._code(job_name)
        base = self.base_job_name or self.default_base_name
        env = {k: str(v) for k, v in (self.args.get("environment") or {}).items()}
        fields = {
            "name": base[:42].rstrip("-") or "job",
            "entry_point": entry,
            "source_dir": source,
            "hyperparameters": self._hyperparameters_for_job(),
            "instance_count": self.instance_count,
            "instance_type": self.instance_type,
            "inputs": {name: resolve_input(name, location) for name, location in channels(inputs).items()},
            "output_path": resolve(self.output_path),
            "framework": self.framework,
            "distribution": dict(self.args.get("distribution") or {}),
            "env": env,
            "max_run": self.args.get("max_run"),
            "metric_definitions": list(self.args.get("metric_definitions") or []),
            "checkpoint_s3_uri": resolve(self.args.get("checkpoint_s3_uri")),
            "checkpoint_local_path": self.args.get("checkpoint_local_path"),
            **self.placement,
        }
        if fields["max_run"] is None:
            del fields["max_run"]
        if self.instance_type == "local_gpu" and "processes_per_instance" not in fields:
            fields["processes_per_instance"] = "auto"
        return fields

    def fit(self, inputs: Any = None, wait: bool = True, logs: Any = True, job_name: str | None = None,
            experiment_config: dict | None = None) -> None:
        """Run one job: checked here (bad input raises before anything is recorded), run in a child process."""
        from ..jobs.runner import new_job_name
        from ..jobs.spec import check_name

        base = (self.base_job_name or self.default_base_name)[:42].rstrip("-")
        name = check_name(job_name, "job_name") if job_name else new_job_name(check_name(base, "base_job_name"))
        show = logs not in (False, None, "None")  # the SDK also takes "All" / "None"
        self.latest_training_job = start_job(self._spec_fields(inputs, name), name, logs=show,
                                             source=type(self).__name__)
        if wait:
            self.latest_training_job.wait(logs=logs)

    # --- after fit ---
    def _job(self) -> TrainingJob:
        if self.latest_training_job is None:
            raise UsageError("no training job yet: call fit() first (or Estimator.attach(job_name))")
        return self.latest_training_job

    @property
    def model_data(self) -> str | None:
        """The URL of the last job's ``model.tar.gz`` (None until it completed)."""
        return self._job().describe().get("ModelArtifacts", {}).get("S3ModelArtifacts")

    def logs(self) -> None:
        self._job().logs(follow=True)

    @property
    def training_job_analytics(self):
        from .analytics import TrainingJobAnalytics

        return TrainingJobAnalytics(self._job().name)

    @classmethod
    def attach(cls, training_job_name: str, sagemaker_session=None, model_channel_name: str = "model"):
        """An estimator for a recorded job (any state), as the SDK's ``attach``."""
        from ..store import JobStore

        with JobStore() as store:
            record = store.get(training_job_name)
        spec = record.spec
        estimator = cls.__new__(cls)
        estimator.args = {"entry_point": spec["entry_point"], "source_dir": spec["source_dir"]}
        estimator.instance_count = spec["instance_count"]
        estimator.instance_type = spec.get("instance_type", "local")
        estimator.placement = {}
        estimator.output_path = spec.get("output_path")
        estimator.base_job_name = spec["name"]
        estimator.hyperparameters_ = dict(spec.get("hyperparameters") or {})
        estimator.latest_training_job = TrainingJob(record.name)
        return estimator


def _installed_version(framework: str) -> str | None:
    import importlib.metadata

    names = ("torch",) if framework == "pytorch" else ("tensorflow", "tensorflow-cpu")
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


class Estimator(EstimatorBase):
    """The SDK's generic ``Estimator``: here it needs ``entry_point`` (a script, not an image)."""


class Framework(EstimatorBase):
    """Base of the framework estimators (``PyTorch``, ``TensorFlow``)."""


__all__ = ["Estimator", "EstimatorBase", "Framework", "RenamedArgumentWarning", "TrainingJob",
           "UnexpectedStatusException"]
