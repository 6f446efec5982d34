"""``--launcher local``: this machine, two launchers.

:class:`LocalLauncher`: one node (``disttrain run``, also each node of a torchrun-style
``--nnodes`` job started by hand) runs torch's elastic agent in this very process: nothing to
relay, no second Python start.

:class:`InstancesLauncher`: several instances on this machine (a job's ``instance_count``),
one agent process each, through the flow the remote launchers use (a probe session per
instance that becomes its agent), each its own process group on 127.0.0.1 with its share of
the cores and GPUs, as on separate machines.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from .. import net
from ..config.launch import LaunchSpec
from ..errors import UsageError
from ..linetap import Tapped
from ..net import free_port, port_in_use
from ..placement import oversubscription_hint
from ..plan.launch import LaunchPlan, NodeFacts, make_plan
from ..preflight.facts import local_facts
from ..wire import HostFacts, Outcome
from .base import AgentLauncher, Events, Facts, LaunchContext
from .probe import SessionLauncher
from .transport import LocalTransport, Transport

REPORT_LINES = 200  # the node's last lines kept for the run's report (failure.txt, hang_verdict.txt)


def check_entry(spec: LaunchSpec, cwd: str) -> None:
    """A missing script or module is reported before any process starts (here, or on a
    filesystem the nodes share)."""
    if spec.no_python:  # a program: a path, or a name looked up on PATH (as the workers' exec does)
        path = Path(cwd) / spec.entry
        found = os.access(path, os.X_OK) and path.is_file() if "/" in spec.entry else shutil.which(spec.entry)
        if not found:
            raise UsageError(f"program not found: {spec.entry} (--no-python runs SCRIPT itself: an executable "
                             "file, or a program on PATH)")
        return
    if spec.is_module:
        sys.path.insert(0, cwd)
        try:
            found = importlib.util.find_spec(spec.entry) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.pop(0)
        if not found:
            raise UsageError(f"module {spec.entry!r} not found (is it on PYTHONPATH or in {cwd}?)")
    elif (Path(cwd) / spec.entry).is_dir():
        raise UsageError(f"{spec.entry} is a directory, not a script: name the .py file to run in it")
    elif not (Path(cwd) / spec.entry).is_file():
        raise UsageError(f"script not found: {spec.entry}")


def choose_port(spec: LaunchSpec) -> int:
    host = spec.master_addr or "127.0.0.1"
    hosting = check_rendezvous_address(spec)
    if spec.master_port is None:
        return free_port(host)
    # Only the node that hosts the rendezvous store binds the port.
    if hosting and port_in_use(host, spec.master_port):
        raise UsageError(
            f"--master-port {spec.master_port} is already in use on {host}: "
            "pick another port or omit --master-port to use a free one"
        )
    return spec.master_port


def check_rendezvous_address(spec: LaunchSpec) -> bool:
    """Whether this node hosts the rendezvous store; a master address that cannot work is one
    line (exit 2) here, before anything starts."""
    host = spec.master_addr or "127.0.0.1"
    if spec.rdzv_backend == "static":
        net.check_master(host, flag="--master-addr", must_be_here=spec.node_rank == 0,
                         why="node rank 0 hosts the rendezvous")
        return spec.node_rank == 0
    forced = spec.rdzv_conf.get("is_host", "").lower() in ("1", "true", "yes", "y")
    net.check_master(host, flag="the rendezvous endpoint", must_be_here=forced,
                     why="--rdzv-conf is_host=1 says this node hosts it")
    return net.hosts_c10d_store(host) is True


class LocalLauncher(AgentLauncher):
    """This machine as one node, torch's elastic agent in this very process (``cpus``: the CPUs
    it may use, a Slurm job step's share; None: all usable)."""

    name = "local"

    def __init__(self, *, cpus: int | None = None) -> None:
        self.cpus = cpus

    def facts(self, spec: LaunchSpec, ctx: LaunchContext) -> Facts:
        check_entry(spec, ctx.cwd)
        port = choose_port(spec)  # the master's address is checked first
        # A node of a job started by hand finds its own address and interface toward the master.
        here = local_facts(self.cpus, toward=spec.master_addr if spec.nnodes > 1 else None)
        return Facts(nodes=(here,), master_addr=spec.master_addr or "127.0.0.1", master_port=port,
                     where=(here.name,))

    def place(self, spec: LaunchSpec, facts: Facts, ctx: LaunchContext) -> LaunchPlan:
        """This node's part of ``spec.nnodes`` (torchrun-style: every node started by hand
        plans its own part, with the node rank it was given)."""
        (here,) = facts.nodes
        return make_plan(spec, here, python=ctx.python, master_port=facts.master_port, run_id=ctx.run_id,
                         run_dir=ctx.run_dir, inherited_env=ctx.environ)

    def plan(self, spec: LaunchSpec, ctx: LaunchContext) -> tuple[LaunchPlan, Facts]:
        plan, facts = super().plan(spec, ctx)
        (here,) = facts.nodes
        if not here.cuda_devices:
            hint = oversubscription_hint(nproc=plan.nodes[0].nproc, cpus=here.cpus, host=here.name)
            if hint:  # said at planning time, so --dry-run says it too
                print(f"disttrain: note: {hint}", file=sys.stderr, flush=True)
        return plan, facts

    def launch(self, plan: LaunchPlan, events: Events, ctx: LaunchContext) -> Outcome:
        from ..agent.node import run_node  # torch's elastic agent: imported only to launch

        here = os.getcwd()
        os.chdir(ctx.cwd)  # the workers' folder (the launcher's own, for `disttrain run`)
        said: deque[str] = deque(maxlen=REPORT_LINES)  # the node's own lines, as the relay keeps a host's
        try:
            code = run_node(plan, plan.nodes[0], report_to=Tapped(sys.stderr, lambda _, line: said.append(line)))
        finally:
            os.chdir(here)
        # The run's report (a failure's block, the hang verdict), as relay.report takes it from a host's agent.
        start = next((i for i, line in enumerate(said) if line.startswith("disttrain:")), len(said))
        return Outcome(exit_code=code, report="\n".join(list(said)[start:]) if code else "")


def instance_nodes(instances: Sequence[str], *, cpus: int, gpus: int) -> tuple[NodeFacts, ...]:
    """A job's instances on one machine of ``cpus`` and ``gpus``: each an equal share."""
    n = len(instances)
    return tuple(NodeFacts(name=name, cpus=max(1, cpus // n), cuda_devices=gpus // n) for name in instances)


def own_gpus(plan: LaunchPlan, per_instance: int) -> LaunchPlan:
    """Each instance its own GPUs, as on separate machines."""
    if not per_instance or len(plan.nodes) < 2:
        return plan
    return replace(plan, nodes=tuple(
        replace(node, env={"CUDA_VISIBLE_DEVICES": ",".join(str(node.node_rank * per_instance + g)
                                                            for g in range(per_instance)), **node.env})
        for node in plan.nodes))


class InstancesLauncher(SessionLauncher):
    """A job's instances on this machine: one agent process each (a probe session first), each
    its own process group on 127.0.0.1 with its share of the cores and GPUs."""

    name = "local"
    reach_checks = False  # one machine: every instance reaches the others over loopback

    def __init__(self, instances: Sequence[str]) -> None:
        super().__init__()
        self.instances = tuple(instances)

    def rendezvous(self, spec: LaunchSpec, ctx: LaunchContext) -> tuple[str, int]:
        return "127.0.0.1", choose_port(spec)

    def transports(self, spec: LaunchSpec, ctx: LaunchContext) -> list[Transport]:
        return [LocalTransport(name) for name in self.instances]

    def session_python(self, ctx: LaunchContext) -> str:
        return sys.executable  # disttrain's own interpreter (the job's may be its own venv)

    def facts(self, spec: LaunchSpec, ctx: LaunchContext) -> Facts:
        check_entry(spec, ctx.cwd)  # one machine: what this process sees, every instance sees
        return super().facts(spec, ctx)

    def probe_paths(self, ctx: LaunchContext) -> Sequence[str]:
        return ()  # a job checks its own inputs (its folder is made only when it runs, not for --dry-run)

    def forwarded(self, spec: LaunchSpec, ctx: LaunchContext) -> dict[str, str]:
        return {}  # the agents inherit this process's environment, and their workers theirs

    def where(self, facts: Sequence[HostFacts]) -> tuple[str, ...]:
        return tuple(f.hostname for f in facts)

    def node_facts(self, spec: LaunchSpec, ctx: LaunchContext, facts: Mapping[int, HostFacts]) -> tuple[NodeFacts, ...]:
        first = next(iter(facts.values()))  # one machine: every instance says the same
        every = instance_nodes(self.instances, cpus=first.cpus, gpus=first.cuda_devices)
        return tuple(every[i] for i in facts)

    def place(self, spec: LaunchSpec, facts: Facts, ctx: LaunchContext) -> LaunchPlan:
        return own_gpus(super().place(spec, facts, ctx), facts.nodes[0].cuda_devices)
