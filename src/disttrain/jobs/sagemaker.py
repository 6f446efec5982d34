"""SageMaker's training contract: script arguments, config files and ``SM_*`` variables.

What a SageMaker script reads, produced the way SageMaker's training toolkit does, so the
script runs here unchanged: hyperparameters as ``--key value`` (keys sorted; strings
verbatim, everything else as JSON: ``3``, ``0.1``, ``true``, ``[1, 2]``), the same values in
``SM_HPS`` (JSON) and ``SM_HP_<KEY>``, and every directory variable pointing into the
instance's own ``/opt/ml``-shaped folder.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..atomic import write_atomic
from .layout import InstancePaths, JobLayout


def hp_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def hyperparameter_args(hyperparameters: Mapping[str, Any]) -> list[str]:
    args: list[str] = []
    for key in sorted(hyperparameters):
        args += [f"--{key}", hp_text(hyperparameters[key])]
    return args


def _env_key(name: str) -> str:
    return name.upper().replace("-", "_")


def resource_config(host: str, hosts: tuple[str, ...], ifname: str) -> dict[str, Any]:
    return {"current_host": host, "hosts": list(hosts), "network_interface_name": ifname}


def input_data_config(channels: Mapping[str, str]) -> dict[str, Any]:
    return {name: {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated"} for name in sorted(channels)}


def sm_env(
    *,
    layout: JobLayout,
    host: str,
    hyperparameters: Mapping[str, Any],
    channels: Mapping[str, str],
    entry_point: str,
    source_dir: str,
    num_gpus: int,
    num_cpus: int,
    ifname: str,
) -> dict[str, str]:
    """The ``SM_*`` variables of one instance."""
    inst = layout.instance(host)
    env = {
        "SM_HOSTS": json.dumps(list(layout.hosts)),
        "SM_CURRENT_HOST": host,
        "SM_CURRENT_INSTANCE_TYPE": "local",
        "SM_NUM_GPUS": str(num_gpus),
        "SM_NUM_CPUS": str(num_cpus),
        "SM_NETWORK_INTERFACE_NAME": ifname,
        "SM_RESOURCE_CONFIG": json.dumps(resource_config(host, layout.hosts, ifname)),
        "SM_MODEL_DIR": str(inst.model),
        "SM_INPUT_DIR": str(inst.input),
        "SM_INPUT_CONFIG_DIR": str(inst.config),
        "SM_INPUT_DATA_CONFIG": json.dumps(input_data_config(channels)),
        "SM_OUTPUT_DIR": str(inst.output),
        "SM_OUTPUT_DATA_DIR": str(inst.output_data),
        "SM_CHANNELS": json.dumps(sorted(channels)),
        "SM_HPS": json.dumps(dict(hyperparameters)),
        "SM_USER_ENTRY_POINT": entry_point,
        "SM_USER_ARGS": json.dumps(hyperparameter_args(hyperparameters)),
        "SM_MODULE_DIR": source_dir,
    }
    for name in channels:
        env[f"SM_CHANNEL_{_env_key(name)}"] = str(inst.channel(name))
    for key, value in hyperparameters.items():
        env[f"SM_HP_{_env_key(key)}"] = hp_text(value)
    return env


def write_config(inst: InstancePaths, *, host: str, hosts: tuple[str, ...], ifname: str,
                 hyperparameters: Mapping[str, Any], channels: Mapping[str, str]) -> None:
    """``input/config/{hyperparameters,resourceconfig,inputdataconfig}.json`` of one instance."""
    write_json(inst.config / "hyperparameters.json", dict(hyperparameters))
    write_json(inst.config / "resourceconfig.json", resource_config(host, hosts, ifname))
    write_json(inst.config / "inputdataconfig.json", input_data_config(channels))


def write_json(path: Path, data: Any) -> None:
    """Whole or not at all: a temporary file renamed over ``path``."""
    write_atomic(path, json.dumps(data, indent=2) + "\n")
