"""Starting a job's agents: one interface, two kinds of launcher, one module per launcher.

Clients (``disttrain run``, the job runner) call :meth:`Launcher.run` and
:meth:`Launcher.dry_run`, the same on every launcher (see :mod:`disttrain.launch.base`):

- **agent launchers** (:class:`AgentLauncher`): ``facts`` → ``place`` (pure) → ``launch``;
  those whose nodes' agents start as probe sessions over a transport (ssh, srun, a local
  process) share :class:`~disttrain.launch.probe.SessionLauncher`, and the flow every
  agent-per-node launcher uses (plan on stdin, relayed output, first failure, stop all) is in
  :mod:`disttrain.launch.flow`, with what it learns from the agents' heartbeats (one hang
  watchdog across hosts, stragglers, steps/s per host) in :mod:`disttrain.launch.diagnostics`;
- **batch launchers** (:class:`BatchLauncher`): ``script`` → ``submit`` → job id → ``follow``;
  the spec is placed inside the allocation by an agent launcher.

=============  ======  ==============================================================
module         kind    what
=============  ======  ==============================================================
local          agent   one node in this process; a job's instances as local agents
ssh            agent   one agent per ``--hosts`` host over OpenSSH
slurm_alloc    agent   inside a Slurm allocation: one agent per node with srun
mpi            agent   a job's instances on this machine under one ``mpirun``
slurm          batch   outside an allocation: sbatch, then follow the job
=============  ======  ==============================================================

Adding an agent launcher whose nodes run disttrain (a Kubernetes pod per node, say) is one
module here:

1. subclass :class:`~disttrain.launch.probe.SessionLauncher`, set ``name``;
2. ``transports(spec, ctx)``: how each node is reached, a :class:`~disttrain.launch.probe.Transport`
   whose ``argv`` wraps a command (``kubectl exec -i POD -- ...``);
   ``rendezvous(spec, ctx)``: the master's address and port;
   ``node_facts(spec, ctx, facts)``: each node's :class:`~disttrain.plan.launch.NodeFacts`
   from what its probe session said (:class:`~disttrain.wire.HostFacts`);
3. ``place`` and ``launch`` are inherited: the shared planner, then the plan sent to every
   session, which becomes that node's agent. Put the user's variables nowhere else: the
   plan carries them (``env_forwarded``, ``env_set``);
4. add its name to :data:`LAUNCHERS` if ``--launcher`` offers it, build it in
   ``cli/launchers.py`` (``disttrain run``) or ``jobs/launchers.py`` (jobs), and add it to
   ``tests/test_launcher_contract.py``.

A batch launcher subclasses :class:`BatchLauncher`: ``script``, ``submission_argv``,
``job_id_from``, ``command`` and ``follow``; its script runs ``disttrain batch-step``, or a
command of its own that unpacks the :class:`~disttrain.wire.BatchStep` and runs an agent
launcher there.

The layering (checked by import-linter, see ``pyproject.toml``): clients (``cli``, ``jobs``)
import ``launch``; ``launch`` imports ``agent``, ``preflight``, ``wire`` and ``plan``; nothing
here imports a client.
"""

from __future__ import annotations

from .base import (
    AgentLauncher,
    BatchLauncher,
    DryRun,
    Events,
    Facts,
    LaunchContext,
    Launcher,
    Outcome,
    RunFolderEvents,
    banner,
)

LAUNCHERS = ("local", "ssh", "slurm")  # what --launcher offers (mpi is a job's distribution)

__all__ = ["LAUNCHERS", "AgentLauncher", "BatchLauncher", "LaunchContext", "DryRun", "Events", "Facts", "Launcher",
           "Outcome", "RunFolderEvents", "banner"]
