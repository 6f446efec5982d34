"""Inside a Slurm allocation (a batch script, a ``salloc`` shell): one agent per node, each its
own ``srun`` job step, so that the first node to fail is known and the others are stopped through
the shared flow.

Each node's job step is a probe session over :class:`~disttrain.launch.transport.SrunTransport` that
says the node's facts and then becomes its agent (one job step per node for the whole launch).
The master is the first node, at the address that node uses toward the second node's
``NodeAddr``, found on the first node itself (a node's own hostname often resolves to
127.0.x.1).

The environment follows the rule of every launcher (:func:`disttrain.workerenv.forwarded_env`),
not Slurm's ``--export=ALL``: the job steps export only the bootstrap names, and the forwarded
values travel with the plan on the agent's stdin, as over ssh.

:func:`run_batch_step` is what a batch job's one command, its batch step (``disttrain
batch-step``), runs: the spec the submitting side shipped (:class:`~disttrain.wire.BatchStep`),
launched here, and how it ended written back for the submitter
(:class:`~disttrain.wire.BatchStepEnded`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path

from ..config.launch import LaunchSpec
from ..errors import DisttrainError, UsageError
from ..plan.launch import ContainerPlanner, LaunchPlan, NodeFacts
from ..preflight.facts import route_to
from ..wire import BatchStep, BatchStepEnded, HostFacts, JobClient, Outcome, RunClient
from .base import BATCH_STEP_ENV, OLD_BATCH_STEP_ENV, Events, LaunchContext
from .local import check_entry
from .probe import SessionLauncher, ask_facts, close_all, open_sessions
from .slurm import record_end, slurm_command
from .slurm_env import SlurmAllocation
from .transport import SrunTransport, Transport

PROBE_TIMEOUT_S = 180  # an srun step that imports torch on a busy node


def job_port(job_id: str) -> int:
    """The rendezvous port when none is given: fixed per job, so two jobs sharing a node
    are unlikely to meet; checked free on the master before the launch."""
    return 29500 + int(job_id) % 1000 if job_id.isdigit() else 29500


def node_address(name: str) -> str:
    """The address slurm.conf gives node ``name`` (NodeAddr; the name itself by default)."""
    result = slurm_command(["scontrol", "show", "node", "-o", name])
    match = re.search(r"(?:^|\s)NodeAddr=(\S+)", result.stdout)
    return match[1] if result.returncode == 0 and match else name


def find_master(alloc: SlurmAllocation, nodes: tuple[str, ...], *, python: str, cwd: str,
                environ: Mapping[str, str]) -> str:
    """The first node's address toward the second, found on the first node."""
    if len(nodes) == 1:
        return "127.0.0.1"
    peer = node_address(nodes[1])
    if alloc.this_node == nodes[0]:  # the batch script runs on the first node
        try:
            return route_to(peer)[0]
        except OSError as err:
            raise DisttrainError(f"{nodes[0]}: no route to {nodes[1]} at {peer}: {err}") from None
    sessions = open_sessions([SrunTransport(nodes[0], environ=environ)], python=python, master=peer, port=None,
                             cwd=cwd, reach=False)
    try:
        (answer,) = ask_facts(sessions, PROBE_TIMEOUT_S)
    finally:
        close_all(sessions)
    if isinstance(answer, Exception):
        raise answer
    return answer.facts.address


class SlurmAllocationLauncher(SessionLauncher):
    """The first ``nodes`` nodes of the allocation this process runs in, one agent each."""

    name = "slurm"
    probe_timeout_s = PROBE_TIMEOUT_S
    reach_checks = False  # the nodes of an allocation are the cluster's to connect

    def __init__(self, alloc: SlurmAllocation, *, nodes: int | None = None) -> None:
        if nodes is not None and nodes > len(alloc.nodes):
            raise UsageError(f"--nodes {nodes}: Slurm job {alloc.job_id} has only {len(alloc.nodes)} node(s)")
        super().__init__()
        self.alloc = alloc
        self.names = alloc.nodes[: nodes or len(alloc.nodes)]
        self.note = f"Slurm job {alloc.job_id}"

    def facts(self, spec: LaunchSpec, ctx: LaunchContext):
        check_entry(spec, ctx.cwd)  # a shared filesystem is Slurm's norm: the nodes see it where we do
        return super().facts(spec, ctx)

    def rendezvous(self, spec: LaunchSpec, ctx: LaunchContext) -> tuple[str, int]:
        master = spec.master_addr or find_master(self.alloc, self.names, python=ctx.python, cwd=ctx.cwd,
                                                 environ=ctx.environ)
        return master, spec.master_port or job_port(self.alloc.job_id)

    def transports(self, spec: LaunchSpec, ctx: LaunchContext) -> list[Transport]:
        cpus = self.alloc.cpus_per_node or (None,) * len(self.names)
        return [SrunTransport(name, cpus=cpus[i], environ=ctx.environ) for i, name in enumerate(self.names)]

    def node_facts(self, spec: LaunchSpec, ctx: LaunchContext, facts: Mapping[int, HostFacts]) -> tuple[NodeFacts, ...]:
        multi = len(self.names) > 1
        cpus = self.alloc.cpus_per_node
        gpus = self.alloc.gpus_per_node
        return tuple(
            NodeFacts(
                name=self.names[i],
                cpus=cpus[i] if i < len(cpus) else f.cpus,
                cuda_devices=gpus if gpus is not None else f.cuda_devices,
                # One node talks over loopback; several over the route each found to the master.
                socket_ifname=f.ifname if multi else None,
                address=f.address if multi else None,
            )
            for i, f in facts.items()
        )

    def launch(self, plan: LaunchPlan, events: Events, ctx: LaunchContext) -> Outcome:
        outcome = super().launch(plan, events, ctx)
        if outcome.failed is not None and not outcome.report and not outcome.signal:
            host = plan.nodes[outcome.failed].name
            events.say(f"disttrain: the agent on {host} (srun) exited with code {outcome.exit_code}; "
                       "the other nodes were stopped")
        return outcome


def run_batch_step(environ: MutableMapping[str, str],
                   client_for: Callable[[RunClient | JobClient | None], tuple[Events, ContainerPlanner | None]]) -> int:
    """Inside a Slurm batch job: the spec the submitting side shipped, launched on the
    allocation (``client_for`` rebuilds the client's event sink, and what it adds to the plan,
    from what it shipped)."""
    alloc = SlurmAllocation.from_environ(environ)
    if alloc is None:
        raise UsageError("disttrain batch-step runs inside the Slurm job that `disttrain run --launcher slurm` "
                         "or `disttrain job run` submits")
    # Popped, under both names: not one of the user's variables to forward. The old name is what a
    # job queued before an upgrade carries (its script runs `disttrain launch-step`, the old name of
    # the batch-step command).
    shipped, old = environ.pop(BATCH_STEP_ENV, None), environ.pop(OLD_BATCH_STEP_ENV, None)
    shipped = shipped or old
    if not shipped:
        raise UsageError(f"disttrain batch-step: {BATCH_STEP_ENV} is not in the job's environment: run it only as the "
                         "command of the batch script that `disttrain run --launcher slurm` submits")
    batch_step = BatchStep.from_line(shipped)
    run_dir = batch_step.run_dir
    if alloc.restart_count:  # a requeued job: the first run's logs stay as they were
        run_dir = str(Path(run_dir) / f"requeue_{alloc.restart_count}")
    events, container = client_for(batch_step.client)
    ctx = LaunchContext(run_id=batch_step.run_id, run_dir=run_dir, cwd=batch_step.cwd, python=batch_step.python,
                        paths=batch_step.paths, environ=dict(environ), container=container)
    # An elastic range uses every node Slurm gave (MIN to MAX of them); a fixed count its first N.
    launcher = SlurmAllocationLauncher(alloc, nodes=None if batch_step.spec.elastic else batch_step.nodes)
    outcome = launcher.run(batch_step.spec, ctx, events)
    record_end(batch_step.run_dir, BatchStepEnded(outcome=outcome, where=launcher.names))
    return outcome.exit_code
