"""The job spec: SageMaker estimator arguments for machines you already have.

A job is a name and three typed parts, each validating its own keys when it is made (an error
names the key): the :class:`Program` (what runs: the script, its code, hyperparameters,
environment, framework, and the distribution, parsed once into a
:class:`~disttrain.jobs.distribution.Distribution`), the :class:`Placement` (where it runs:
launcher, instances, processes, hosts, Slurm, interpreter, port) and the :class:`Container`
(what SageMaker's container does around the script: channels in, artifacts out, checkpoints,
metrics, the time limit, the private ``/opt/ml``).

Users write the flat keys of SageMaker's estimators, in a YAML file, as ``disttrain.Job(**fields)``
or through :mod:`disttrain.sagemaker`; :func:`spec_from_mapping` is the one door from those keys
to a :class:`JobSpec` (unknown keys refused by name, old spellings accepted, relative local
paths made absolute against the YAML file's folder, so a job runs the same from any working
directory), and :meth:`JobSpec.to_dict` gives the same keys back (the job's record, a Slurm batch step).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import re
import sys
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.hosts import parse_host, unique_hosts
from ..config.text import MAX_PATH, check_path, check_pattern, check_text, check_value, shown
from ..errors import UsageError
from ..launch.slurm import SlurmOptions
from ..private import mask_secrets
from .contract import CONTRACTS, contract_for
from .distribution import NONE, TF_KINDS, Distribution, parse_distribution

FRAMEWORKS = ("pytorch", "tensorflow")
LAUNCHERS = ("local", "ssh", "slurm")  # disttrain.launch's; `backend:` is the old key's name
# launcher: slurm: what the job's sbatch script asks for besides --nodes (= instance_count).
SLURM_KEYS = ("partition", "time", "gpus_per_node", "sbatch_args")
_SLURM_FLAGS = {"--partition": "partition", "--time": "time", "--sbatch-arg": "sbatch_args"}

# SageMaker's rule for training job names, matched whole (1-63 characters by itself).
NAME_RULE = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}")
NAME_WORDS = "1-63 letters, digits and hyphens, starting and ending with a letter or digit (SageMaker's rule)"
# Each run appends -YYYYMMDD-HHMMSS-xxxx (21 characters) to the spec's name; the result
# must still be a valid 63-character job name.
RUN_SUFFIX_LEN = 21
MAX_BASE_NAME = 63 - RUN_SUFFIX_LEN
# A channel name becomes a folder and SM_CHANNEL_<NAME>; a hyperparameter becomes --name and
# SM_HP_<NAME>. The lengths are SageMaker's limits (CreateTrainingJob).
_CHANNEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
_HP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_CHANNEL, MAX_HP_NAME, MAX_ENV_NAME = 64, 256, 512
# SM_HPS and SM_TRAINING_ENV carry every hyperparameter in one environment variable, and Linux
# takes at most 128 KiB (MAX_ARG_STRLEN) in one; the rest of SM_TRAINING_ENV needs a few KiB.
MAX_HYPERPARAMETER_BYTES = 120 * 1024


def is_url(location: str) -> bool:
    """``s3://...``, ``gs://...``, ``file://...``: anything fsspec should open."""
    return "://" in location


def check_name(name: object, key: str = "name") -> str:
    """A job name (SageMaker's rule), matched whole: a trailing newline is not a name."""
    return check_pattern(key, name, NAME_RULE, NAME_WORDS, max_len=63)


def _named(where: str, name: Any, rule: re.Pattern[str], fault: str, *, max_len: int, label: str = "") -> None:
    """A key of a mapping the user gave (a channel, a hyperparameter, a variable), matched whole."""
    if not isinstance(name, str) or not rule.fullmatch(name):
        raise UsageError(f"{where}: {label}{shown(name)} {fault}")
    if len(name) > max_len:
        raise UsageError(f"{where}: {label}{shown(name)} is {len(name)} characters long; the limit is {max_len}")


def _check_channel(channel: Any) -> None:
    _named("inputs", channel, _CHANNEL, "must be letters, digits, _ and -", max_len=MAX_CHANNEL, label="channel name ")


@dataclass(frozen=True, kw_only=True)
class Program:
    """What runs: the script in its code folder, with its arguments and environment."""

    entry_point: str
    source_dir: str = "."  # a folder or a .tar.gz (local or a URL); absolute once loaded
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    framework: str = "pytorch"
    distribution: Distribution = NONE  # parsed once, from the estimator's `distribution=` dict
    # SDK v3's SourceCode(command=...): run through bash in each instance (contract model_trainer);
    # the entry point may then be left out.
    command: str | None = None

    def __post_init__(self) -> None:
        if self.command is not None:
            if not isinstance(self.command, str) or not self.command.strip():
                raise UsageError(f"command must be a non-empty string, got {shown(self.command)}")
            check_value("command", self.command)
        if self.command is None or self.entry_point:
            check_path("entry_point", self.entry_point)
        if Path(self.entry_point).is_absolute() or ".." in Path(self.entry_point).parts:
            raise UsageError(f"entry_point must be a path inside source_dir, got {self.entry_point!r}")
        check_path("source_dir", self.source_dir)
        _mapping("hyperparameters", self.hyperparameters)
        for key, value in self.hyperparameters.items():
            _named("hyperparameters", key, _HP_NAME, "is not a usable name (letters, digits, _ and -)",
                   max_len=MAX_HP_NAME)
            if value is None:
                raise UsageError(f"hyperparameters.{key} has no value")
            check_value(f"hyperparameters.{key}", value)
        size = len(json.dumps(dict(self.hyperparameters), sort_keys=True, separators=(",", ":"), default=str))
        if size > MAX_HYPERPARAMETER_BYTES:
            raise UsageError(f"hyperparameters are {size} bytes as JSON; the limit is {MAX_HYPERPARAMETER_BYTES} "
                             "(SM_HPS carries them all in one environment variable, at most 128 KiB on Linux): "
                             "pass large values as a file in a channel")
        _mapping("env", self.env)
        for key, value in self.env.items():
            _named("env", key, _ENV_NAME, "is not a valid environment variable name", max_len=MAX_ENV_NAME)
            if not isinstance(value, str):
                raise UsageError(f"env.{key} must be a string, got {shown(value)}")
            check_value(f"env.{key}", value)
        _choice("framework", self.framework, FRAMEWORKS)
        if not isinstance(self.distribution, Distribution):
            raise UsageError(f"distribution must be a Distribution (parse_distribution), "
                             f"got {shown(self.distribution)}")
        self.distribution.check_framework(self.framework)


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where it runs: which launcher, how many instances and processes, on which machines."""

    launcher: str = "local"
    instance_count: int = 1
    # An elastic job: it starts with at least this many instances and goes on while this many are
    # left (--nnodes MIN:MAX, MAX being instance_count); None: every instance, a lost one ends the job.
    min_instance_count: int | None = None
    processes_per_instance: int | str = "auto"
    instance_type: str = "local"  # local, local_gpu or ml.*: all run on the placement above
    hosts: tuple[str, ...] = ()  # launcher: ssh; one instance per host, the first is the master
    ssh_options: tuple[str, ...] = ()
    python: str | None = None  # on the hosts (or Slurm nodes); default: this interpreter's path
    master_port: int | None = None
    slurm: Mapping[str, Any] = field(default_factory=dict)  # launcher: slurm; keys SLURM_KEYS
    max_restarts: int = 0

    def __post_init__(self) -> None:
        _choice("launcher", self.launcher, LAUNCHERS)
        _positive("instance_count", self.instance_count)
        if self.min_instance_count is not None:
            _positive("min_instance_count", self.min_instance_count)
            if self.min_instance_count > self.instance_count:
                raise UsageError(f"min_instance_count {self.min_instance_count} is more than instance_count "
                                 f"{self.instance_count}")
        if self.processes_per_instance != "auto":
            _positive("processes_per_instance", self.processes_per_instance, also="or 'auto'")
        check_text("instance_type", self.instance_type)
        _mapping("slurm", self.slurm)
        if self.slurm and self.launcher != "slurm":
            raise UsageError("slurm is only used with launcher: slurm")
        if self.launcher == "slurm":
            self.slurm_options(job_name="job")  # checked now, naming the key
        if self.hosts:
            unique_hosts([parse_host(check_text(f"hosts[{index}]", host), where=f"hosts[{index}]")
                          for index, host in enumerate(self.hosts)], "hosts")
        if self.launcher == "ssh":
            if not self.hosts:
                raise UsageError("launcher ssh needs hosts: a list like [node0, user@node1:2222]")
            if self.instance_count != len(self.hosts):
                raise UsageError(f"instance_count is {self.instance_count} but hosts lists {len(self.hosts)}; "
                                 "with launcher ssh there is one instance per host")
        elif self.hosts:
            raise UsageError("hosts is only used with launcher: ssh")
        for index, option in enumerate(self.ssh_options):
            key, sep, value = check_text(f"ssh_options[{index}]", option, max_len=MAX_PATH).partition("=")
            if not sep or not key.isalnum() or not value:
                raise UsageError(f"ssh_options[{index}] must be KEY=VALUE like IdentityFile=~/.ssh/key, got {option!r}")
        if self.python is not None:
            check_path("python", self.python)
        if self.master_port is not None and (not _is_int(self.master_port) or not 1 <= self.master_port <= 65535):
            raise UsageError(f"master_port must be in 1..65535, got {self.master_port!r}")
        if not _is_int(self.max_restarts) or self.max_restarts < 0:
            raise UsageError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")

    def slurm_options(self, *, job_name: str) -> SlurmOptions:
        """The sbatch request: one node per instance, and the ``slurm`` keys."""
        unknown = [key for key in self.slurm if key not in SLURM_KEYS]
        if unknown:
            raise UsageError(f"slurm: unknown key {unknown[0]!r}; known keys: {', '.join(SLURM_KEYS)}")
        for key in ("partition", "time"):
            if key in self.slurm and not isinstance(self.slurm[key], str):
                # YAML reads 1:00:00 as the number 3600 (sexagesimal) and 30 as a number.
                raise UsageError(f"slurm.{key} must be a string, got {self.slurm[key]!r}: quote it in YAML, "
                                 f'e.g. {key}: "{"1:00:00" if key == "time" else "gpu"}"')
            if key in self.slurm:
                check_text(f"slurm.{key}", self.slurm[key])
        gpus = self.slurm.get("gpus_per_node")
        if gpus is not None and (not _is_int(gpus) or gpus < 0):
            raise UsageError(f"slurm.gpus_per_node must be an integer >= 0, got {gpus!r}")
        args = self.slurm.get("sbatch_args", ())
        if not isinstance(args, (list, tuple)):
            raise UsageError(f"slurm.sbatch_args must be a list like [--mem=8G], got {args!r}")
        try:
            return SlurmOptions(nodes=self.instance_count, partition=self.slurm.get("partition"),
                                time=self.slurm.get("time"), gpus_per_node=gpus,
                                sbatch_args=tuple(check_text(f"slurm.sbatch_args[{i}]", a, max_len=MAX_PATH)
                                                  for i, a in enumerate(args)),
                                job_name=job_name)
        except UsageError as err:  # SlurmOptions names `disttrain run`'s flag; the spec's key is meant
            flag = str(err).split(" ", 1)[0]
            raise UsageError(f"slurm.{_SLURM_FLAGS.get(flag, '')}: {err}".replace("slurm.: ", "")) from None


@dataclass(frozen=True, kw_only=True)
class Container:
    """What SageMaker's container does around the script: channels in, artifacts and checkpoints
    out, metrics from the output, the time limit, and the folder the script sees at /opt/ml.
    (A ``requirements.txt`` in the program's code is installed too: it has no key.)"""

    inputs: Mapping[str, str] = field(default_factory=dict)  # channel -> local path or fsspec URL
    output_path: str | None = None  # default: $DISTTRAIN_HOME/artifacts
    # Passed to fsspec for inputs and output_path, e.g. {"anon": true} for a public bucket.
    # An S3-compatible endpoint is set the AWS way: AWS_ENDPOINT_URL in the environment.
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    checkpoint_s3_uri: str | None = None  # any fsspec URL, restored before and synced during the job
    checkpoint_local_path: str | None = None  # default /opt/ml/checkpoints (the instance's own)
    metric_definitions: list[dict[str, str]] = field(default_factory=list)  # [{Name, Regex}]
    max_run: int | None = None  # seconds; then the job is stopped and Failed (MaxRuntimeExceeded)
    private_opt_ml: str = "auto"  # auto | required | off: each instance sees its folder at /opt/ml
    contract: str = "toolkit"  # toolkit | model_trainer: the SM_* variables, files and arguments the script sees
    track: str | None = None  # mlflow | trackio | wandb: the job as a tracker run (`disttrain run --track`)
    track_ranks: bool = False  # each rank's own disttrain.log() values too

    def __post_init__(self) -> None:
        from .metrics import check_definitions

        _mapping("inputs", self.inputs)
        for channel, location in self.inputs.items():
            _check_channel(channel)
            check_path(f"inputs.{channel}", location)
        if self.output_path is not None:
            check_path("output_path", self.output_path)
        _mapping("storage_options", self.storage_options)
        if self.checkpoint_s3_uri is not None:
            check_path("checkpoint_s3_uri", self.checkpoint_s3_uri)
            self._check_apart_from_inputs()
        if self.checkpoint_local_path is not None and not Path(
                check_path("checkpoint_local_path", self.checkpoint_local_path)).is_absolute():
            raise UsageError(f"checkpoint_local_path must be an absolute path like /opt/ml/checkpoints, "
                             f"got {self.checkpoint_local_path!r}")
        if isinstance(self.metric_definitions, (list, tuple)):
            for index, entry in enumerate(self.metric_definitions):
                if isinstance(entry, Mapping) and "Name" in entry:
                    check_text(f"metric_definitions[{index}].Name", entry["Name"])
        check_definitions(self.metric_definitions)
        if self.max_run is not None and (not _is_int(self.max_run) or self.max_run < 1):
            raise UsageError(f"max_run must be a positive number of seconds, got {self.max_run!r}")
        _choice("private_opt_ml", self.private_opt_ml, ("auto", "required", "off"))
        contract_for(self.contract)  # the SageMaker container contract the script sees (jobs/contract.py)
        from ..tracking import check_tracker

        check_tracker(self.track, where="track:")
        if not isinstance(self.track_ranks, bool):
            raise UsageError(f"track_ranks must be true or false, got {self.track_ranks!r}")
        if self.track_ranks and self.track is None:
            raise UsageError("track_ranks: true needs track: mlflow|trackio|wandb")

    @property
    def track_mode(self) -> str | None:
        """The workers' DISTTRAIN_TRACK (workerenv.TRACK)."""
        return None if self.track is None else "ranks" if self.track_ranks else "reduced"

    def _check_apart_from_inputs(self) -> None:
        """Checkpoints written into an input channel would land in the user's dataset (and a
        channel read from the checkpoints would change under the job): neither may hold the other."""
        checkpoints = _comparable(self.checkpoint_s3_uri)
        for channel, location in self.inputs.items():
            data = _comparable(location)
            if _within(checkpoints, data) or _within(data, checkpoints):
                raise UsageError(f"checkpoint_s3_uri {self.checkpoint_s3_uri} and inputs.{channel} {location} "
                                 "overlap: checkpoints would be written into the job's input data; give "
                                 "checkpoint_s3_uri a location of its own")


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """A training job. Paths are absolute once loaded through :func:`spec_from_mapping`."""

    name: str
    program: Program
    placement: Placement = field(default_factory=Placement)
    container: Container = field(default_factory=Container)

    def __post_init__(self) -> None:
        check_name(self.name)
        if len(self.name) > MAX_BASE_NAME:
            raise UsageError(f"name may have at most {MAX_BASE_NAME} characters (each run appends a "
                             f"{RUN_SUFFIX_LEN}-character timestamp), got {len(self.name)}")
        if self.program.command is not None and not contract_for(self.container.contract).runs_commands:
            raise UsageError("command is SDK v3's SourceCode(command=...): it needs contract: "
                             f"{' or '.join(c.name for c in CONTRACTS.values() if c.runs_commands)}")
        if self.program.distribution.kind == "mpi" and self.placement.launcher != "local":
            raise UsageError(f"distribution mpi runs the instances of launcher local only (this job: "
                             f"{self.placement.launcher}); use torch_distributed, or run mpirun yourself")
        where = self.placement
        if where.min_instance_count is not None and where.min_instance_count < where.instance_count and (
                self.program.distribution.kind in ("mpi", *TF_KINDS) or self.program.framework != "pytorch"):
            raise UsageError(f"min_instance_count (an elastic job) runs PyTorch on torch's elastic agent; "
                             f"distribution {self.program.distribution.kind} (framework {self.program.framework}) "
                             "needs every instance: leave out min_instance_count")

    @property
    def distribution(self) -> Distribution:
        return self.program.distribution

    def to_dict(self) -> dict[str, Any]:
        """The flat keys the spec was loaded from (those of a YAML job spec), every one of them."""
        data: dict[str, Any] = {"name": self.name}
        for part in (self.program, self.placement, self.container):
            for key in _keys(type(part)):
                value = getattr(part, key)
                if isinstance(value, Distribution):
                    value = value.to_dict()
                elif isinstance(value, (tuple, list)):
                    value = [dict(v) if isinstance(v, Mapping) else v for v in value]
                elif isinstance(value, Mapping):
                    value = copy.deepcopy(dict(value))
                data[key] = value
        return data

    def to_record(self) -> dict[str, Any]:
        """:meth:`to_dict` for the job history: values of secret-looking keys (env, nested
        storage_options, hyperparameters) are not kept."""
        return mask_secrets(self.to_dict())


@functools.cache
def _keys(part: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(part))


PARTS = (Program, Placement, Container)
KNOWN_KEYS = ("name", *(key for part in PARTS for key in _keys(part)))
REQUIRED_KEYS = ("name", "entry_point")
_RENAMED = {"backend": "launcher"}  # old spellings, still read (with one line of warning)


def spec_from_mapping(data: Any, *, base_dir: str | os.PathLike, source: str = "job spec") -> JobSpec:
    """A validated spec from a YAML document or keyword arguments; errors name ``source``."""
    if not isinstance(data, Mapping):
        raise UsageError(f"{source}: expected a mapping of keys (name, entry_point, ...), got {type(data).__name__}")
    fields = _renamed(dict(data), source)
    unknown = [key for key in fields if key not in KNOWN_KEYS]
    if unknown:
        raise UsageError(f"{source}: unknown key {shown(unknown[0])}; known keys: {', '.join(KNOWN_KEYS)}")
    for key in REQUIRED_KEYS:
        if key not in fields and not (key == "entry_point" and fields.get("command")):
            raise UsageError(f"{source}: {key} is required")
    fields.setdefault("entry_point", "")  # a command job's
    try:
        check_name(fields["name"])
        fields = _normalised(fields, Path(base_dir))
        fields["distribution"] = parse_distribution(fields.get("distribution"))
        parts = {part: part(**{k: fields[k] for k in _keys(part) if k in fields}) for part in PARTS}
        return JobSpec(name=fields["name"], program=parts[Program], placement=parts[Placement],
                       container=parts[Container])
    except UsageError as err:
        raise UsageError(f"{source}: {err}") from None


def _renamed(fields: dict[str, Any], source: str) -> dict[str, Any]:
    for old, new in _RENAMED.items():
        if old in fields:
            if new in fields:
                raise UsageError(f"{source}: give {new}, not both {new} and {old} (its old name)")
            print(f"disttrain: warning: {source}: the key {old} is deprecated; use {new}: {fields[old]}",
                  file=sys.stderr, flush=True)
            fields[new] = fields.pop(old)
    return fields


def _normalised(fields: dict[str, Any], base: Path) -> dict[str, Any]:
    """What the user meant: YAML numbers as environment text, lists from comma-separated text,
    one instance per ssh host, relative local paths made absolute (checked first: a NUL or a
    10 KB name would break the path functions)."""
    if isinstance(fields.get("env"), Mapping):
        fields["env"] = {k: _scalar_text(v) for k, v in fields["env"].items()}
    for key in ("hosts", "ssh_options"):
        if key in fields:
            fields[key] = _sequence(key, fields[key])
    if fields.get("launcher") == "ssh" and "instance_count" not in fields and fields.get("hosts"):
        fields["instance_count"] = len(fields.get("hosts", ()))  # one instance per host
    count = fields.get("instance_count")
    if isinstance(count, str) and ":" in count:  # "2:3", torchrun's MIN:MAX (quoted: YAML reads 2:3 as 123)
        low, _, high = count.partition(":")
        if not (low.strip().isdigit() and high.strip().isdigit()):
            raise UsageError(f"instance_count must be a positive integer or MIN:MAX like '2:3', got {count!r}")
        if "min_instance_count" in fields:
            raise UsageError(f"instance_count {count!r} gives the minimum: leave out min_instance_count")
        fields["min_instance_count"], fields["instance_count"] = int(low), int(high)
    fields["source_dir"] = _local_absolute(fields.get("source_dir", "."), base, "source_dir")
    if isinstance(fields.get("inputs"), Mapping):
        for channel in fields["inputs"]:
            _check_channel(channel)  # before its name is part of a message
        fields["inputs"] = {k: _local_absolute(v, base, f"inputs.{k}") for k, v in fields["inputs"].items()}
    if fields.get("output_path") is not None:
        fields["output_path"] = _local_absolute(fields["output_path"], base, "output_path")
    return fields


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
    check_path(key, value)
    return str((base / os.path.expanduser(value)).resolve())


def _comparable(location: str) -> str:
    """A location to compare with another: a local path normalised, a URL without trailing slashes."""
    if location.startswith("file://"):
        location = location[len("file://"):]
    if not is_url(location):
        return os.path.normpath(os.path.abspath(location))
    return location.rstrip("/")


def _within(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


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


def _mapping(key: str, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise UsageError(f"{key} must be a mapping (key: value), got {shown(value)}")


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UsageError(f"{key} must be one of {', '.join(choices)}, got {shown(value)}")
