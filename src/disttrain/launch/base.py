"""The launcher interface: the one way every client (``disttrain run``, the job runner) starts a job.

A launch is three steps, each with one job (submitit's executors and torch elastic's agent
template divide theirs the same way):

1. :meth:`Launcher.facts` -- ask the nodes about themselves (cores, GPUs, the route to the
   master, a free port). The only step with side effects before the start; it may probe hosts.
2. :meth:`Launcher.place` -- spec + facts → :class:`~disttrain.plan.launch.LaunchPlan`. Pure:
   ``--dry-run`` prints exactly what would start.
3. :meth:`Launcher.launch` -- plan + an :class:`Events` sink → an :class:`Outcome`, the same
   shape for every launcher.

:meth:`Launcher.run` chains them and gives the client two words on the way: ``events.placed``
may add to the plan (a job adds SageMaker's variables) and ``events.starting`` sees it before
anything starts (``plan.json``, the banner, the job record). Clients never branch on the
launcher; a launcher that cannot place before it starts (a batch scheduler: the nodes are
known only inside the allocation) overrides :meth:`Launcher.run` and ships the spec there.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar, TextIO

from ..atomic import write_atomic
from ..config.launch import LaunchSpec
from ..plan.launch import LaunchPlan, NodeFacts, make_plan
from ..wire import JobClient, Outcome, RunClient


@dataclass(frozen=True, kw_only=True)
class Context:
    """Where and as what a spec is launched: what the client knows besides the spec."""

    run_id: str
    run_dir: str  # absolute; on a filesystem every node shares, or the same path on each
    cwd: str  # the workers' working directory (the launcher's, or a job's staged source)
    python: str = sys.executable  # the interpreter on the nodes
    paths: tuple[str, ...] = ()  # files that must exist on every node (checked by the probe)
    preflight: bool = True  # reachability checks before a multi-host start
    environ: Mapping[str, str] = field(default_factory=dict)  # the launching shell's environment


@dataclass(frozen=True, kw_only=True)
class Facts:
    """What :meth:`Launcher.facts` learned: one NodeFacts per node, the rendezvous endpoint."""

    nodes: NodeFacts | tuple[NodeFacts, ...]  # one NodeFacts: this node's part of a torchrun-style job
    master_addr: str
    master_port: int
    where: tuple[str, ...]  # per node: the machine it runs on (for records and messages)
    forwarded_env: Mapping[str, str] = field(default_factory=dict)  # what a remote launcher carries


class Events:
    """The client's side of a launch. The defaults print to stderr; clients override what they need."""

    transcript: TextIO | None = None  # a copy of everything the agents print (a job's log)

    def say(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)
        if self.transcript is not None:
            self.transcript.write(message + "\n")
            self.transcript.flush()

    def placed(self, plan: LaunchPlan, facts: Facts) -> LaunchPlan:
        """The client's last word on the plan (a job adds each instance's variables)."""
        return plan

    def starting(self, plan: LaunchPlan, facts: Facts, note: str = "") -> None:
        """Just before the agents start."""
        self.say(banner(plan, note))

    def submitted(self, job_id: str, run_dir: str) -> None:
        """A batch launcher handed the job to its scheduler, which named it ``job_id``."""

    def ran_on(self, where: tuple[str, ...]) -> None:
        """A batch job ended; it ran on these nodes (placed inside the allocation)."""

    def step(self) -> RunClient | JobClient | None:
        """How to rebuild this sink inside a batch allocation; None: the default sink."""
        return None


class RunFolderEvents(Events):
    """``disttrain run``'s sink: the plan (the user's variables by name only) kept in the run folder."""

    def starting(self, plan: LaunchPlan, facts: Facts, note: str = "") -> None:
        write_atomic(Path(plan.run_dir) / "plan.json", plan.to_json(), mode=0o600)
        super().starting(plan, facts, note)


def banner(plan: LaunchPlan, note: str = "") -> str:
    """The one start line: how many workers, of what, where, the rendezvous and the logs."""
    where = ", ".join(node.host for node in plan.nodes)
    kind = "TensorFlow" if plan.framework == "tensorflow" else plan.backend
    return (f"disttrain: {plan.world_size} worker{'s' if plan.world_size != 1 else ''} ({kind}) on {where}"
            f"{f' ({note})' if note else ''}, rendezvous {plan.master_addr}:{plan.master_port}; logs: {plan.run_dir}")


class Launcher(ABC):
    """One way of starting a node's agent. See :mod:`disttrain.launch` for how to add one."""

    name: ClassVar[str]
    note: str = ""  # said in the start line, e.g. "Slurm job 12"

    @abstractmethod
    def facts(self, spec: LaunchSpec, ctx: Context) -> Facts:
        """Ask the nodes about themselves (side effects allowed: probes, port checks)."""

    def place(self, spec: LaunchSpec, facts: Facts, ctx: Context) -> LaunchPlan:
        """spec + facts → the plan; pure. The shared planner serves every launcher so far."""
        if not isinstance(facts.nodes, NodeFacts):
            spec = replace(spec, nnodes=len(facts.nodes), node_rank=0, master_addr=facts.master_addr,
                           master_port=facts.master_port)
        return make_plan(spec, facts.nodes, python=ctx.python, master_port=facts.master_port, run_id=ctx.run_id,
                         run_dir=ctx.run_dir, inherited_env={**ctx.environ, **facts.forwarded_env},
                         forwarded_env=facts.forwarded_env)

    @abstractmethod
    def launch(self, plan: LaunchPlan, events: Events, ctx: Context) -> Outcome:
        """Start every node's agent, relay their output, stop all at the first failure."""

    def plan(self, spec: LaunchSpec, ctx: Context) -> tuple[LaunchPlan, Facts]:
        facts = self.facts(spec, ctx)
        return self.place(spec, facts, ctx), facts

    def dry_run(self, spec: LaunchSpec, ctx: Context) -> str:
        """What ``--dry-run`` prints: the plan, the user's variables by name only."""
        return self.plan(spec, ctx)[0].to_json() + "\n"

    def run(self, spec: LaunchSpec, ctx: Context, events: Events) -> Outcome:
        """The shared pipeline: facts → place → the client's word → launch."""
        plan, facts = self.plan(spec, ctx)
        plan = events.placed(plan, facts)
        events.starting(plan, facts, self.note)
        return self.launch(plan, events, ctx)
