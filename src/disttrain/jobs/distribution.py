"""``distribution=``: how the SageMaker toolkits start a script on each instance, here.

=============================== ==========================================================
none                            the script once per instance (SageMaker's default)
torch_distributed, pytorchddp   torch's elastic agent per instance, one process per GPU
smdistributed                   the same (AWS's smdistributed library exists only on AWS)
multi_worker_mirrored_strategy  one TensorFlow worker per instance with its ``TF_CONFIG``
parameter_server                per instance a ps task and a master/worker task, ``TF_CONFIG``
                                as the TensorFlow toolkit writes it
mpi                             Open MPI's ``mpirun`` across the instances
=============================== ==========================================================

Pure functions: the dict the user passed → a :class:`Distribution`, parsed once when the job
spec is loaded (a mistyped key or two strategies at once are refused, naming the key, before
anything runs); the spec's program carries the typed value from then on.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config.text import check_value
from ..errors import UsageError

TORCH_KINDS = ("torch_distributed", "pytorchddp", "smdistributed")
TF_KINDS = ("multi_worker_mirrored_strategy", "parameter_server")
KINDS = (*TORCH_KINDS, *TF_KINDS, "mpi")
_OPTIONS = {
    "torch_distributed": {"enabled"},
    "pytorchddp": {"enabled", "custom_mpi_options"},
    "smdistributed": {"dataparallel", "modelparallel"},
    "multi_worker_mirrored_strategy": {"enabled"},
    "parameter_server": {"enabled", "custom_mpi_options"},
    "mpi": {"enabled", "processes_per_host", "custom_mpi_options"},
}
# The sagemaker_* hyperparameter the SDK adds for each kind (SM_FRAMEWORK_PARAMS).
FLAGS = {
    "torch_distributed": "sagemaker_torch_distributed_enabled",
    "pytorchddp": "sagemaker_pytorch_ddp_enabled",
    "smdistributed": "sagemaker_distributed_dataparallel_enabled",
    "multi_worker_mirrored_strategy": "sagemaker_multi_worker_mirrored_strategy_enabled",
    "parameter_server": "sagemaker_parameter_server_enabled",
    "mpi": "sagemaker_mpi_enabled",
}
PS_PORT_OFFSET = 1000  # ps task of instance i: master_port + PS_PORT_OFFSET + i


@dataclass(frozen=True)
class Distribution:
    kind: str  # "none" or one of KINDS
    processes_per_host: int | None = None  # mpi
    custom_mpi_options: str = ""
    # The mapping as the user wrote it: what the job's record shows and a Slurm batch step ships.
    source: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        if self.source or self.kind == "none":
            return copy.deepcopy(dict(self.source))
        options: dict[str, Any] = {"enabled": True}
        if self.kind == "mpi":
            options.update(processes_per_host=self.processes_per_host or 1, custom_mpi_options=self.custom_mpi_options)
        return {self.kind: options}

    def check_framework(self, framework: str) -> None:
        """A torch strategy in a TensorFlow job (or the reverse): one line naming the fix."""
        if self.kind in TORCH_KINDS and framework != "pytorch":
            raise UsageError(f"distribution {self.kind} is for PyTorch jobs; for TensorFlow use "
                             "multi_worker_mirrored_strategy, parameter_server or mpi")
        if self.kind in TF_KINDS and framework != "tensorflow":
            raise UsageError(f"distribution {self.kind} is for TensorFlow jobs (framework tensorflow); "
                             "for PyTorch use torch_distributed or mpi")

    @property
    def launch_framework(self) -> str:
        """What the launch plans for: TensorFlow's TF_CONFIG only for multi_worker_mirrored_strategy
        (parameter_server writes its own, beside a ps task: see the ps shim)."""
        return "tensorflow" if self.kind == "multi_worker_mirrored_strategy" else "pytorch"

    def processes_per_instance(self, requested: int | str) -> int | str:
        """none: once per instance, as SageMaker (unless a number was asked for); the TensorFlow
        strategies: one process per instance (the strategy uses every device of it); torch kinds:
        what the job asked for ("auto": one per GPU, else one); mpi: processes_per_host."""
        if self.kind in TORCH_KINDS or (self.kind == "none" and requested != "auto"):
            return requested
        if self.kind == "mpi":
            return self.processes_per_host or 1
        return 1

    @property
    def framework_params(self) -> dict[str, Any]:
        if self.kind == "none":
            return {}
        params: dict[str, Any] = {FLAGS[self.kind]: True}
        if self.kind == "mpi":
            params["sagemaker_mpi_num_of_processes_per_host"] = self.processes_per_host or 1
            params["sagemaker_mpi_custom_mpi_options"] = self.custom_mpi_options
        return params

    def note(self) -> str | None:
        if self.kind == "smdistributed":
            return ("disttrain: distribution smdistributed runs as torch_distributed (torch's elastic agent); "
                    "AWS's smdistributed library exists only on SageMaker, use torch.distributed in the script")
        return None


def _enabled(options: Any) -> bool:
    if isinstance(options, Mapping):
        if "enabled" in options:
            return bool(options["enabled"])
        return any(_enabled(v) for v in options.values() if isinstance(v, Mapping)) or not options
    return bool(options)


NONE = Distribution("none")


def parse_distribution(value: Any, *, framework: str | None = None) -> Distribution:
    """The distribution a job asked for; a mistake is one line naming the key and the fix.
    ``framework``: also check that the strategy is one of that framework's."""
    if value is None or value == {}:
        return NONE
    if not isinstance(value, Mapping):
        raise UsageError(f"distribution must be a dict like {{'torch_distributed': {{'enabled': True}}}}, got {value!r}")
    for key in value:
        if key == "instance_groups":
            raise UsageError("distribution: instance_groups (heterogeneous clusters) is not supported; "
                             "remove it, every instance runs the same")
        if key not in KINDS:
            raise UsageError(f"distribution: unknown key {key!r}; known: {', '.join(KINDS)}")
        options = value[key]
        if not isinstance(options, Mapping):
            raise UsageError(f"distribution.{key} must be a dict like {{'enabled': True}}, got {options!r}")
        for option in options:
            if option not in _OPTIONS[key]:
                raise UsageError(f"distribution.{key}: unknown option {option!r}; known: "
                                 f"{', '.join(sorted(_OPTIONS[key]))}")
    chosen = [key for key in value if _enabled(value[key])]
    if len(chosen) > 1:
        raise UsageError(f"distribution: {' and '.join(chosen)} cannot be combined; keep one of them")
    source = copy.deepcopy(dict(value))
    if not chosen:
        return Distribution("none", source=source)
    kind = chosen[0]
    options = value[kind]
    if kind == "mpi":
        per_host = options.get("processes_per_host", 1)
        if not isinstance(per_host, int) or isinstance(per_host, bool) or per_host < 1:
            raise UsageError(f"distribution.mpi.processes_per_host must be a positive integer, got {per_host!r}")
        custom = options.get("custom_mpi_options", "")
        if not isinstance(custom, str):
            raise UsageError(f"distribution.mpi.custom_mpi_options must be a string like '-x NCCL_DEBUG=INFO', "
                             f"got {custom!r}")
        check_value("distribution.mpi.custom_mpi_options", custom)
        dist = Distribution("mpi", processes_per_host=per_host, custom_mpi_options=custom, source=source)
    else:
        dist = Distribution(kind, source=source)
    if framework is not None:
        dist.check_framework(framework)
    return dist


def ps_tf_config(addresses: Sequence[str], master_port: int, index: int, *, ps_task: bool) -> str:
    """``TF_CONFIG`` for parameter_server, as the TensorFlow toolkit builds it: instance 0 is
    the master, the others workers, and every instance also runs a ps task."""
    def where(i: int, port: int) -> str:
        address = addresses[i]
        return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"

    n = len(addresses)
    cluster: dict[str, list[str]] = {"master": [where(0, master_port + 1)],
                                     "ps": [where(i, master_port + PS_PORT_OFFSET + i) for i in range(n)]}
    if n > 1:
        cluster["worker"] = [where(i, master_port + 1 + i) for i in range(1, n)]
    if ps_task:
        task = {"type": "ps", "index": index}
    elif index == 0:
        task = {"type": "master", "index": 0}
    else:
        task = {"type": "worker", "index": index - 1}
    return json.dumps({"cluster": cluster, "environment": "cloud", "task": task})
