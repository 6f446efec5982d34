"""torch's ``LaunchConfig`` for one node of a plan: torchrun's options as torchrun passes them,
plus what disttrain knows better than torch's guesses (is_host, the node's address)."""

from __future__ import annotations

import shutil
from collections.abc import Callable

from .. import net, torchcompat
from ..plan.launch import LaunchPlan, NodePlan
from .logs import RankLogs


def endpoint(plan: LaunchPlan) -> str:
    host = f"[{plan.master_addr}]" if ":" in plan.master_addr else plan.master_addr
    return f"{host}:{plan.master_port}"


# An elastic job that disttrain placed (--hosts, Slurm, a job's instances): a lost node leaves the
# c10d rendezvous when its heartbeat is keep_alive_interval x keep_alive_max_attempt old (torch:
# 5 s x 3), and a round with its minimum waits last_call_timeout for more nodes (torch: 30 s); both
# are part of the time from a lost host to training again. The first round and a round that grows
# wait for the nodes they know of (agent/gathering.py), so a short last call loses no one; --rdzv-conf
# still wins.
ELASTIC_RDZV_CONF = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3, "last_call_timeout": 1}


def rdzv_configs(plan: LaunchPlan, node: NodePlan, *, hosts_store: Callable[[str], bool | None] = net.hosts_c10d_store
                 ) -> dict:
    """The rendezvous settings: disttrain's, then ``--rdzv-conf`` over them (the user's word wins),
    and for the static rendezvous the node rank last, as torchrun does."""
    if plan.rdzv_backend == "static":
        return {"timeout": plan.rdzv_timeout_s, **plan.rdzv_conf, "rank": node.node_rank}
    conf: dict = {"join_timeout": plan.rdzv_timeout_s}
    if plan.rdzv_backend == "c10d":
        # c10d guesses whether it hosts the store from the host name, which resolves to 127.0.0.1
        # on many machines. A launcher that placed every node knows: node 0 -- or nobody, for an
        # elastic range, whose store the launcher holds (launch/rendezvous_store.py); a node
        # started by hand looks at its own addresses.
        is_host = hosts_store(plan.master_addr) if plan.by_hand else node.node_rank == 0 and not plan.elastic
        if is_host is not None:
            conf["is_host"] = is_host
        if plan.elastic and not plan.by_hand:
            conf.update(ELASTIC_RDZV_CONF)
    return {**conf, **plan.rdzv_conf}


def numa_choice(mode: str | None, *, cuda_devices: int, numactl: str | None) -> tuple[str | None, str | None]:
    """``--numa-binding``: (the mode to give torch, or None; a line to say, or None).

    torch binds a worker to the CPUs near the GPU of its local rank, through ``numactl``; without
    either, torchrun's workers fail to start. Here the run goes on unbound, said once."""
    if mode is None:
        return None, None
    if cuda_devices < 1:
        return None, (f"--numa-binding {mode} binds each worker to the CPUs near its GPU, and this node has no "
                      "CUDA GPU: the workers run unbound")
    if numactl is None:
        return None, f"--numa-binding {mode} needs numactl on this node (apt-get install numactl): the workers run unbound"
    return mode, None


def launch_config(plan: LaunchPlan, node: NodePlan, *, cuda_devices: int, prefix: str,
                  say: Callable[[str], None]):
    """torch's ``LaunchConfig`` for this node, built for the installed torch (:mod:`disttrain.torchcompat`)."""
    agent = plan.agent
    numa, note = numa_choice(agent.numa_binding, cuda_devices=cuda_devices, numactl=shutil.which("numactl"))
    if note:
        say(f"disttrain: note: {note}")
    numa_options = None
    if numa is not None:
        from torch.numa.binding import AffinityMode, NumaOptions

        numa_options = NumaOptions(affinity_mode=AffinityMode(numa))
    return torchcompat.launch_config(
        min_nodes=plan.min_nnodes or plan.nnodes,
        max_nodes=plan.nnodes,
        nproc_per_node=node.nproc,
        run_id=plan.rendezvous_id,
        role=agent.role,
        rdzv_backend=plan.rdzv_backend,
        rdzv_endpoint=endpoint(plan),
        rdzv_configs=rdzv_configs(plan, node),
        rdzv_timeout=plan.rdzv_timeout_s,
        local_addr=node.address,
        max_restarts=plan.max_restarts,
        monitor_interval=agent.monitor_interval_s,
        start_method=agent.start_method,
        event_log_handler=agent.event_log_handler,
        numa_options=numa_options,
        signals_to_handle=agent.signals_to_handle,
        duplicate_stdout_filters=list(agent.duplicate_stdout_filters) or None,
        duplicate_stderr_filters=list(agent.duplicate_stderr_filters) or None,
        virtual_local_rank=agent.virtual_local_rank,
        logs_specs=RankLogs(plan.run_dir, plan.shown_ranks, agent),
        log_line_prefix_template=prefix,
        shutdown_timeout=plan.stop_grace_s,
    )
