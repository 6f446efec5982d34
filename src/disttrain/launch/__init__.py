"""Starting a job's agents: one interface, one module per launcher.

The interface is in :mod:`disttrain.launch.base` (``facts`` → ``place`` (pure) → ``launch``
(plan + events → :class:`Outcome`)); the flow shared by every launcher that starts one agent
process per node (plan on stdin, relayed output, first failure, stop all) is in
:mod:`disttrain.launch.flow`, and what it learns from the agents' heartbeats (one hang
watchdog across hosts, stragglers, steps/s per host) in :mod:`disttrain.launch.diagnostics`.

========  =====================================================================
local     this machine: one node in process, or a job's instances as agents
ssh       one agent per ``--hosts`` host over OpenSSH
slurm     inside an allocation: one agent per node with srun; outside: sbatch
========  =====================================================================

Adding a launcher (an MPI one, say) is one module here:

1. subclass :class:`~disttrain.launch.base.Launcher`, set ``name``;
2. ``facts(spec, ctx)``: ask the nodes for what :class:`~disttrain.plan.launch.NodeFacts`
   holds (``disttrain probe`` prints it as JSON on any host) and pick the rendezvous
   endpoint; return :class:`~disttrain.launch.base.Facts`. ``place`` is inherited (the
   shared planner) unless the launcher adds per-node settings;
3. ``launch(plan, events, ctx)``: build one argv per node that runs
   :func:`~disttrain.launch.flow.agent_argv` there (``mpirun -np N --map-by node ...``,
   ``ssh host ...``) and hand them to :func:`~disttrain.launch.flow.run_agents`, which
   writes each agent its plan on stdin and returns the :class:`Outcome`. Put the user's
   variables nowhere else: the plan carries them (``env_forwarded``, ``env_set``);
4. add its name to :data:`LAUNCHERS` and, for ``disttrain run``, build it in
   ``cli/launchers.py``; for jobs, in ``jobs/launchers.py``.

The layering (checked by import-linter, see ``pyproject.toml``): clients (``cli``, ``jobs``)
import ``launch``; ``launch`` imports ``plan``, ``preflight`` and ``agent``; nothing here
imports a client.
"""

from __future__ import annotations

from .base import Context, Events, Facts, Launcher, Outcome, RunFolderEvents, banner

LAUNCHERS = ("local", "ssh", "slurm")

__all__ = ["LAUNCHERS", "Context", "Events", "Facts", "Launcher", "Outcome", "RunFolderEvents", "banner"]
