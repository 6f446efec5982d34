"""SDK v3 ModelTrainer's container contract: what a script sees when ``contract: model_trainer``.

SDK v3 no longer relies on the training toolkit inside the image: it ships its own drivers
(``sm_train.sh``, ``environment.py``, the basic/torchrun/mpi drivers) and they set up a
different, smaller contract, reproduced here:

- ``hyperparameters.json`` holds each value *safe-serialized*: a string as it is, anything
  else as JSON (``"true"``, ``"[1, 2]"``), where the toolkit JSON-encodes every value;
- the script's arguments are ``--key value`` in the hyperparameters' own order (not sorted,
  no ``-k`` for a one-letter key), each value safe-serialized after a JSON round trip
  (``--use_bias true``, ``--ids [1, 2]``, ``--name abc``);
- ``SM_*`` variables, safe-serialized: the paths, ``SM_HPS``/``SM_HP_<KEY>``, ``SM_CHANNELS``/
  ``SM_CHANNEL_<NAME>``, ``SM_HOSTS`` (sorted), ``SM_HOST_COUNT``, ``SM_CURRENT_HOST_RANK``
  (the host's index among the sorted hosts), ``SM_MASTER_ADDR``/``SM_MASTER_PORT``,
  ``SM_SOURCE_DIR``/``SM_ENTRY_SCRIPT``, ``SM_DISTRIBUTED_CONFIG`` (the Torchrun/MPI settings),
  ``SM_TRAINING_ENV``; also written as ``export`` lines to ``/opt/ml/input/sm_training.env``.

Paths are the instance folder's own (what ``/opt/ml`` shows inside the instance's mount
namespace), so they are right with or without one. ``SM_MASTER_ADDR`` is ``algo-1``, which
each instance resolves through its own ``/etc/hosts`` (see :mod:`disttrain.agent.optml`).
``SM_MASTER_PORT`` is the job's rendezvous port + 1, not SageMaker's fixed 7777: instances of
several jobs may share a machine here, and the rendezvous port itself is held by the agents.
The variables are made purely (the plan holds them: ``--dry-run`` prints them); the files are
written from the same values when the instances start.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from ..atomic import write_atomic
from .distribution import TORCH_KINDS, Distribution
from .layout import InstancePaths
from .sagemaker import LOG_LEVEL, Instance, RunFacts, input_data_config, resource_config, write_json

DRIVER = "disttrain.jobs.smdriver"  # runs SourceCode(command=...) and .sh entry scripts in the instance


def safe_serialize(value: Any) -> str:
    """v3's text of a value: a string as it is, anything else JSON (``str()`` if not JSON-able)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


def safe_deserialize(value: Any) -> Any:
    """The inverse the drivers apply: JSON when the text is JSON, else the text itself."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def encoded_hyperparameters(hyperparameters: Mapping[str, Any]) -> dict[str, str]:
    """``hyperparameters.json`` as ModelTrainer writes it."""
    return {key: safe_serialize(value) for key, value in hyperparameters.items()}


def decoded_hyperparameters(hyperparameters: Mapping[str, Any]) -> dict[str, Any]:
    """``SM_HPS``: what environment.py reads back from hyperparameters.json."""
    return {key: safe_deserialize(value) for key, value in encoded_hyperparameters(hyperparameters).items()}


def cmd_args(hyperparameters: Mapping[str, Any]) -> list[str]:
    """The script's arguments, as v3's drivers build them from ``SM_HPS``."""
    args: list[str] = []
    for key, value in decoded_hyperparameters(hyperparameters).items():
        args += [f"--{key}", safe_serialize(safe_deserialize(value))]
    return args


def distributed_config(distribution: Distribution, processes: int | str) -> dict[str, Any]:
    """``SM_DISTRIBUTED_CONFIG``: the Torchrun or MPI object's fields, as ModelTrainer dumps them
    ({} without one). ModelTrainer maps Torchrun and MPI onto the job's distribution."""
    if distribution.kind in TORCH_KINDS:
        return {"process_count_per_node": processes if isinstance(processes, int) else None, "smp": None}
    if distribution.kind == "mpi":
        options = shlex.split(distribution.custom_mpi_options or "")
        return {"process_count_per_node": distribution.processes_per_host, "mpi_additional_options": options or None}
    return {}


def training_env(inst: Instance, paths: InstancePaths, *, master: tuple[str, int], source_dir: str,
                 entry_script: str, distributed: Mapping[str, Any]) -> dict[str, Any]:
    """Every variable environment.py sets, as Python values (safe-serialized on the way out)."""
    channels = sorted(inst.channels)
    hosts = sorted(inst.names)
    hps = decoded_hyperparameters(inst.hyperparameters)
    resources = resource_config(inst)
    inputs = input_data_config(inst.channels)
    env: dict[str, Any] = {
        "SM_MODEL_DIR": str(paths.model),
        "SM_INPUT_DIR": str(paths.input),
        "SM_INPUT_DATA_DIR": str(paths.data),
        "SM_INPUT_CONFIG_DIR": str(paths.config),
        "SM_OUTPUT_DIR": str(paths.output),
        "SM_OUTPUT_FAILURE": str(paths.failure),
        "SM_OUTPUT_DATA_DIR": str(paths.output_data),
        "SM_LOG_LEVEL": LOG_LEVEL,
        "SM_MASTER_ADDR": master[0],
        "SM_MASTER_PORT": master[1],
        "SM_SOURCE_DIR": source_dir,
        "SM_ENTRY_SCRIPT": entry_script,
    }
    if distributed:
        env["SM_DISTRIBUTED_CONFIG"] = dict(distributed)
    for name in channels:
        env[f"SM_CHANNEL_{name.upper()}"] = str(paths.channel(name))
    env["SM_CHANNELS"] = channels
    for key, value in hps.items():
        env[f"SM_HP_{key.replace('-', '_').upper()}"] = value
    env["SM_HPS"] = hps
    env.update({
        "SM_CURRENT_HOST": inst.name,
        "SM_CURRENT_INSTANCE_TYPE": inst.instance_type,
        "SM_HOSTS": hosts,
        "SM_NETWORK_INTERFACE_NAME": inst.ifname,
        "SM_HOST_COUNT": len(hosts),
        "SM_CURRENT_HOST_RANK": hosts.index(inst.name),
        "SM_NUM_CPUS": inst.num_cpus,
        "SM_NUM_GPUS": inst.num_gpus,
        "SM_NUM_NEURONS": 0,
        "SM_RESOURCE_CONFIG": resources,
        "SM_INPUT_DATA_CONFIG": inputs,
    })
    env["SM_TRAINING_ENV"] = {
        "channel_input_dirs": {name: env[f"SM_CHANNEL_{name.upper()}"] for name in channels},
        "current_host": inst.name,
        "current_instance_type": inst.instance_type,
        "hosts": hosts,
        "master_addr": master[0],
        "master_port": master[1],
        "hyperparameters": hps,
        "input_data_config": inputs,
        "input_config_dir": str(paths.config),
        "input_data_dir": str(paths.data),
        "input_dir": str(paths.input),
        "job_name": inst.job_name,
        "log_level": LOG_LEVEL,
        "model_dir": str(paths.model),
        "network_interface_name": inst.ifname,
        "num_cpus": inst.num_cpus,
        "num_gpus": inst.num_gpus,
        "num_neurons": 0,
        "output_data_dir": str(paths.output_data),
        "resource_config": resources,
    }
    return env


def instance_vars(inst: Instance, paths: InstancePaths, *, master: tuple[str, int], source_dir: str,
                  entry_script: str, distributed: Mapping[str, Any]) -> dict[str, str]:
    """One instance's variables, as the process environment holds them (pure)."""
    values = training_env(inst, paths, master=master, source_dir=source_dir, entry_script=entry_script,
                          distributed=distributed)
    env = {key: safe_serialize(value) for key, value in values.items()}
    env["TRAINING_JOB_NAME"] = inst.job_name  # every SageMaker container has it; the drivers' failure text
    return env


def write_files(inst: Instance, paths: InstancePaths, env: Mapping[str, str]) -> None:
    """``input/config/*.json`` (hyperparameters the v3 way) and ``input/sm_training.env`` from
    :func:`instance_vars`' values; the owner's only, as hyperparameters may be secrets."""
    write_json(paths.config / "hyperparameters.json", encoded_hyperparameters(inst.hyperparameters))
    write_json(paths.config / "resourceconfig.json", resource_config(inst))
    write_json(paths.config / "inputdataconfig.json", input_data_config(inst.channels))
    write_atomic(paths.input / "sm_training.env",
                 "".join(f"export {key}={shlex.quote(value)}\n" for key, value in env.items()), mode=0o600)


def master_endpoint(addresses: Sequence[str], master_port: int, *, names_resolve: bool) -> tuple[str, int]:
    """``(SM_MASTER_ADDR, SM_MASTER_PORT)``: ``algo-1`` where the instances resolve it (their own
    /etc/hosts), else the first instance's address; the rendezvous port + 1."""
    return ("algo-1" if names_resolve else addresses[0]), master_port + 1


def worker_command(entry_point: str, command: str | None, hyperparameters: Mapping[str, Any]
                   ) -> tuple[str, bool, tuple[str, ...]]:
    """(entry, is_module, args) each instance starts: the script with v3's arguments, or the
    driver that runs ``command`` (or a ``.sh`` entry script, as v3's basic driver does) in bash."""
    if command is not None:
        return DRIVER, True, ("--command", command)
    if entry_point.endswith(".sh"):
        return DRIVER, True, ("--script", entry_point, *cmd_args(hyperparameters))
    return entry_point, False, tuple(cmd_args(hyperparameters))


class ModelTrainerContract:
    """SDK v3 ModelTrainer's contract: a :class:`~disttrain.jobs.contract.ContainerContract`."""

    name = "model_trainer"
    entry_name = "SourceCode.entry_script"
    runs_commands = True  # SourceCode(command=...)

    def encoded_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> dict[str, str]:
        return encoded_hyperparameters(hyperparameters)

    def worker_command(self, facts: RunFacts, hyperparameters: Mapping[str, Any]
                       ) -> tuple[str, bool, tuple[str, ...]]:
        return worker_command(facts.entry_point, facts.command, hyperparameters)

    def instance_env(self, inst: Instance, paths: InstancePaths, facts: RunFacts) -> dict[str, str]:
        master = master_endpoint(facts.addresses, facts.master_port, names_resolve=facts.names_resolve)
        return instance_vars(inst, paths, master=master, source_dir=facts.cwd, entry_script=facts.entry_point,
                             distributed=distributed_config(facts.distribution, facts.processes_per_instance))

    def write_files(self, inst: Instance, paths: InstancePaths, facts: RunFacts) -> None:
        write_files(inst, paths, self.instance_env(inst, paths, facts))


MODEL_TRAINER = ModelTrainerContract()
