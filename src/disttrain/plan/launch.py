"""Pure planning: a validated spec plus facts about the node → a JSON-serialisable plan.

No side effects here (ports are probed and clocks read by the caller), so every rank,
environment variable and argv a launch will use can be printed by ``--dry-run`` and
checked by unit tests.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..config.launch import AgentOptions, LaunchSpec, new_keys
from ..errors import UsageError
from ..placement import auto_nproc, choose_dist_backend, omp_threads
from ..tfconfig import SHIM, tf_config, worker_addresses
from ..workerenv import launcher_env
from .container import ContainerSetup, InstanceSetup


@dataclass(frozen=True, kw_only=True)
class NodeFacts:
    """What the planner needs to know about the node it plans for."""

    # The node's name in messages, log prefixes and records: its host (as --hosts, Slurm or the
    # machine names it), or a job's instance name (algo-1) where the instances share one machine.
    name: str
    cpus: int
    cuda_devices: int = 0
    # The interface this node reaches the master through (GLOO/NCCL_SOCKET_IFNAME), found
    # from its routes: on these machines the hostname resolves to 127.0.0.1.
    socket_ifname: str | None = None
    # This node's own address toward the master (c10d rendezvous binds and advertises it).
    address: str | None = None
    # Processes the hostfile gives this host (``slots=N``); used when ``-n auto``.
    slots: int | None = None


@dataclass(frozen=True, kw_only=True)
class WorkerPlan:
    rank: int
    local_rank: int
    env: dict[str, str]


@dataclass(frozen=True, kw_only=True)
class NodePlan:
    node_rank: int
    name: str  # NodeFacts.name
    address: str | None
    nproc: int
    env: dict[str, str]
    workers: tuple[WorkerPlan, ...]
    # A SageMaker job instance's folder, shown to this node's processes at /opt/ml through a
    # mount namespace made on the node's own machine (see disttrain.agent.optml); None: no such thing.
    opt_ml: str | None = None
    opt_ml_required: bool = False  # no mount namespace on that machine: an error, not a note


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    run_id: str
    run_dir: str
    argv: tuple[str, ...]
    dist_backend: str
    nnodes: int
    world_size: int
    master_addr: str
    master_port: int
    rdzv_backend: str
    rdzv_timeout_s: int
    max_restarts: int
    stop_grace_s: int
    hang_timeout_s: int
    shown_ranks: tuple[int, ...] | None
    nodes: tuple[NodePlan, ...]
    framework: str = "pytorch"
    # The user's variables, applied by each node's agent over its own environment, in this
    # order: the launching shell's exports (remote launchers only: local workers inherit
    # them), node.env (disttrain's), then ``--env KEY=VALUE``. Their values may be secrets:
    # they reach agents over a private channel only (:meth:`to_private_json`).
    env_forwarded: dict[str, str] = dataclasses.field(default_factory=dict)
    env_set: dict[str, str] = dataclasses.field(default_factory=dict)
    # torchrun's options (config/torchrun.py): the elastic minimum (None: nnodes), the user's
    # rendezvous id and settings, the entry as a function (--run-path), and the agent's own.
    min_nnodes: int | None = None
    rdzv_id: str | None = None
    rdzv_conf: dict[str, str] = dataclasses.field(default_factory=dict)
    run_path: bool = False
    agent: AgentOptions = dataclasses.field(default_factory=AgentOptions)
    # This plan is one node's part of a job whose other nodes were started by hand (torchrun-style),
    # as opposed to a plan made for every node by one launcher -- which, with ``--nnodes MIN:MAX``,
    # may start fewer nodes than ``nnodes`` and add others later.
    by_hand: bool = False

    @property
    def elastic(self) -> bool:
        """``--nnodes MIN:MAX``: each rendezvous round decides how many nodes train."""
        return self.min_nnodes is not None and self.min_nnodes < self.nnodes

    @property
    def rendezvous_id(self) -> str:
        """The key the nodes meet under: ``--rdzv-id`` if given. A plan made for every node (--hosts,
        Slurm, a job) carries one run id; nodes started by hand (``--nnodes 2 --node-rank K``) each
        made their own, so there the rendezvous endpoint, which every node was given alike, names the job."""
        if self.rdzv_id:
            return self.rdzv_id
        if not self.by_hand:
            return self.run_id
        return f"disttrain-{self.master_addr}-{self.master_port}"

    def to_json(self, indent: int | None = 2) -> str:
        """What may be shown and kept (``--dry-run``, ``plan.json``): the user's variables by name only."""
        data = dataclasses.asdict(self)
        for key in ("env_forwarded", "env_set"):
            data[key] = sorted(data[key])
        return json.dumps(data, indent=indent)

    def to_private_json(self) -> str:
        """Everything, values included: only for an agent's stdin or a 0600 file."""
        return json.dumps(dataclasses.asdict(self))

    def worker_env(self, node: NodePlan) -> dict[str, str]:
        """What node ``node``'s agent exports to its workers, in the documented order."""
        return {**self.env_forwarded, **node.env, **self.env_set}


class ContainerPlanner(Protocol):
    """A job's half of planning (see :mod:`disttrain.plan.container`): the nodes' facts, one per
    instance in order (``node_ranks``: which instances, when not all of them), and the rendezvous
    endpoint → what its container adds. Pure, so that
    ``--dry-run`` calls it too."""

    def __call__(self, nodes: tuple[NodeFacts, ...], *, master_addr: str, master_port: int,
                 node_ranks: Sequence[int] | None = None) -> ContainerSetup:
        ...


def _nproc(spec: LaunchSpec, facts: NodeFacts) -> int:
    if spec.nproc_per_node == "cpu":  # torchrun's: one per core
        return facts.cpus
    if spec.nproc_per_node == "gpu":
        if facts.cuda_devices < 1:
            raise UsageError(f"--nproc-per-node gpu: {facts.name} has no CUDA GPUs; give a number or auto")
        return facts.cuda_devices
    if spec.nproc_per_node != "auto":
        return int(spec.nproc_per_node)
    return facts.slots or auto_nproc(cuda_devices=facts.cuda_devices, cpus=facts.cpus)


def _argv(spec: LaunchSpec, python: str, container: ContainerSetup | None) -> tuple[str, ...]:
    """What each worker runs: ``python -u SCRIPT`` (``-m MODULE``), or the program itself (--no-python);
    a job's container may name the interpreter (its venv) and a wrapper (its ps task)."""
    if spec.no_python:
        return (spec.entry, *spec.script_args)
    target = ("-m", spec.entry) if spec.is_module else (spec.entry,)
    if spec.framework == "tensorflow":
        target = ("-m", SHIM, *target)  # adds the worker's TF_CONFIG, then execs the script
    if container is not None and container.wrapper:
        target = ("-m", container.wrapper, *target)
    worker_python = container.python if container is not None and container.python else python
    return (worker_python, "-u", *target, *spec.script_args)


def _tf_workers(placed: tuple, *, nnodes: int, master_addr: str, master_port: int) -> tuple[str, ...]:
    """Every TensorFlow worker's ``host:port``; none for one worker (MirroredStrategy needs no cluster)."""
    if nnodes > len(placed):
        raise UsageError(
            "--framework tensorflow across nodes needs --hosts (or a job): every worker's TF_CONFIG "
            "lists all workers' addresses, which one node started by hand cannot know"
        )
    if sum(nproc for _, _, nproc, _ in placed) < 2:
        return ()
    return worker_addresses([(facts.address or master_addr, nproc) for _, facts, nproc, _ in placed], master_port)


def make_plan(
    spec: LaunchSpec,
    facts: NodeFacts | tuple[NodeFacts, ...],
    *,
    python: str,
    master_port: int,
    run_id: str,
    run_dir: str,
    inherited_env: Mapping[str, str],
    forwarded_env: Mapping[str, str] | None = None,
    container: ContainerSetup | None = None,
    node_ranks: Sequence[int] | None = None,
) -> LaunchPlan:
    """Plan a launch.

    With one ``NodeFacts`` this plans this machine's part (``spec.node_rank`` of
    ``spec.nnodes``, torchrun-style); with a tuple, one node per host, in host order, the
    first being the master. ``forwarded_env``: the launching shell's variables that a
    remote launcher carries to the hosts (local workers inherit them instead). ``container``:
    what a job's container adds to each node (its variables, its /opt/ml, the workers'
    interpreter and wrapper); the plan returned is then the job's whole plan. ``node_ranks``: the
    nodes' ranks when they are not 0..N-1 in order -- an elastic job's nodes keep their host's
    place in the list whichever of them run (the c10d rendezvous numbers them itself).
    """
    if isinstance(facts, NodeFacts):
        # torchrun-style: this node's part only; every node runs the same -n.
        nproc = _nproc(spec, facts)
        placed = ((spec.node_rank, facts, nproc, spec.node_rank * nproc),)
        nnodes, world_size = spec.nnodes, nproc * spec.nnodes
    else:
        # One node per host; counts may differ (slots=, -n auto on unequal hosts), so a
        # node's first rank is the sum of the counts before it, as torch's agent assigns.
        counts = [_nproc(spec, f) for f in facts]
        firsts = [sum(counts[:i]) for i in range(len(counts))]
        ranks = tuple(node_ranks) if node_ranks is not None else tuple(range(len(facts)))
        if len(ranks) != len(facts) or len(set(ranks)) != len(ranks):
            raise ValueError(f"node_ranks {ranks} for {len(facts)} node(s)")
        placed = tuple(zip(ranks, facts, counts, firsts))
        # An elastic range keeps its maximum: hosts that were not reachable at the start join later.
        nnodes, world_size = (spec.nnodes if spec.elastic else len(facts)), sum(counts)
    if spec.ranks is not None:
        missing = [r for r in spec.ranks if r >= world_size]
        if missing:
            raise UsageError(
                f"--ranks names rank {missing[0]} but the job has ranks 0..{world_size - 1}"
            )
    dist_backend = choose_dist_backend(spec.dist_backend, cuda_available=placed[0][1].cuda_devices > 0)
    no_gpu = [f.name for _, f, _, _ in placed if f.cuda_devices <= 0]
    if spec.dist_backend == "nccl" and no_gpu:
        raise UsageError(f"--dist-backend nccl needs CUDA GPUs, and {no_gpu[0]} has none: "
                         "use --dist-backend gloo (or leave it out: gloo is the default without GPUs)")
    master_addr = spec.master_addr or "127.0.0.1"
    setups = _instances(container, len(placed))

    tf_workers: tuple[str, ...] = ()
    if spec.framework == "tensorflow":
        tf_workers = _tf_workers(placed, nnodes=nnodes, master_addr=master_addr, master_port=master_port)
    argv = _argv(spec, python, container)
    show_tf_config = bool(tf_workers) and "TF_CONFIG" not in inherited_env and "TF_CONFIG" not in spec.env

    nodes = tuple(
        NodePlan(
            node_rank=node_rank,
            name=node_facts.name,
            # --local-addr names the address of the one node a by-hand plan is for.
            address=(spec.local_addr if len(placed) == 1 and spec.local_addr else node_facts.address),
            nproc=nproc,
            env=launcher_env(
                dist_backend=dist_backend,
                run_dir=run_dir,
                omp_threads=omp_threads(cpus=node_facts.cpus, nproc=nproc),
                inherited=inherited_env,
                socket_ifname=node_facts.socket_ifname,
                checkpoint_dir=spec.checkpoint_dir,
                checkpoint_every=spec.checkpoint_every,
                checkpoint_retry_s=spec.checkpoint_retry_s,
                # Always: the launcher's straggler warning and steps/s summary read the heartbeats too.
                heartbeat_dir=f"{run_dir}/heartbeat/node{node_rank}",
                hang_timeout_s=spec.hang_timeout_s,
                tf_workers=tf_workers,
                tf_first_task=first,
                grad_compression=spec.grad_compression,
                bucket_mb=spec.bucket_mb,
                track=spec.track,
                cuda_devices=node_facts.cuda_devices,
                local_world_size=nproc,
                nnodes=None if spec.elastic or len({n for _, _, n, _ in placed}) > 1 else nnodes,
            ) | dict(setup.env),  # the container's variables over the launcher's (the user's over both)
            workers=tuple(
                WorkerPlan(
                    rank=first + local_rank,
                    local_rank=local_rank,
                    # Mirrors what torch's elastic agent sets for static rendezvous; shown
                    # by --dry-run so users see exactly what their script will read.
                    env={
                        "RANK": str(first + local_rank),
                        "LOCAL_RANK": str(local_rank),
                        "WORLD_SIZE": str(world_size),
                        "LOCAL_WORLD_SIZE": str(nproc),
                        "GROUP_RANK": str(node_rank),
                        "MASTER_ADDR": master_addr,
                        "MASTER_PORT": str(master_port),
                        **({"TF_CONFIG": tf_config(tf_workers, first + local_rank)} if show_tf_config else {}),
                    },
                )
                for local_rank in range(nproc)
            ),
            opt_ml=setup.opt_ml,
            opt_ml_required=setup.opt_ml_required,
        )
        for (node_rank, node_facts, nproc, first), setup in zip(placed, setups)
    )
    return LaunchPlan(
        run_id=run_id,
        run_dir=run_dir,
        argv=argv,
        dist_backend=dist_backend,
        nnodes=nnodes,
        world_size=world_size,
        master_addr=master_addr,
        master_port=master_port,
        rdzv_backend=spec.rdzv_backend,
        rdzv_timeout_s=spec.rdzv_timeout_s,
        max_restarts=spec.max_restarts,
        stop_grace_s=spec.stop_grace_s,
        hang_timeout_s=spec.hang_timeout_s,
        shown_ranks=spec.ranks,
        nodes=nodes,
        framework=spec.framework,
        env_forwarded=dict(forwarded_env or {}),
        env_set=dict(spec.env),
        min_nnodes=spec.min_nnodes,
        rdzv_id=spec.rdzv_id,
        rdzv_conf=dict(spec.rdzv_conf),
        run_path=spec.run_path,
        agent=spec.agent,
        by_hand=isinstance(facts, NodeFacts) and spec.nnodes != 1,
    )


def _instances(container: ContainerSetup | None, count: int) -> tuple[InstanceSetup, ...]:
    if container is None:
        return (InstanceSetup(),) * count
    if len(container.instances) != count:
        raise ValueError(f"the container set up {len(container.instances)} instance(s) for a plan of {count} node(s)")
    return container.instances


# An old disttrain's names for LaunchPlan's keys, still read (a plan.json it kept).
_OLD_KEYS = {"backend": "dist_backend", "min_nodes": "min_nnodes"}  # old -> new
_OLD_NODE_KEYS = {"host": "name"}  # old -> new


def plan_from_json(text: str) -> LaunchPlan:
    """The inverse of :meth:`LaunchPlan.to_private_json`: how a node's agent gets its plan (and
    the ``plan.json`` of an old disttrain, read under the new names of its keys)."""
    data = new_keys(json.loads(text), _OLD_KEYS, where="launch plan")
    nodes = tuple(
        NodePlan(
            **{k: v for k, v in new_keys(node, _OLD_NODE_KEYS, where="launch plan").items() if k != "workers"},
            workers=tuple(WorkerPlan(**w) for w in node["workers"]),
        )
        for node in data.pop("nodes")
    )
    shown = data.pop("shown_ranks")
    if "agent" in data:
        data["agent"] = AgentOptions.from_dict(data["agent"])
    return LaunchPlan(
        **{**data, "argv": tuple(data["argv"])},
        shown_ranks=None if shown is None else tuple(shown),
        nodes=nodes,
    )
