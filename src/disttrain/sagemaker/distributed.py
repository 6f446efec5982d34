"""SDK v3's distributed runners (``sagemaker.train.distributed``): ``Torchrun``, ``MPI``, ``SMP``.

Here ``Torchrun`` runs the entry script under torch's elastic agent on every instance (ranks
numbered across instances, as torchrun's ``--nnodes/--node_rank`` do), and ``MPI`` through one
Open MPI ``mpirun``, with ``process_count_per_node`` processes per instance (default: one per
GPU, else one). ``SMP`` (SageMaker model parallelism v2) exists only on AWS; it is accepted and
named as ignored.
"""

from __future__ import annotations

from typing import Any

from .configs import BaseConfig, config


class DistributedConfig(BaseConfig):
    """Base of the runners; ``driver_script`` names the SDK's driver it stands for."""

    driver_script = ""

    @property
    def driver_dir(self) -> str:
        return "disttrain"

    def distribution(self) -> dict[str, Any]:
        """The job's ``distribution`` (see disttrain.jobs.distribution)."""
        raise NotImplementedError


@config
class SMP(DistributedConfig):
    hybrid_shard_degree: int | None = None
    sm_activation_offloading: bool | None = None
    activation_loading_horizon: int | None = None
    fsdp_cache_flush_warnings: bool | None = None
    allow_empty_shards: bool | None = None
    tensor_parallel_degree: int | None = None
    context_parallel_degree: int | None = None
    expert_parallel_degree: int | None = None
    random_seed: int | None = None


@config
class Torchrun(DistributedConfig):
    process_count_per_node: int | None = None
    smp: SMP | None = None

    driver_script = "torchrun_driver.py"

    def distribution(self) -> dict[str, Any]:
        return {"torch_distributed": {"enabled": True}}


@config
class MPI(DistributedConfig):
    process_count_per_node: int | None = None
    mpi_additional_options: list[str] | None = None

    driver_script = "mpi_driver.py"

    def distribution(self) -> dict[str, Any]:
        import shlex

        options = {"enabled": True, "processes_per_host": self.process_count_per_node or 1}
        if self.mpi_additional_options:
            options["custom_mpi_options"] = shlex.join(self.mpi_additional_options)
        return {"mpi": options}


__all__ = ["DistributedConfig", "MPI", "SMP", "Torchrun"]
