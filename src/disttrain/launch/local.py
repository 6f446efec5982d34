"""``--launcher local``: this machine.

One node (``disttrain run``, also each node of a torchrun-style ``--nnodes`` job started by
hand) runs torch's elastic agent in this very process: nothing to relay, no second Python
start. Several instances on this machine (a job's ``instance_count``) are one agent process
each, through the flow the remote launchers use, each its own process group on 127.0.0.1
with its share of the cores and GPUs, as on separate machines.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

from ..config.launch import LaunchSpec
from ..errors import UsageError
from ..net import free_port, port_in_use
from ..placement import oversubscription_hint
from ..plan.launch import LaunchPlan, NodeFacts
from ..preflight.facts import local_facts
from .base import Context, Events, Facts, Launcher, Outcome
from .flow import agent_argv, run_agents


def check_entry(spec: LaunchSpec, cwd: str) -> None:
    """A missing script or module is reported before any process starts (here, or on a
    filesystem the nodes share)."""
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
    if spec.master_port is None:
        return free_port(host)
    # Only the node that hosts the rendezvous store binds the port.
    if spec.node_rank == 0 and port_in_use(host, spec.master_port):
        raise UsageError(
            f"--master-port {spec.master_port} is already in use on {host}: "
            "pick another port or omit --master-port to use a free one"
        )
    return spec.master_port


class LocalLauncher(Launcher):
    """``instances``: names of a job's instances (several agents); None: one node, in process."""

    name = "local"

    def __init__(self, *, instances: tuple[str, ...] | None = None, cpus: int | None = None) -> None:
        self.instances = instances
        self.cpus = cpus  # the CPUs this node may use (a Slurm job step's share), None: all usable

    def facts(self, spec: LaunchSpec, ctx: Context) -> Facts:
        if self.instances is None:  # a job checks its own inputs
            check_entry(spec, ctx.cwd)
        here = local_facts(self.cpus)
        if self.instances is None:
            return Facts(nodes=here, master_addr=spec.master_addr or "127.0.0.1", master_port=choose_port(spec),
                         where=(here.hostname,))
        n = len(self.instances)
        cpus, gpus = max(1, here.cpus // n), here.cuda_devices // n
        nodes = tuple(NodeFacts(hostname=name, cpus=cpus, cuda_devices=gpus) for name in self.instances)
        return Facts(nodes=nodes, master_addr="127.0.0.1", master_port=free_port("127.0.0.1"),
                     where=(here.hostname,) * n)

    def place(self, spec: LaunchSpec, facts: Facts, ctx: Context) -> LaunchPlan:
        plan = super().place(spec, facts, ctx)
        gpus = facts.nodes[0].cuda_devices if isinstance(facts.nodes, tuple) else 0
        if gpus and len(plan.nodes) > 1:  # each instance its own GPUs, as on separate machines
            plan = replace(plan, nodes=tuple(
                replace(node, env={"CUDA_VISIBLE_DEVICES": ",".join(str(k * gpus + g) for g in range(gpus)),
                                   **node.env})
                for k, node in enumerate(plan.nodes)))
        return plan

    def plan(self, spec: LaunchSpec, ctx: Context) -> tuple[LaunchPlan, Facts]:
        plan, facts = super().plan(spec, ctx)
        here = facts.nodes
        if isinstance(here, NodeFacts) and not here.cuda_devices:
            hint = oversubscription_hint(nproc=plan.nodes[0].nproc, cpus=here.cpus, host=here.hostname)
            if hint:  # said at planning time, so --dry-run says it too
                print(f"disttrain: note: {hint}", file=sys.stderr, flush=True)
        return plan, facts

    def launch(self, plan: LaunchPlan, events: Events, ctx: Context) -> Outcome:
        if self.instances is None:
            from ..agent.node import run_node  # torch's elastic agent: imported only to launch

            return Outcome(exit_code=run_node(plan, plan.nodes[0]))
        commands = [agent_argv(sys.executable) for _ in plan.nodes]
        return run_agents(plan, commands, cwd=ctx.cwd, transcript=events.transcript)
