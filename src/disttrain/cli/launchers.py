"""``disttrain run``'s choice of launcher (``--launcher local|ssh|slurm``) and its flags.

One meaning per word: ``--launcher`` is where the processes start, ``--dist-backend`` the
process group's backend. Old spellings keep working with one line of warning each:
``--backend local|ssh|slurm`` (the launcher) and ``--backend gloo|nccl|mpi|ucc`` (the
process-group backend).
"""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import UsageError
from ..launch import LAUNCHERS, Launcher
from ..launch.local import LocalLauncher
from ..launch.slurm import SlurmBatchLauncher, SlurmOptions
from ..launch.slurm_alloc import SlurmAllocationLauncher
from ..launch.slurm_env import SlurmAllocation
from ..launch.ssh import SshLauncher
from ..placement import DIST_BACKENDS
from ..ssh import parse_ssh_options
from .common import hosts_from_args


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--launcher", default=None, metavar="|".join(LAUNCHERS),
                   help="where the processes start: this machine (default), the --hosts over ssh (the "
                   "default with --hosts), or Slurm (submits an sbatch job; inside an allocation, uses its "
                   "nodes, which is also the default there)")
    p.add_argument("--backend", default=None, help=argparse.SUPPRESS)  # the old name of both flags
    p.add_argument("--dist-backend", default=None, metavar="|".join(DIST_BACKENDS),
                   help="process-group backend (default: nccl with CUDA, else gloo)")
    g = p.add_argument_group("Slurm (--launcher slurm)")
    g.add_argument("--nodes", type=int, default=None,
                   help="nodes to ask for (default 1); inside an allocation: use its first N (default all). "
                   "On Slurm --nnodes N says the same")
    g.add_argument("--partition", default=None, help="Slurm partition (sbatch --partition)")
    g.add_argument("--time", default=None, metavar="LIMIT",
                   help="time limit, as sbatch takes it: minutes, H:MM:SS, D-HH (sbatch --time)")
    g.add_argument("--gpus-per-node", type=int, default=None, metavar="G",
                   help="GPUs to ask for on each node; -n auto then starts G processes per node")
    g.add_argument("--sbatch-arg", action="append", default=[], metavar="OPTION",
                   help="one more sbatch option, e.g. --sbatch-arg=--mem=16G (repeatable)")
    g.add_argument("--requeue", action="store_true",
                   help="Slurm may requeue the job (preemption, node failure); it resumes from its newest "
                   "checkpoint (--checkpoint-dir, default: checkpoints/ in the run folder)")
    g.add_argument("--no-wait", action="store_true", help="submit, print the Slurm job id and return")
    g.add_argument("--pending-timeout", type=float, default=None, metavar="S",
                   help="cancel the job, with Slurm's reason, if it has not started after S seconds "
                   "(default: wait, printing the reason)")


def _warn(old: str, new: str, what: str) -> None:
    print(f"disttrain: warning: {old} is deprecated {what}; use {new}", file=sys.stderr, flush=True)


def resolve_names(args: argparse.Namespace) -> None:
    """Sets ``args.launcher`` (None: decided by the context) and ``args.dist_backend`` from
    the flags, old spellings included; refuses flags that do not fit the launcher."""
    launch = args.launcher
    old = args.backend
    if old in DIST_BACKENDS:
        if args.dist_backend and args.dist_backend != old:
            raise UsageError(f"--backend {old} and --dist-backend {args.dist_backend} disagree: "
                             "give only --dist-backend")
        _warn(f"--backend {old}", f"--dist-backend {old}", "for the process-group backend")
        args.dist_backend = old
    elif old in LAUNCHERS:
        if launch and launch != old:
            raise UsageError(f"--backend {old} and --launcher {launch} disagree: give only --launcher")
        _warn(f"--backend {old}", f"--launcher {old}", "for the launcher")
        launch = old
    elif old is not None:
        raise UsageError(f"unknown backend {old!r}: the launcher is --launcher {'|'.join(LAUNCHERS)}, "
                         f"the process-group backend --dist-backend {'|'.join(DIST_BACKENDS)}")
    if launch is not None and launch not in LAUNCHERS:
        raise UsageError(f"unknown launcher {launch!r}: --launcher takes {', '.join(LAUNCHERS)}")
    hosts = bool(args.hosts or args.hostfile)
    if launch == "ssh" and not hosts:
        raise UsageError("--launcher ssh needs --hosts or --hostfile")
    if launch in ("local", "slurm") and hosts:
        raise UsageError(f"--launcher {launch} runs no ssh: drop --hosts/--hostfile, or use --launcher ssh")
    slurm_only = [flag for flag, value in (
        ("--nodes", args.nodes is not None), ("--partition", args.partition), ("--time", args.time),
        ("--gpus-per-node", args.gpus_per_node is not None), ("--sbatch-arg", args.sbatch_arg),
        ("--requeue", args.requeue), ("--no-wait", args.no_wait),
        ("--pending-timeout", args.pending_timeout is not None)) if value]
    if slurm_only and launch != "slurm":
        raise UsageError(f"{slurm_only[0]} is a Slurm flag: add --launcher slurm")
    args.launcher = launch


def allocation_for(args: argparse.Namespace) -> SlurmAllocation | None:
    """The Slurm job this run should use: with --launcher slurm or by default inside one."""
    if args.launcher not in (None, "slurm") or args.hosts or args.hostfile:
        return None
    return SlurmAllocation.from_environ(os.environ)


def job_step_cpus(alloc: SlurmAllocation | None) -> int | None:
    """Inside a job step a run is local, on the CPUs Slurm gave this node."""
    if alloc is None or not alloc.in_job_step:
        return None
    if alloc.job_step_tasks > 1:
        raise UsageError(
            f"disttrain run is one of {alloc.job_step_tasks} tasks of a Slurm job step: run it once, in the "
            "batch script or the salloc shell (not under srun); it starts one agent per node itself")
    return alloc.cpus_on_node


def slurm_nodes(args: argparse.Namespace) -> int | None:
    """How many nodes a Slurm launch uses: --nodes N (Slurm's word) or --nnodes N (torchrun's,
    set aside by ``cli.run.resolve_args``), one count; None: neither given."""
    nnodes = getattr(args, "slurm_nnodes", None)
    if nnodes is not None and args.nodes is not None and nnodes != args.nodes:
        raise UsageError(f"--nnodes {nnodes} and --nodes {args.nodes} disagree: on Slurm both are the number of "
                         "nodes; give one")
    return args.nodes if args.nodes is not None else nnodes


def launcher_from_args(args: argparse.Namespace) -> Launcher:
    """The one place the flags pick a launcher; every launcher is then used the same way."""
    resolve_names(args)
    hosts = hosts_from_args(args)
    if hosts:
        return SshLauncher(hosts, options=parse_ssh_options(args.ssh_option), sync=args.sync and not args.dry_run)
    if args.sync:
        raise UsageError("--sync copies the working directory to --hosts; without hosts there is nothing to copy to")
    alloc = allocation_for(args)
    if alloc is None and args.launcher != "slurm":
        return LocalLauncher()
    if alloc is not None and alloc.in_job_step:
        return LocalLauncher(cpus=job_step_cpus(alloc))
    elastic = getattr(args, "min_nnodes", None) is not None and args.min_nnodes < args.nnodes
    if (args.nnodes != 1 and not elastic) or args.node_rank != 0:
        raise UsageError("--nnodes/--node-rank are for nodes started by hand; on Slurm disttrain starts every "
                         "node itself: --nnodes N or --nodes N (or an elastic range, --nnodes MIN:MAX)")
    if elastic and args.nodes is not None and args.nodes != args.nnodes:
        raise UsageError(f"--nodes {args.nodes} and --nnodes {args.min_nnodes}:{args.nnodes}: an elastic job asks "
                         f"Slurm for {args.min_nnodes} to {args.nnodes} nodes; give the range only")
    nodes = None if elastic else slurm_nodes(args)
    if alloc is not None:
        return SlurmAllocationLauncher(alloc, nodes=nodes)
    options = SlurmOptions(
        nodes=args.nnodes if elastic else 1 if nodes is None else nodes, partition=args.partition, time=args.time,
        gpus_per_node=args.gpus_per_node, requeue=args.requeue, sbatch_args=tuple(args.sbatch_arg))
    return SlurmBatchLauncher(options, no_wait=args.no_wait, pending_timeout_s=args.pending_timeout)
