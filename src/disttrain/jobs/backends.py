"""Where a job's instances run. A backend is two small steps, the rest is shared:

- ``place``: the instances' facts → a multi-node :class:`LaunchPlan` (one node per instance,
  ranks numbered across instances) and each instance's network interface;
- ``launch``: start one ``disttrain agent`` per instance and wait, through the flow shared
  with ``disttrain run --hosts`` (:func:`disttrain.backends.ssh_launch.run_agents`).

``local`` runs every instance on this machine (each its own agent and process group, on
127.0.0.1, the machine's cores and GPUs split between them); ``ssh`` runs instance K on the
K-th host, like ``disttrain run --hosts`` (the job directory must be on a filesystem the
hosts share, at the same path, like the script).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from typing import Protocol, TextIO

from ..backends.ssh_launch import AgentsOutcome, agent_argv, launch_hosts, plan_hosts, run_agents
from ..config.hosts import Host, parse_hosts
from ..config.launch import LaunchSpec
from ..plan.launch import LaunchPlan, NodeFacts, make_plan
from .spec import JobSpec


@dataclass(frozen=True, kw_only=True)
class Placement:
    plan: LaunchPlan
    ifnames: tuple[str, ...]  # per instance: the interface toward the master (SM_NETWORK_INTERFACE_NAME)
    where: tuple[str, ...]  # per instance: the machine it runs on, for the record
    gpus: tuple[int, ...]  # per instance
    cpus: tuple[int, ...]  # per instance


class Backend(Protocol):
    def place(self, launch: LaunchSpec, *, instances: tuple[str, ...], run_id: str, run_dir: str,
              paths: list[str], cwd: str) -> Placement: ...

    def launch(self, plan: LaunchPlan, *, cwd: str, transcript: TextIO,
               prefixes: list[list[str]] | None = None) -> AgentsOutcome: ...


class LocalBackend:
    def place(self, launch, *, instances, run_id, run_dir, paths, cwd) -> Placement:
        from ..net import free_port
        from ..preflight.facts import local_facts  # counts GPUs with torch

        here = local_facts()
        n = len(instances)
        cpus, gpus = max(1, here.cpus // n), here.cuda_devices // n
        facts = tuple(NodeFacts(hostname=name, cpus=cpus, cuda_devices=gpus) for name in instances)
        plan = make_plan(launch, facts, python=sys.executable, master_port=free_port("127.0.0.1"),
                         run_id=run_id, run_dir=run_dir, inherited_env=os.environ)
        if gpus and n > 1:  # each instance its own GPUs, as on separate machines
            plan = replace(plan, nodes=tuple(
                replace(node, env={"CUDA_VISIBLE_DEVICES": ",".join(str(k * gpus + g) for g in range(gpus)),
                                   **node.env})
                for k, node in enumerate(plan.nodes)))
        return Placement(plan=plan, ifnames=("lo",) * n, where=(here.hostname,) * n,
                         gpus=(gpus,) * n, cpus=(cpus,) * n)

    def launch(self, plan, *, cwd, transcript, prefixes=None) -> AgentsOutcome:
        # prefixes: per instance, what runs its agent in a private /opt/ml (jobs.optml), or []
        prefixes = prefixes or [[] for _ in plan.nodes]
        commands = [[*prefixes[node.node_rank], *agent_argv(plan, node.node_rank, sys.executable)]
                    for node in plan.nodes]
        return run_agents(plan, commands, cwd=cwd, transcript=transcript)


class SshBackend:
    def __init__(self, spec: JobSpec) -> None:
        self.hosts: tuple[Host, ...] = parse_hosts(",".join(spec.hosts))
        self.options = tuple(spec.ssh_options)
        self.python = spec.python or sys.executable
        self.master_port = spec.master_port

    def place(self, launch, *, instances, run_id, run_dir, paths, cwd) -> Placement:
        launch = replace(launch, master_port=self.master_port)
        plan, facts = plan_hosts(launch, self.hosts, python=self.python, options=self.options, cwd=cwd,
                                 paths=paths, run_id=run_id, run_dir=run_dir)
        return Placement(plan=plan, ifnames=tuple(f["ifname"] or "eth0" for f in facts),
                         where=tuple(h.name for h in self.hosts),
                         gpus=tuple(f["cuda_devices"] for f in facts), cpus=tuple(f["cpus"] for f in facts))

    def launch(self, plan, *, cwd, transcript, prefixes=None) -> AgentsOutcome:
        # prefixes are always empty here: a private /opt/ml is made for backend local only
        from ..workerenv import forwarded_env

        return launch_hosts(plan, self.hosts, python=self.python, options=self.options, cwd=cwd,
                            env=forwarded_env(os.environ), transcript=transcript)


def make_backend(spec: JobSpec) -> Backend | None:
    """None for slurm: its instances are placed inside the allocation (:mod:`disttrain.jobs.slurm`)."""
    if spec.backend == "slurm":
        return None
    return SshBackend(spec) if spec.backend == "ssh" else LocalBackend()
