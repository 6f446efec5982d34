"""A job's plan, made in one place: the job spec → what the launcher plans, and what the container adds.

The runner, ``disttrain job run --dry-run`` and a Slurm allocation's batch step all plan a job
through a :class:`JobPlanner`: it gives the launcher the :class:`LaunchSpec` (the script, its
arguments as SageMaker's toolkit passes them, processes per instance as the distribution says)
and the :class:`LaunchContext`, whose ``container`` is the planner itself. The launcher calls it with
the facts it found (each instance's interface, GPUs, CPUs, address and the rendezvous port), and
:func:`~disttrain.plan.launch.make_plan` applies what it returns, a
:class:`~disttrain.plan.container.ContainerSetup` (each instance's ``SM_*`` variables, the
parameter server's ``TF_CONFIG`` pair, ``PYTHONPATH``, its folder at ``/opt/ml``, the job's own
interpreter and the ps wrapper). So the plan a launcher places is the plan that runs; the
instances' config files are written from the same values just before the start.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..agent.optml import hosts_file
from ..atomic import write_atomic
from ..config.launch import LaunchSpec
from ..launch import LaunchContext
from ..plan.container import ContainerSetup, InstanceSetup
from ..plan.launch import NodeFacts
from .container import PS_SHIM, ReadyContainer
from .contract import ContainerContract, RunFacts, contract_for
from .distribution import ps_tf_config
from .layout import JobLayout
from .sagemaker import Instance
from .spec import JobSpec


@dataclass(frozen=True, kw_only=True)
class JobPlanner:
    """One run of a job, planned: the spec, where the run lives, and what the container found."""

    spec: JobSpec
    layout: JobLayout
    name: str  # the run's job name
    cwd: Path  # where the script runs: source_dir, or its tarball extracted into the job folder
    ready: ReadyContainer  # what the container found: the job's interpreter, a private /opt/ml
    environ: Mapping[str, str]  # the launching shell's environment

    def launch_spec(self) -> LaunchSpec:
        """What every instance runs: the entry point with the hyperparameters as the toolkit passes them
        (for contract model_trainer: as SDK v3's drivers do, or its command run through bash).

        The distribution sets the processes per instance, and TF_CONFIG only for
        multi_worker_mirrored_strategy (parameter_server's is the container's, see :meth:`__call__`).
        """
        program, where = self.spec.program, self.spec.placement
        elastic = where.min_instance_count is not None and where.min_instance_count < where.instance_count
        entry, is_module, args = self.contract.worker_command(self._facts(()), program.hyperparameters)
        return LaunchSpec(
            # An elastic job (min_instance_count): --nnodes MIN:MAX on the c10d rendezvous.
            **({"nnodes": where.instance_count, "min_nnodes": where.min_instance_count, "rdzv_backend": "c10d"}
               if elastic else {}),
            entry=entry,
            is_module=is_module,
            script_args=args,
            nproc_per_node=program.distribution.processes_per_instance(where.processes_per_instance),
            max_restarts=where.max_restarts,
            env=dict(program.env),
            master_port=where.master_port,
            log_dir=str(self.layout.logs),
            checkpoint_dir=str(self.layout.checkpoints),
            framework=program.distribution.launch_framework,
            track=self.spec.container.track_mode,
        )

    @property
    def contract(self) -> ContainerContract:
        """What the container does around the script (jobs/contract.py): the toolkit's, or SDK v3's."""
        return contract_for(self.spec.container.contract)

    def _facts(self, addresses: Sequence[str], master_port: int = 0) -> RunFacts:
        program = self.spec.program
        return RunFacts(cwd=str(self.cwd), entry_point=program.entry_point, command=program.command,
                        distribution=program.distribution,
                        processes_per_instance=self.spec.placement.processes_per_instance,
                        addresses=tuple(addresses), master_port=master_port,
                        names_resolve=self.ready.private_opt_ml)

    def context(self) -> LaunchContext:
        return LaunchContext(run_id=self.name, run_dir=str(self.layout.logs), cwd=str(self.cwd),
                             python=self.spec.placement.python or sys.executable,
                             paths=(str(self.cwd / self.spec.program.entry_point), str(self.layout.root)),
                             environ=dict(self.environ), container=self)

    def instances(self, nodes: Sequence[NodeFacts], node_ranks: Sequence[int] | None = None) -> tuple[Instance, ...]:
        """Instance K (the plan's node K; of an elastic job that started without some, ``node_ranks[k]``)
        as SageMaker's contract describes it, from its node's facts. ``hosts`` lists every instance."""
        spec, names = self.spec, self.layout.instance_names
        ranks = node_ranks if node_ranks is not None else range(len(nodes))
        return tuple(
            Instance(job_name=self.name, name=names[rank], names=names, instance_type=spec.placement.instance_type,
                     ifname=node.socket_ifname or "lo", num_gpus=node.cuda_devices, num_cpus=node.cpus,
                     entry_point=spec.program.entry_point, module_dir=str(self.cwd),
                     hyperparameters=spec.program.hyperparameters,
                     framework_params=spec.distribution.framework_params, channels=tuple(spec.container.inputs))
            for rank, node in zip(ranks, nodes))

    def __call__(self, nodes: tuple[NodeFacts, ...], *, master_addr: str, master_port: int,
                 node_ranks: Sequence[int] | None = None) -> ContainerSetup:
        """What the container adds to each instance (the plan's :class:`ContainerPlanner`); pure."""
        spec, dist = self.spec, self.spec.distribution
        addresses = [node.address or master_addr for node in nodes]
        facts = self._facts(addresses, master_port)
        setups = []
        for k, inst in enumerate(self.instances(nodes, node_ranks)):
            name = inst.name
            paths = self.layout.instance(name)
            env = self.contract.instance_env(inst, paths, facts)
            # The toolkit puts the code folder on PYTHONPATH, so the script imports its neighbours.
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(self.cwd), self.environ.get("PYTHONPATH"))))
            if dist.kind == "parameter_server":
                env["DISTTRAIN_PS_TF_CONFIG"] = ps_tf_config(addresses, master_port, k, ps_task=False)
                env["DISTTRAIN_PS_TASK_TF_CONFIG"] = ps_tf_config(addresses, master_port, k, ps_task=True)
            if spec.program.framework == "tensorflow":
                from ..tfconfig import have_tf_keras, keras_env

                env.update(keras_env({**self.environ, **spec.program.env}, have_tf_keras=have_tf_keras()))
            setups.append(InstanceSetup(env=env, opt_ml=str(paths.root) if self.ready.private_opt_ml else None,
                                        opt_ml_required=spec.container.private_opt_ml == "required"))
        return ContainerSetup(instances=tuple(setups), python=self.ready.python,
                              wrapper=PS_SHIM if dist.kind == "parameter_server" else None)

    def write_config(self, nodes: Sequence[NodeFacts], node_ranks: Sequence[int] | None = None, *,
                     master_addr: str, master_port: int) -> None:
        """Each instance's ``input/config/*.json`` (and SDK v3's ``sm_training.env``), from the values
        its variables were made of; and, where it gets a private /opt/ml, the host names it resolves
        (``algo-K``: agent/optml.py puts them in its own /etc/hosts)."""
        addresses = [node.address or master_addr for node in nodes]
        facts = self._facts(addresses, master_port)
        instances = self.instances(nodes, node_ranks)
        names = "".join(f"{address} {inst.name}\n" for address, inst in zip(addresses, instances))
        for inst in instances:
            paths = self.layout.instance(inst.name)
            self.contract.write_files(inst, paths, facts)
            if self.ready.private_opt_ml:
                write_atomic(hosts_file(str(paths.root)), names)
