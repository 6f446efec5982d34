"""Inside a Slurm allocation: one torch elastic agent per allocated node, started with srun.

Where this runs: an sbatch script (on the allocation's first node) or a ``salloc`` shell
(often on a login node). The master is the first node, at the address that node uses toward
the second node's ``NodeAddr``, found on the first node itself: a node's own hostname often
resolves to 127.0.x.1. Each node then reports (``disttrain probe`` in one srun step) its route
to the master, its CPUs, GPUs and versions; the plan is made from those facts, as for
``--hosts``, and each node's agent is started by its own ``srun`` so that the first node to
fail is known and the others are stopped through the flow ``--hosts`` uses
(:func:`disttrain.backends.ssh_launch.run_agents`).

The same two steps as a job runner's backend: :func:`place` → a LaunchPlan, :func:`launch`
→ an AgentsOutcome.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from dataclasses import replace
from pathlib import Path

from ..config.hosts import Host
from ..config.launch import LaunchSpec
from ..errors import DisttrainError, UsageError
from ..plan.launch import LaunchPlan, NodeFacts, make_plan
from ..preflight.checks import fact_checks, first_failure
from .slurm import _last_line, _slurm, _write_atomic
from .slurm_env import SlurmAllocation
from .ssh_launch import AgentsOutcome, run_agents

PROBE_TIMEOUT_S = 180  # an srun step that imports torch on every node
_LABELLED = re.compile(r"^\s*(\d+): (.*)$")


def job_port(job_id: str) -> int:
    """The rendezvous port when none is given: fixed per job, so two jobs sharing a node
    are unlikely to meet; checked free on the master before the launch."""
    return 29500 + int(job_id) % 1000 if job_id.isdigit() else 29500


def node_address(name: str) -> str:
    """The address slurm.conf gives node ``name`` (NodeAddr; the name itself by default)."""
    result = _slurm(["scontrol", "show", "node", "-o", name])
    match = re.search(r"(?:^|\s)NodeAddr=(\S+)", result.stdout)
    return match[1] if result.returncode == 0 and match else name


def _probe(nodes: tuple[str, ...], *, python: str, master: str, port: int | None, paths: list[str],
           cwd: str) -> list[dict]:
    """``disttrain probe`` on each of ``nodes`` in one srun step; their facts in node order."""
    n = len(nodes)
    argv = ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}",
            "--label", python, "-m", "disttrain", "probe", "--master", master, "--cwd", cwd]
    if port is not None:
        argv += ["--port", str(port)]
    for path in paths:
        argv += ["--path", path]
    result = _slurm(argv, timeout=PROBE_TIMEOUT_S)
    if result.returncode != 0:
        raise DisttrainError(f"asking the nodes {','.join(nodes)} for their facts (srun ... disttrain probe) "
                             f"failed with exit {result.returncode}: {_last_line(result.stderr)}; is disttrain "
                             f"installed on every node at {python}?")
    facts: dict[int, dict] = {}
    for line in result.stdout.splitlines():
        match = _LABELLED.match(line)
        if match and match[2].startswith("{"):
            facts[int(match[1])] = json.loads(match[2])  # tasks 0..n-1 are the nodes in order
    missing = [nodes[i] for i in range(n) if i not in facts]
    if missing:
        raise DisttrainError(f"no facts from {', '.join(missing)} (srun ... disttrain probe): "
                             f"{_last_line(result.stderr) or 'no output'}")
    return [facts[i] for i in range(n)]


def find_master(alloc: SlurmAllocation, nodes: tuple[str, ...], *, python: str, cwd: str) -> str:
    """The first node's address toward the second, found on the first node."""
    if len(nodes) == 1:
        return "127.0.0.1"
    peer = node_address(nodes[1])
    if alloc.this_node == nodes[0]:  # the batch script runs on the first node
        from ..preflight.facts import route_to

        try:
            return route_to(peer)[0]
        except OSError as err:
            raise DisttrainError(f"{nodes[0]}: no route to {nodes[1]} at {peer}: {err}") from None
    return _probe(nodes[:1], python=python, master=peer, port=None, paths=[], cwd=cwd)[0]["address"]


def place(spec: LaunchSpec, alloc: SlurmAllocation, *, nodes: int | None = None, python: str, cwd: str,
          run_id: str, run_dir: str) -> LaunchPlan:
    """Plan one node per allocated node (the first ``nodes`` of them), the first being the master."""
    if nodes is not None and nodes > len(alloc.nodes):
        raise UsageError(f"--nodes {nodes}: Slurm job {alloc.job_id} has only {len(alloc.nodes)} node(s)")
    names = alloc.nodes[: nodes or len(alloc.nodes)]
    master = spec.master_addr or find_master(alloc, names, python=python, cwd=cwd)
    port = spec.master_port or job_port(alloc.job_id)
    spec = replace(spec, nnodes=len(names), node_rank=0, master_addr=master, master_port=port)
    facts = _probe(names, python=python, master=master, port=port,
                   paths=[] if spec.is_module else [spec.entry], cwd=cwd)
    failed = first_failure(fact_checks([Host(name=name) for name in names], facts, master_port=port))
    if failed:
        raise UsageError(f"{failed.host}: {failed.detail}; fix: {failed.fix}")
    multi = len(names) > 1
    cpus = alloc.cpus_per_node[: len(names)] or tuple(f["cpus"] for f in facts)
    return make_plan(
        spec,
        tuple(
            NodeFacts(
                hostname=name,
                cpus=cpu,
                cuda_devices=alloc.gpus_per_node if alloc.gpus_per_node is not None else f["cuda_devices"],
                # One node talks over loopback; several over the route each found to the master.
                socket_ifname=f["ifname"] if multi else None,
                address=f["address"] if multi else None,
            )
            for name, cpu, f in zip(names, cpus, facts)
        ),
        python=python,
        master_port=port,
        run_id=run_id,
        run_dir=run_dir,
        inherited_env=os.environ,  # srun passes this environment on to every node
    )


def agent_srun_argv(plan: LaunchPlan, node_rank: int, *, plan_file: str, python: str, cpus: int | None) -> list[str]:
    """One node's agent as a one-task job step on that node, with the node's CPUs."""
    node = plan.nodes[node_rank]
    argv = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node.host}", "--unbuffered"]
    if cpus:
        argv.append(f"--cpus-per-task={cpus}")
    return [*argv, python, "-m", "disttrain", "agent", "--plan-file", plan_file,
            "--node-rank", str(node_rank), "--watch-stdin"]


def launch(plan: LaunchPlan, alloc: SlurmAllocation, *, python: str, cwd: str) -> AgentsOutcome:
    """Write the plan into the run folder and run every node's agent until the job ends."""
    plan_file = Path(plan.run_dir) / "plan.json"
    plan_file.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(plan_file, plan.to_json())
    cpus = alloc.cpus_per_node or (None,) * len(plan.nodes)
    commands = [agent_srun_argv(plan, node.node_rank, plan_file=str(plan_file), python=python, cpus=cpus[i])
                for i, node in enumerate(plan.nodes)]
    return run_agents(plan, commands, cwd=cwd)


def run_in_allocation(spec: LaunchSpec, alloc: SlurmAllocation, *, nodes: int | None, python: str, cwd: str,
                      run_id: str, run_dir: str, dry_run: bool = False) -> int:
    """``disttrain run`` inside an allocation: plan, launch, say how it ended; the exit code."""
    if alloc.restart_count:  # a requeued job: the first run's logs stay as they were
        run_dir = str(Path(run_dir) / f"requeue_{alloc.restart_count}")
    plan = place(spec, alloc, nodes=nodes, python=python, cwd=cwd, run_id=run_id, run_dir=run_dir)
    if dry_run:
        print(plan.to_json())
        return 0
    where = ", ".join(node.host for node in plan.nodes)
    print(f"disttrain: {plan.world_size} worker{'s' if plan.world_size > 1 else ''} ({plan.backend}) on {where} "
          f"(Slurm job {alloc.job_id}), rendezvous {plan.master_addr}:{plan.master_port}; logs: {plan.run_dir}",
          file=sys.stderr, flush=True)
    outcome = launch(plan, alloc, python=python, cwd=cwd)
    if outcome.signal:
        print(f"disttrain: got {signal.Signals(outcome.signal).name}, stopped all nodes", file=sys.stderr, flush=True)
    elif outcome.failed is not None and not outcome.report:
        host = plan.nodes[outcome.failed].host
        print(f"disttrain: the agent on {host} (srun) exited with code {outcome.exit_code}; "
              "the other nodes were stopped", file=sys.stderr, flush=True)
    return outcome.exit_code

