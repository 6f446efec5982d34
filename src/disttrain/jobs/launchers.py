"""Where a job's instances run: the job spec's ``launcher`` picks one of :mod:`disttrain.launch`.

``local`` runs every instance on this machine (each its own agent and process group, on
127.0.0.1, the machine's cores and GPUs split between them); ``ssh`` runs instance K on the
K-th host, like ``disttrain run --hosts`` (the job directory must be on a filesystem the
hosts share, at the same path, like the script); ``slurm`` submits one batch job whose nodes
are the instances; ``distribution: mpi`` starts the local instances with one ``mpirun``. The
runner uses them all the same way.
"""

from __future__ import annotations

from ..config.hosts import parse_hosts
from ..launch import Launcher
from ..launch.local import InstancesLauncher
from ..launch.mpi import MpiLauncher
from ..launch.slurm import SlurmBatchLauncher
from ..launch.ssh import SshLauncher
from .layout import instance_names
from .spec import JobSpec


def launcher_for(spec: JobSpec, *, job_name: str) -> Launcher:
    """The job's launcher, chosen once per run (a bad setting is refused before anything is recorded)."""
    dist, where = spec.distribution, spec.placement
    if dist.kind == "mpi":  # the spec refuses it on other launchers
        return MpiLauncher(instances=instance_names(where.instance_count),
                           ranks_per_instance=dist.processes_per_host or 1,
                           custom_mpi_options=dist.custom_mpi_options)
    if where.launcher == "slurm":
        # The runner handles SIGTERM/SIGINT itself (the record says Stopped), then cancels.
        return SlurmBatchLauncher(where.slurm_options(job_name=job_name), stop_on_signals=False)
    if where.launcher == "ssh":
        return SshLauncher(parse_hosts(",".join(where.hosts)), options=tuple(where.ssh_options))
    return InstancesLauncher(instance_names(where.instance_count))
