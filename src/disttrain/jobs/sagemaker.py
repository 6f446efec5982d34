"""SageMaker's training contract: script arguments, config files and every ``SM_*`` variable.

What a SageMaker script reads, produced the way SageMaker's training toolkit
(``sagemaker_training.environment``/``mapping``) does, so the script runs here unchanged:

- ``hyperparameters.json`` holds each value JSON-encoded as a string (what the SDK writes);
  the toolkit decodes each one, so the script sees JSON types again;
- the script's arguments are the decoded values, keys sorted, ``--key`` (``-k`` for a
  one-letter key), values as Python's ``str()`` writes them (``True``, ``0.1``, ``[1, 2]``;
  a mapping as ``a=1,b=2``), each one argv item (spaces and ``;`` arrive intact);
- ``SM_<NAME>`` for every entry of the toolkit's environment: strings verbatim, anything
  else compact sorted JSON; ``SM_TRAINING_ENV`` is the whole environment as JSON;
- hyperparameters starting with ``sagemaker_`` (program, submit directory, distribution
  flags) are the framework's, never the script's: they go to ``SM_FRAMEWORK_PARAMS``.

Directories point into the instance's own ``/opt/ml``-shaped folder (see :mod:`.layout`),
which the instance's processes also see at ``/opt/ml`` when a mount namespace can be made.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..atomic import write_atomic
from .layout import InstancePaths

if TYPE_CHECKING:
    from .distribution import Distribution

INSTANCE_GROUP = "homogeneousCluster"  # the toolkit's name for the one group of a plain job
LOG_LEVEL = 20  # logging.INFO, the SDK's default container_log_level
# Hyperparameters the SDK adds for the container itself; the toolkit keeps them out of
# SM_FRAMEWORK_PARAMS (and every sagemaker_* key out of the script's arguments).
RESERVED = frozenset({
    "sagemaker_program", "sagemaker_submit_directory", "sagemaker_region", "sagemaker_job_name",
    "sagemaker_container_log_level", "sagemaker_enable_cloudwatch_metrics",
})


def decode(value: Any) -> str:
    """The toolkit's text of one value: strings verbatim, anything else ``str()``."""
    if isinstance(value, bytes):
        return value.decode("latin1")
    return "" if value is None else str(value)


def cmd_args(hyperparameters: Mapping[str, Any]) -> list[str]:
    """The script's arguments, as the toolkit builds them from decoded hyperparameters."""
    args: list[str] = []
    for key in sorted(hyperparameters):
        if key.startswith("sagemaker_"):
            continue
        value = hyperparameters[key]
        if isinstance(value, Mapping):
            text = ",".join(f"{k}={v}" for k, v in sorted(value.items()))
        else:
            text = decode(value)
        args += [f"--{key}" if len(key) > 1 else f"-{key}", text]
    return args


# The runner and YAML jobs call it by this name.
hyperparameter_args = cmd_args


def env_text(value: Any) -> str:
    """An ``SM_*`` value: strings verbatim, None empty, anything else compact sorted JSON."""
    if isinstance(value, bytes):
        return value.decode("latin1")
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def encoded_hyperparameters(hyperparameters: Mapping[str, Any]) -> dict[str, str]:
    """``hyperparameters.json`` as the SDK writes it: every value a JSON string."""
    return {key: json.dumps(value) for key, value in hyperparameters.items()}


def decoded_hyperparameters(encoded: Mapping[str, str]) -> dict[str, Any]:
    """The toolkit's reading: each value JSON-decoded, kept as text when it is not JSON."""
    decoded = {}
    for key, value in encoded.items():
        try:
            decoded[key] = json.loads(value)
        except (TypeError, ValueError):
            decoded[key] = value
    return decoded


def _env_key(name: str) -> str:
    return name.upper().replace("-", "_")


@dataclass(frozen=True, kw_only=True)
class Instance:
    """What differs between the instances of a job (and what the contract needs of the job)."""

    job_name: str
    name: str
    names: tuple[str, ...]
    instance_type: str = "local"
    ifname: str = "lo"
    num_gpus: int = 0
    num_cpus: int = 1
    entry_point: str = "train.py"
    module_dir: str = "."
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)  # the user's, not yet encoded
    framework_params: Mapping[str, Any] = field(default_factory=dict)  # sagemaker_* (distribution flags)
    channels: tuple[str, ...] = ()
    framework_module: str = "disttrain.jobs.runner:run_job"


def resource_config(inst: Instance) -> dict[str, Any]:
    return {
        "current_host": inst.name,
        "current_instance_type": inst.instance_type,
        "current_group_name": INSTANCE_GROUP,
        "hosts": list(inst.names),
        "instance_groups": [{"instance_group_name": INSTANCE_GROUP, "instance_type": inst.instance_type,
                             "hosts": list(inst.names)}],
        "network_interface_name": inst.ifname,
    }


def input_data_config(channels: tuple[str, ...] | Mapping[str, Any]) -> dict[str, Any]:
    return {name: {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated",
                   "RecordWrapperType": "None"} for name in sorted(channels)}


def all_hyperparameters(inst: Instance) -> dict[str, Any]:
    """The user's hyperparameters plus the SDK's own ``sagemaker_*`` entries."""
    return {
        **dict(inst.hyperparameters),
        "sagemaker_program": inst.entry_point,
        "sagemaker_submit_directory": inst.module_dir,
        "sagemaker_region": "local",
        "sagemaker_job_name": inst.job_name,
        "sagemaker_container_log_level": LOG_LEVEL,
        **dict(inst.framework_params),
    }


def training_env(inst: Instance, paths: InstancePaths) -> dict[str, Any]:
    """The toolkit's environment of one instance: ``SM_TRAINING_ENV`` and the source of every ``SM_*``."""
    hps = decoded_hyperparameters(encoded_hyperparameters(all_hyperparameters(inst)))
    user_hps = {k: v for k, v in hps.items() if not k.startswith("sagemaker_")}
    framework = {k: v for k, v in hps.items() if k.startswith("sagemaker_") and k not in RESERVED}
    group = {"instance_group_name": INSTANCE_GROUP, "instance_type": inst.instance_type, "hosts": list(inst.names)}
    distributed = any(k.endswith("_enabled") and v for k, v in framework.items())
    return {
        "additional_framework_parameters": framework,
        "channel_input_dirs": {name: str(paths.channel(name)) for name in sorted(inst.channels)},
        "current_host": inst.name,
        "current_instance_group": INSTANCE_GROUP,
        "current_instance_group_hosts": list(inst.names),
        "current_instance_type": inst.instance_type,
        "distribution_hosts": list(inst.names),
        "distribution_instance_groups": [INSTANCE_GROUP] if distributed else [],
        "framework_module": inst.framework_module,
        "hosts": list(inst.names),
        "hyperparameters": user_hps,
        "input_config_dir": str(paths.config),
        "input_data_config": input_data_config(inst.channels),
        "input_dir": str(paths.input),
        "instance_groups": [INSTANCE_GROUP],
        "instance_groups_dict": {INSTANCE_GROUP: group},
        "is_hetero": False,
        "is_master": inst.name == inst.names[0],
        "is_modelparallel_enabled": bool(framework.get("sagemaker_modelparallel_enabled")),
        "job_name": inst.job_name,
        "log_level": LOG_LEVEL,
        "master_hostname": inst.names[0],
        "model_dir": str(paths.model),
        "module_dir": inst.module_dir,
        "module_name": inst.entry_point.removesuffix(".py"),
        "network_interface_name": inst.ifname,
        "num_cpus": inst.num_cpus,
        "num_gpus": inst.num_gpus,
        "num_neurons": 0,
        "output_data_dir": str(paths.output_data),
        "output_dir": str(paths.output),
        "output_intermediate_dir": str(paths.output_intermediate),
        "resource_config": resource_config(inst),
        "user_entry_point": inst.entry_point,
    }


def sm_env(inst: Instance, paths: InstancePaths) -> dict[str, str]:
    """Every ``SM_*`` variable the toolkit sets, for one instance."""
    env = training_env(inst, paths)
    hps = env["hyperparameters"]
    values: dict[str, Any] = {
        "hosts": env["hosts"],
        "network_interface_name": env["network_interface_name"],
        "hps": hps,
        "user_entry_point": env["user_entry_point"],
        "framework_params": env["additional_framework_parameters"],
        "resource_config": env["resource_config"],
        "input_data_config": env["input_data_config"],
        "output_data_dir": env["output_data_dir"],
        "channels": sorted(env["channel_input_dirs"]),
        "current_host": env["current_host"],
        "current_instance_type": env["current_instance_type"],
        "current_instance_group": env["current_instance_group"],
        "current_instance_group_hosts": env["current_instance_group_hosts"],
        "instance_groups": env["instance_groups"],
        "instance_groups_dict": env["instance_groups_dict"],
        "distribution_instance_groups": env["distribution_instance_groups"],
        "is_hetero": env["is_hetero"],
        "module_name": env["module_name"],
        "log_level": env["log_level"],
        "framework_module": env["framework_module"],
        "input_dir": env["input_dir"],
        "input_config_dir": env["input_config_dir"],
        "output_dir": env["output_dir"],
        "num_cpus": env["num_cpus"],
        "num_gpus": env["num_gpus"],
        "num_neurons": env["num_neurons"],
        "model_dir": env["model_dir"],
        "module_dir": env["module_dir"],
        "training_env": env,
        "user_args": cmd_args(hps),
        "output_intermediate_dir": env["output_intermediate_dir"],
    }
    for name, path in env["channel_input_dirs"].items():
        values[f"channel_{name}"] = path
    for key, value in hps.items():
        values[f"hp_{key}"] = value
    return {f"SM_{_env_key(k)}": env_text(v) for k, v in values.items()}


def write_config(inst: Instance, paths: InstancePaths) -> None:
    """``input/config/{hyperparameters,resourceconfig,inputdataconfig}.json`` of one instance."""
    write_json(paths.config / "hyperparameters.json", encoded_hyperparameters(all_hyperparameters(inst)))
    write_json(paths.config / "resourceconfig.json", resource_config(inst))
    write_json(paths.config / "inputdataconfig.json", input_data_config(inst.channels))


def write_json(path: Path, data: Any) -> None:
    """Whole or not at all: a temporary file renamed over ``path``; the owner's only (hyperparameters
    may be secrets)."""
    write_atomic(path, json.dumps(data, indent=2) + "\n", mode=0o600)


@dataclass(frozen=True, kw_only=True)
class RunFacts:
    """What a contract is told about the run beyond one instance (pure values, from the plan)."""

    cwd: str  # where the script runs: source_dir, or its tarball extracted into the job folder
    entry_point: str
    command: str | None  # SDK v3's SourceCode(command=...)
    distribution: Distribution
    processes_per_instance: int | str
    addresses: Sequence[str]  # each instance's address, algo-1 first
    master_port: int  # the job's rendezvous port
    names_resolve: bool  # each instance resolves algo-K (its own /etc/hosts, with a private /opt/ml)


class ToolkitContract:
    """The training toolkit's contract (SDK v1/v2 estimators): a :class:`~disttrain.jobs.contract.ContainerContract`."""

    name = "toolkit"
    entry_name = "entry_point"
    runs_commands = False

    def encoded_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> dict[str, str]:
        return encoded_hyperparameters(hyperparameters)

    def worker_command(self, facts: RunFacts, hyperparameters: Mapping[str, Any]
                       ) -> tuple[str, bool, tuple[str, ...]]:
        return facts.entry_point, False, tuple(hyperparameter_args(hyperparameters))

    def instance_env(self, inst: Instance, paths: InstancePaths, facts: RunFacts) -> dict[str, str]:
        return sm_env(inst, paths)

    def write_files(self, inst: Instance, paths: InstancePaths, facts: RunFacts) -> None:
        write_config(inst, paths)


TOOLKIT = ToolkitContract()
