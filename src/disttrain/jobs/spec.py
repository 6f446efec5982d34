"""The job spec: SageMaker estimator arguments for machines you already have.

One frozen dataclass, validated once. A YAML file or a dict (``disttrain.Job(**fields)``)
with an unknown key or a bad value is rejected with the key's name before anything runs.
Relative local paths in a YAML file are relative to that file, so a job runs the same
from any working directory.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.hosts import parse_host, unique_hosts
from ..errors import UsageError
from ..private import mask_secrets

FRAMEWORKS = ("pytorch", "tensorflow")
BACKENDS = ("local", "ssh", "slurm")
# backend: slurm: what the job's sbatch script asks for besides --nodes (= instance_count).
SLURM_KEYS = ("partition", "time", "gpus_per_node", "sbatch_args")
_SLURM_FLAGS = {"--partition": "partition", "--time": "time", "--sbatch-arg": "sbatch_args"}

# SageMaker's rule for training job names.
NAME_RULE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
# Each run appends -YYYYMMDD-HHMMSS-xxxx (21 characters) to the spec's name; the result
# must still be a valid 63-character job name.
RUN_SUFFIX_LEN = 21
MAX_BASE_NAME = 63 - RUN_SUFFIX_LEN
# A channel name becomes a folder and SM_CHANNEL_<NAME>; a hyperparameter becomes
# --name and SM_HP_<NAME>.
_CHANNEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_HP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def is_url(location: str) -> bool:
    """``s3://...``, ``gs://...``, ``file://...``: anything fsspec should open."""
    return "://" in location


def check_name(name: object, key: str = "name") -> str:
    if not isinstance(name, str) or not NAME_RULE.match(name):
        raise UsageError(
            f"{key} must be 1-63 letters, digits and hyphens, starting and ending with a letter or "
            f"digit (SageMaker's rule), got {name!r}"
        )
    return name


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """A training job. Paths are absolute once loaded through :func:`spec_from_mapping`."""

    name: str
    entry_point: str
    source_dir: str = "."
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    instance_count: int = 1
    processes_per_instance: int | str = "auto"
    inputs: dict[str, str] = field(default_factory=dict)
    output_path: str | None = None  # default: $DISTTRAIN_HOME/artifacts
    framework: str = "pytorch"
    backend: str = "local"
    hosts: tuple[str, ...] = ()  # backend: ssh; one instance per host, the first is the master
    ssh_options: tuple[str, ...] = ()
    python: str | None = None  # on the hosts (or Slurm nodes); default: this interpreter's path
    master_port: int | None = None
    slurm: dict[str, Any] = field(default_factory=dict)  # backend: slurm; keys SLURM_KEYS
    env: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    # Passed to fsspec for inputs and output_path, e.g. {"anon": true} for a public bucket.
    # An S3-compatible endpoint is set the AWS way: AWS_ENDPOINT_URL in the environment.
    storage_options: dict[str, Any] = field(default_factory=dict)
    # --- SageMaker estimator arguments (disttrain.sagemaker; usable in YAML too) ---
    instance_type: str = "local"  # local, local_gpu or ml.*: all run on the placement above
    distribution: dict[str, Any] = field(default_factory=dict)  # see jobs/distribution.py
    max_run: int | None = None  # seconds; then the job is stopped and Failed (MaxRuntimeExceeded)
    metric_definitions: list[dict[str, str]] = field(default_factory=list)  # [{Name, Regex}]
    checkpoint_s3_uri: str | None = None  # any fsspec URL, restored before and synced during the job
    checkpoint_local_path: str | None = None  # default /opt/ml/checkpoints (the instance's own)
    private_opt_ml: str = "auto"  # auto | required | off: each instance sees its folder at /opt/ml

    def __post_init__(self) -> None:
        check_name(self.name)
        if len(self.name) > MAX_BASE_NAME:
            raise UsageError(
                f"name may have at most {MAX_BASE_NAME} characters (each run appends a "
                f"{RUN_SUFFIX_LEN}-character timestamp), got {len(self.name)}"
            )
        _string("entry_point", self.entry_point)
        if Path(self.entry_point).is_absolute() or ".." in Path(self.entry_point).parts:
            raise UsageError(f"entry_point must be a path inside source_dir, got {self.entry_point!r}")
        _string("source_dir", self.source_dir)
        _mapping("hyperparameters", self.hyperparameters)
        for key, value in self.hyperparameters.items():
            if not isinstance(key, str) or not _HP_NAME.match(key):
                raise UsageError(f"hyperparameters: {key!r} is not a usable name (letters, digits, _ and -)")
            if value is None:
                raise UsageError(f"hyperparameters.{key} has no value")
        _positive("instance_count", self.instance_count)
        if self.processes_per_instance != "auto":
            _positive("processes_per_instance", self.processes_per_instance, also="or 'auto'")
        _mapping("inputs", self.inputs)
        for channel, location in self.inputs.items():
            if not isinstance(channel, str) or not _CHANNEL.match(channel):
                raise UsageError(f"inputs: channel name {channel!r} must be letters, digits, _ and -")
            _string(f"inputs.{channel}", location)
        if self.output_path is not None:
            _string("output_path", self.output_path)
        _choice("framework", self.framework, FRAMEWORKS)
        _choice("backend", self.backend, BACKENDS)
        _mapping("slurm", self.slurm)
        if self.slurm and self.backend != "slurm":
            raise UsageError("slurm is only used with backend: slurm")
        if self.backend == "slurm":
            self.slurm_options(job_name=self.name)  # checked now, naming the key
        if self.hosts:
            unique_hosts([parse_host(_string(f"hosts[{index}]", host), where=f"hosts[{index}]")
                          for index, host in enumerate(self.hosts)], "hosts")
        if self.backend == "ssh":
            if not self.hosts:
                raise UsageError("backend ssh needs hosts: a list like [node0, user@node1:2222]")
            if self.instance_count != len(self.hosts):
                raise UsageError(f"instance_count is {self.instance_count} but hosts lists {len(self.hosts)}; "
                                 "with backend ssh there is one instance per host")
        elif self.hosts:
            raise UsageError("hosts is only used with backend: ssh")
        for index, option in enumerate(self.ssh_options):
            key, sep, value = _string(f"ssh_options[{index}]", option).partition("=")
            if not sep or not key.isalnum() or not value:
                raise UsageError(f"ssh_options[{index}] must be KEY=VALUE like IdentityFile=~/.ssh/key, got {option!r}")
        if self.python is not None:
            _string("python", self.python)
        if self.master_port is not None and (not _is_int(self.master_port) or not 1 <= self.master_port <= 65535):
            raise UsageError(f"master_port must be in 1..65535, got {self.master_port!r}")
        _mapping("env", self.env)
        for key, value in self.env.items():
            if not isinstance(key, str) or not _ENV_NAME.match(key):
                raise UsageError(f"env: {key!r} is not a valid environment variable name")
            _string(f"env.{key}", value, empty_ok=True)
        if not _is_int(self.max_restarts) or self.max_restarts < 0:
            raise UsageError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        _mapping("storage_options", self.storage_options)
        self._check_sagemaker()

    def _check_sagemaker(self) -> None:
        from .distribution import parse_distribution
        from .metrics import check_definitions

        _string("instance_type", self.instance_type)
        _mapping("distribution", self.distribution)
        parse_distribution(self.distribution, framework=self.framework)
        if self.max_run is not None and (not _is_int(self.max_run) or self.max_run < 1):
            raise UsageError(f"max_run must be a positive number of seconds, got {self.max_run!r}")
        check_definitions(self.metric_definitions)
        if self.checkpoint_s3_uri is not None:
            _string("checkpoint_s3_uri", self.checkpoint_s3_uri)
        if self.checkpoint_local_path is not None and not Path(
                _string("checkpoint_local_path", self.checkpoint_local_path)).is_absolute():
            raise UsageError(f"checkpoint_local_path must be an absolute path like /opt/ml/checkpoints, "
                             f"got {self.checkpoint_local_path!r}")
        _choice("private_opt_ml", self.private_opt_ml, ("auto", "required", "off"))

    def slurm_options(self, *, job_name: str):
        """The sbatch request: one node per instance, and the ``slurm`` keys."""
        from ..backends.slurm import SlurmOptions

        unknown = [key for key in self.slurm if key not in SLURM_KEYS]
        if unknown:
            raise UsageError(f"slurm: unknown key {unknown[0]!r}; known keys: {', '.join(SLURM_KEYS)}")
        for key in ("partition", "time"):
            if key in self.slurm and not isinstance(self.slurm[key], str):
                # YAML reads 1:00:00 as the number 3600 (sexagesimal) and 30 as a number.
                raise UsageError(f"slurm.{key} must be a string, got {self.slurm[key]!r}: quote it in YAML, "
                                 f'e.g. {key}: "{"1:00:00" if key == "time" else "gpu"}"')
        gpus = self.slurm.get("gpus_per_node")
        if gpus is not None and (not _is_int(gpus) or gpus < 0):
            raise UsageError(f"slurm.gpus_per_node must be an integer >= 0, got {gpus!r}")
        args = self.slurm.get("sbatch_args", ())
        if not isinstance(args, (list, tuple)):
            raise UsageError(f"slurm.sbatch_args must be a list like [--mem=8G], got {args!r}")
        try:
            return SlurmOptions(nodes=self.instance_count, partition=self.slurm.get("partition"),
                                time=self.slurm.get("time"), gpus_per_node=gpus,
                                sbatch_args=tuple(_string(f"slurm.sbatch_args[{i}]", a) for i, a in enumerate(args)),
                                job_name=job_name)
        except UsageError as err:  # SlurmOptions names `disttrain run`'s flag; the spec's key is meant
            flag = str(err).split(" ", 1)[0]
            raise UsageError(f"slurm.{_SLURM_FLAGS.get(flag, '')}: {err}".replace("slurm.: ", "")) from None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["hosts"], data["ssh_options"] = list(self.hosts), list(self.ssh_options)
        return data

    def to_record(self) -> dict[str, Any]:
        """:meth:`to_dict` for the job history: values of secret-looking keys (env, nested
        storage_options, hyperparameters) are not kept."""
        return mask_secrets(self.to_dict())


KNOWN_KEYS = tuple(f.name for f in dataclasses.fields(JobSpec))


def spec_from_mapping(data: Any, *, base_dir: str | os.PathLike, source: str = "job spec") -> JobSpec:
    """A validated spec from a YAML document or keyword arguments; errors name ``source``."""
    if not isinstance(data, Mapping):
        raise UsageError(f"{source}: expected a mapping of keys (name, entry_point, ...), got {type(data).__name__}")
    unknown = [key for key in data if key not in KNOWN_KEYS]
    if unknown:
        raise UsageError(f"{source}: unknown key {unknown[0]!r}; known keys: {', '.join(KNOWN_KEYS)}")
    for key in ("name", "entry_point"):
        if key not in data:
            raise UsageError(f"{source}: {key} is required")
    fields = dict(data)
    base = Path(base_dir)
    try:
        # Environment values and hosts written as YAML numbers/lists are what the user meant.
        if isinstance(fields.get("env"), Mapping):
            fields["env"] = {k: _scalar_text(v) for k, v in fields["env"].items()}
        for key in ("hosts", "ssh_options"):
            if key in fields:
                fields[key] = _sequence(key, fields[key])
        if fields.get("backend") == "ssh" and "instance_count" not in fields and fields.get("hosts"):
            fields["instance_count"] = len(fields.get("hosts", ()))  # one instance per host
        fields["source_dir"] = _local_absolute(fields.get("source_dir", "."), base, "source_dir")
        if isinstance(fields.get("inputs"), Mapping):
            fields["inputs"] = {k: _local_absolute(v, base, f"inputs.{k}") for k, v in fields["inputs"].items()}
        if fields.get("output_path") is not None:
            fields["output_path"] = _local_absolute(fields["output_path"], base, "output_path")
        return JobSpec(**fields)
    except UsageError as err:
        raise UsageError(f"{source}: {err}") from None


def load_spec(path: str | os.PathLike) -> JobSpec:
    """Read a YAML job spec: UTF-8, each key once, nested no deeper than a person would write."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise UsageError(f"cannot read job spec {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise UsageError(f"{path}: not UTF-8 text (byte {err.start}); save the job spec as UTF-8") from None
    try:
        data = yaml.load(text, Loader=_unique_key_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UsageError(f"{path}: not valid YAML{where}: {getattr(err, 'problem', err)}") from None
    except RecursionError:
        raise UsageError(f"{path}: nested too deeply to be a job spec") from None
    return spec_from_mapping(data, base_dir=Path(path).resolve().parent, source=str(path))


@functools.cache
def _unique_key_loader() -> type:
    """PyYAML's SafeLoader, refusing a key given twice (plain PyYAML keeps the last silently)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, Hashable):
                    continue  # PyYAML itself refuses an unhashable key, in its words
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice; give it once", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def _local_absolute(value: Any, base: Path, key: str) -> Any:
    if not isinstance(value, str) or not value or is_url(value):
        return value  # URLs stay as written; a non-string is reported by the validation
    return str((base / os.path.expanduser(value)).resolve())


def _scalar_text(value: Any) -> Any:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return value


def _sequence(key: str, value: Any) -> tuple:
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    if not isinstance(value, (list, tuple)):
        raise UsageError(f"{key} must be a list, got {value!r}")
    return tuple(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(key: str, value: Any, also: str = "") -> None:
    if not _is_int(value) or value < 1:
        raise UsageError(f"{key} must be a positive integer{' ' + also if also else ''}, got {value!r}")


def _string(key: str, value: Any, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty_ok):
        raise UsageError(f"{key} must be a non-empty string, got {value!r}")
    return value


def _mapping(key: str, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise UsageError(f"{key} must be a mapping (key: value), got {value!r}")


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UsageError(f"{key} must be one of {', '.join(choices)}, got {value!r}")
