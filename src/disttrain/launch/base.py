"""The launcher interface: the one way every client (``disttrain run``, the job runner) starts a job.

Clients call two methods, the same on every launcher: :meth:`Launcher.run` (spec + context +
an :class:`Events` sink → an :class:`~disttrain.wire.Outcome`) and :meth:`Launcher.dry_run`
(→ a :class:`DryRun`: what would start, nothing started). Behind them, two kinds of launcher,
each a template with its own stages (torch elastic's agent template and submitit's executors
divide theirs the same way):

**Agent launchers** (:class:`AgentLauncher`: local, the job's instances, ssh, a Slurm
allocation, mpi) know the nodes before anything starts:

1. :meth:`~AgentLauncher.facts` -- ask the nodes about themselves (cores, GPUs, the route to the
   master, a free port). The only stage with side effects before the start; it may probe hosts.
2. :meth:`~AgentLauncher.place` -- spec + facts → :class:`~disttrain.plan.launch.LaunchPlan`. Pure:
   ``--dry-run`` prints exactly what would start.
3. :meth:`~AgentLauncher.launch` -- plan + events → the outcome.

``run`` chains them; ``events.starting`` sees the plan before anything starts (``plan.json``,
the banner, the job record). What a client adds to each node (a job's SageMaker container) is
an input of the planner (``ctx.container``), not an edit of its plan, so the plan placed is
the plan that runs.

**Batch launchers** (:class:`BatchLauncher`: Slurm's sbatch) hand a script to a scheduler,
which picks the nodes later: the spec is shipped into the allocation (a
:class:`~disttrain.wire.BatchStep`), where an agent launcher places and launches it.

1. :meth:`~BatchLauncher.script` -- the batch script (pure);
2. :meth:`~BatchLauncher.submit` -- the script to the scheduler, the batch step in the job's
   environment → the job id (hooks: :meth:`~BatchLauncher.submission_argv`,
   :meth:`~BatchLauncher.job_id_from`);
3. :meth:`~BatchLauncher.follow` -- the job's output while it runs → the outcome.

Clients never branch on the kind: both return an Outcome from ``run`` and a DryRun from
``dry_run``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar, TextIO

from ..atomic import write_atomic
from ..config.launch import LaunchSpec
from ..errors import UsageError
from ..plan.launch import ContainerPlanner, LaunchPlan, NodeFacts, make_plan
from ..private import private_dirs
from ..wire import BatchStep, JobClient, Outcome, RunClient


@dataclass(frozen=True, kw_only=True)
class LaunchContext:
    """Where and as what a spec is launched: what the client knows besides the spec."""

    run_id: str
    run_dir: str  # absolute; on a filesystem every node shares, or the same path on each
    cwd: str  # the workers' working directory (the launcher's, or a job's staged source)
    python: str = sys.executable  # the interpreter on the nodes
    paths: tuple[str, ...] = ()  # files that must exist on every node (checked by the probe)
    preflight: bool = True  # reachability checks before a multi-host start
    environ: Mapping[str, str] = field(default_factory=dict)  # the launching shell's environment
    container: ContainerPlanner | None = None  # a job's container: what it adds to each node of the plan


@dataclass(frozen=True, kw_only=True)
class Facts:
    """What :meth:`AgentLauncher.facts` learned: one NodeFacts per node, the rendezvous endpoint."""

    nodes: tuple[NodeFacts, ...]
    master_addr: str
    master_port: int
    where: tuple[str, ...]  # per node: the machine it runs on (for records and messages)
    forwarded_env: Mapping[str, str] = field(default_factory=dict)  # what a remote launcher carries
    # Per node: its place in the launcher's list of hosts, when not every host starts (an elastic
    # range whose other hosts were unreachable); None: node K is the K-th host.
    node_ranks: tuple[int, ...] | None = None


class Events:
    """The client's side of a launch. The defaults print to stderr; clients override what they need."""

    transcript: TextIO | None = None  # a copy of everything the agents print (a job's log)

    def say(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)
        if self.transcript is not None:
            self.transcript.write(message + "\n")
            self.transcript.flush()

    def starting(self, plan: LaunchPlan, facts: Facts, note: str = "") -> None:
        """Just before the agents start."""
        self.say(banner(plan, note))

    def joining(self, plan: LaunchPlan, facts: Facts) -> None:
        """A host of an elastic job joins (``facts``: every node placed so far, the new one last)."""

    def submitted(self, job_id: str, run_dir: str) -> None:
        """A batch launcher handed the job to its scheduler, which named it ``job_id``."""

    def ran_on(self, where: tuple[str, ...]) -> None:
        """A batch job ended; it ran on these nodes (placed inside the allocation)."""

    def batch_step_client(self) -> RunClient | JobClient | None:
        """How to rebuild this sink inside a batch allocation; None: the default sink."""
        return None


class RunFolderEvents(Events):
    """``disttrain run``'s sink: the plan (the user's variables by name only) kept in the run folder."""

    def starting(self, plan: LaunchPlan, facts: Facts, note: str = "") -> None:
        write_atomic(Path(plan.run_dir) / "plan.json", plan.to_json(), mode=0o600)
        super().starting(plan, facts, note)


def banner(plan: LaunchPlan, note: str = "") -> str:
    """The one start line: how many workers, of what, where, the rendezvous and the logs."""
    where = ", ".join(node.name for node in plan.nodes)
    kind = "TensorFlow" if plan.framework == "tensorflow" else plan.dist_backend
    count = f"{plan.world_size} worker{'s' if plan.world_size != 1 else ''}"
    if plan.elastic:  # --nnodes MIN:MAX: each rendezvous round decides
        per_node = plan.nodes[0].nproc
        count = f"{per_node * plan.min_nnodes} to {per_node * plan.nnodes} workers"
    return (f"disttrain: {count} ({kind}) on {where}"
            f"{f' ({note})' if note else ''}, rendezvous {plan.master_addr}:{plan.master_port}; logs: {plan.run_dir}")


@dataclass(frozen=True, kw_only=True)
class DryRun:
    """What a launcher would start, nothing started (``--dry-run``).

    An agent launcher knows the nodes before anything starts: its dry run is the plan. A batch
    launcher's nodes are known only inside the allocation: its dry run is the script it would
    submit and the spec that script's batch step would place there.
    """

    launcher: str
    plan: LaunchPlan | None = None
    script: str | None = None
    spec: LaunchSpec | None = None

    def __post_init__(self) -> None:
        if (self.plan is None) == (self.script is None) or (self.script is None) != (self.spec is None):
            raise ValueError("a dry run is a plan, or a script with the spec it ships")

    def text(self) -> str:
        """What ``--dry-run`` prints: the plan (the user's variables by name only), or the
        script exactly as it would be submitted (the spec travels in the job's environment)."""
        return self.plan.to_json() + "\n" if self.plan is not None else self.script


class Launcher(ABC):
    """What every client uses. See :mod:`disttrain.launch` for the kinds and how to add one."""

    name: ClassVar[str]

    @abstractmethod
    def run(self, spec: LaunchSpec, ctx: LaunchContext, events: Events) -> Outcome:
        """Launch ``spec`` to its end; how it ended, the same shape for every launcher."""

    @abstractmethod
    def dry_run(self, spec: LaunchSpec, ctx: LaunchContext) -> DryRun:
        """What :meth:`run` would start, without starting it."""


class AgentLauncher(Launcher):
    """facts → place → launch: the nodes are known (and asked) before anything starts."""

    note: str = ""  # said in the start line, e.g. "Slurm job 12"

    @abstractmethod
    def facts(self, spec: LaunchSpec, ctx: LaunchContext) -> Facts:
        """Ask the nodes about themselves (side effects allowed: probes, port checks)."""

    def place(self, spec: LaunchSpec, facts: Facts, ctx: LaunchContext) -> LaunchPlan:
        """spec + facts → the plan of the whole job, one node per NodeFacts; pure."""
        # An elastic range keeps its maximum (hosts may join later); a fixed count is the nodes placed.
        spec = replace(spec, nnodes=spec.nnodes if spec.elastic else len(facts.nodes), node_rank=0,
                       master_addr=facts.master_addr, master_port=facts.master_port)
        container = (ctx.container(facts.nodes, master_addr=facts.master_addr, master_port=facts.master_port,
                                   node_ranks=facts.node_ranks) if ctx.container is not None else None)
        return make_plan(spec, facts.nodes, python=ctx.python, master_port=facts.master_port, run_id=ctx.run_id,
                         run_dir=ctx.run_dir, inherited_env={**ctx.environ, **facts.forwarded_env},
                         forwarded_env=facts.forwarded_env, container=container, node_ranks=facts.node_ranks)

    @abstractmethod
    def launch(self, plan: LaunchPlan, events: Events, ctx: LaunchContext) -> Outcome:
        """Start every node's agent, relay their output, stop all at the first failure."""

    def close(self) -> None:
        """Let go of what :meth:`facts` left open for :meth:`launch` (probe sessions)."""

    def plan(self, spec: LaunchSpec, ctx: LaunchContext) -> tuple[LaunchPlan, Facts]:
        facts = self.facts(spec, ctx)
        return self.place(spec, facts, ctx), facts

    def dry_run(self, spec: LaunchSpec, ctx: LaunchContext) -> DryRun:
        try:
            return DryRun(launcher=self.name, plan=self.plan(spec, ctx)[0])
        finally:
            self.close()

    def run(self, spec: LaunchSpec, ctx: LaunchContext, events: Events) -> Outcome:
        """The shared pipeline: facts → place → launch."""
        try:
            plan, facts = self.plan(spec, ctx)
            events.starting(plan, facts, self.note)
            return self.launch(plan, events, ctx)
        finally:
            self.close()


class BatchLauncher(Launcher):
    """script → submit → job id → follow: a scheduler picks the nodes after submission, and the
    spec is placed there, by the batch step the script runs (a :class:`~disttrain.wire.BatchStep`)."""

    nodes: int = 1  # what the batch step asks of the allocation
    no_wait: bool = False  # submit, say the job id, return
    env: Mapping[str, str] | None = None  # for the scheduler's commands (None: this process's)

    @abstractmethod
    def script(self, spec: LaunchSpec, ctx: LaunchContext) -> str:
        """The batch script for ``spec``; pure, checked inputs."""

    def shipped(self, spec: LaunchSpec, ctx: LaunchContext) -> LaunchSpec:
        """The spec the batch step places (the launcher may fill in what the allocation needs)."""
        return spec

    @abstractmethod
    def submission_argv(self) -> list[str]:
        """The scheduler's submit command; the script comes on its stdin."""

    @abstractmethod
    def job_id_from(self, output: str) -> str:
        """The job id in the submit command's output."""

    @abstractmethod
    def command(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                input: str | None = None) -> subprocess.CompletedProcess:
        """Run one of the scheduler's client commands (errors naming it: missing, no answer)."""

    def batch_step_env(self) -> str:
        """The job environment's variable that carries the batch step."""
        return BATCH_STEP_ENV

    @abstractmethod
    def follow(self, job_id: str, events: Events, ctx: LaunchContext) -> Outcome:
        """The job's output while it runs, then how its batch step ended."""

    def dry_run(self, spec: LaunchSpec, ctx: LaunchContext) -> DryRun:
        spec = self.shipped(spec, ctx)
        return DryRun(launcher=self.name, script=self.script(spec, ctx), spec=spec)

    def run(self, spec: LaunchSpec, ctx: LaunchContext, events: Events) -> Outcome:
        spec = self.shipped(spec, ctx)
        batch_step = BatchStep(spec=spec, run_id=ctx.run_id, run_dir=ctx.run_dir, cwd=ctx.cwd, python=ctx.python,
                               paths=tuple(ctx.paths), nodes=self.nodes, client=events.batch_step_client())
        job_id = self.submit(self.script(spec, ctx), batch_step, ctx)
        events.submitted(job_id, ctx.run_dir)
        if self.no_wait:
            return Outcome(exit_code=0)
        return self.follow(job_id, events, ctx)

    def submit(self, script: str, batch_step: BatchStep, ctx: LaunchContext) -> str:
        """The script to the scheduler, the batch step in the job's environment (values go through its
        environment, never its argv, which ``ps`` shows); the job id.

        The run folder must exist before the job starts (the scheduler opens the output files
        there, and does not create folders); a refused job leaves no folder behind. The
        scheduler's refusal is a UsageError with its own words.
        """
        run_dir = Path(ctx.run_dir)
        # The outermost folder this call creates: what to remove when the scheduler says no.
        created = next((p for p in reversed((run_dir, *run_dir.parents)) if not p.exists()), None)
        private_dirs(run_dir)
        argv = self.submission_argv()
        try:
            env = {**(os.environ if self.env is None else self.env), self.batch_step_env(): batch_step.to_line()}
            result = self.command(argv, env=self.job_env(env), input=script)
            if result.returncode != 0:
                raise UsageError(f"{argv[0]} refused the job: {_last_line(result.stderr)}")
            job_id = self.job_id_from(result.stdout)
        except BaseException:
            if created is not None:
                shutil.rmtree(created, ignore_errors=True)
            raise
        self.keep(run_dir, script, job_id)
        return job_id

    def job_env(self, env: dict[str, str]) -> dict[str, str]:
        """The submit command's environment, last word (drop what would override the script)."""
        return env

    def keep(self, run_dir: Path, script: str, job_id: str) -> None:
        """What stays in the run folder of a submitted job (the script, the id)."""


BATCH_STEP_ENV = "DISTTRAIN_BATCH_STEP"  # the batch step, in a batch job's environment (it may hold --env values)
# The same, as the disttrain before the batch step had its own word named it: a job queued then still carries it.
OLD_BATCH_STEP_ENV = "DISTTRAIN_LAUNCH_STEP"


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[-1]
