"""``disttrain run``'s launch backends (``--backend local|ssh|slurm``) and its Slurm flags.

``--backend`` used to name the process-group backend; that is ``--dist-backend`` now, and
``--backend gloo|nccl|mpi|ucc`` still works, with one line of warning.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..backends.slurm_env import SlurmAllocation
from ..errors import UsageError
from ..placement import BACKENDS

LAUNCH_BACKENDS = ("local", "ssh", "slurm")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default=None, metavar="local|ssh|slurm",
                   help="where the processes start: this machine (default), the --hosts over ssh, or "
                   "Slurm (submits an sbatch job; inside an allocation, uses its nodes, which is also "
                   "the default there)")
    p.add_argument("--dist-backend", default=None, metavar="gloo|nccl|mpi|ucc",
                   help="process-group backend (default: nccl with CUDA, else gloo)")
    g = p.add_argument_group("Slurm (--backend slurm)")
    g.add_argument("--nodes", type=int, default=None,
                   help="nodes to ask for (default 1); inside an allocation: use its first N (default all)")
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


def resolve_backends(args: argparse.Namespace) -> None:
    """Sets ``args.launch_backend`` (None: decided by the context) and ``args.dist_backend``."""
    launch = args.backend
    if launch in BACKENDS:
        if args.dist_backend and args.dist_backend != launch:
            raise UsageError(f"--backend {launch} and --dist-backend {args.dist_backend} disagree: "
                             "give only --dist-backend")
        print(f"disttrain: warning: --backend {launch} is deprecated for the process-group backend; "
              f"use --dist-backend {launch}", file=sys.stderr, flush=True)
        args.dist_backend, launch = launch, None
    elif launch is not None and launch not in LAUNCH_BACKENDS:
        raise UsageError(f"unknown backend {launch!r}: --backend takes {', '.join(LAUNCH_BACKENDS)} "
                         f"(the process-group backend is --dist-backend {'|'.join(BACKENDS)})")
    hosts = bool(args.hosts or args.hostfile)
    if launch == "ssh" and not hosts:
        raise UsageError("--backend ssh needs --hosts or --hostfile")
    if launch in ("local", "slurm") and hosts:
        raise UsageError(f"--backend {launch} runs no ssh: drop --hosts/--hostfile, or use --backend ssh")
    slurm_only = [flag for flag, value in (
        ("--nodes", args.nodes is not None), ("--partition", args.partition), ("--time", args.time),
        ("--gpus-per-node", args.gpus_per_node is not None), ("--sbatch-arg", args.sbatch_arg),
        ("--requeue", args.requeue), ("--no-wait", args.no_wait),
        ("--pending-timeout", args.pending_timeout is not None)) if value]
    if slurm_only and launch != "slurm":
        raise UsageError(f"{slurm_only[0]} is a Slurm flag: add --backend slurm")
    args.launch_backend = launch


def allocation_for(args: argparse.Namespace) -> SlurmAllocation | None:
    """The Slurm job this run should use: with --backend slurm or by default inside one."""
    if args.launch_backend not in (None, "slurm") or args.hosts or args.hostfile:
        return None
    return SlurmAllocation.from_environ(os.environ)


def step_cpus(alloc: SlurmAllocation | None) -> int | None:
    """Inside a job step a run is local, on the CPUs Slurm gave this node."""
    if alloc is None or not alloc.in_step:
        return None
    if alloc.step_tasks > 1:
        raise UsageError(
            f"disttrain run is one of {alloc.step_tasks} tasks of a Slurm job step: run it once, in the "
            "batch script or the salloc shell (not under srun); it starts one agent per node itself")
    return alloc.cpus_on_node


def handle(args: argparse.Namespace, alloc: SlurmAllocation | None) -> int:
    """``--backend slurm``: submit (and follow) outside an allocation; use it inside one."""
    from ..backends import slurm, slurm_alloc
    from ..home import disttrain_home, new_run_id
    from .run import check_entry, spec_from_args

    if args.nnodes != 1 or args.node_rank != 0:
        raise UsageError("--nnodes/--node-rank are for nodes started by hand; on Slurm disttrain starts every "
                         "node itself: --nodes N")
    spec = spec_from_args(args)
    check_entry(spec)  # a shared filesystem is Slurm's norm: the nodes see the script where we do
    run_id = new_run_id(spec.entry, is_module=spec.is_module)
    run_dir = os.path.abspath(spec.log_dir or str(disttrain_home() / "runs" / run_id))
    if alloc is not None:
        return slurm_alloc.run_in_allocation(spec, alloc, nodes=args.nodes, python=args.python,
                                             cwd=os.getcwd(), run_id=run_id, run_dir=run_dir, dry_run=args.dry_run)
    options = slurm.SlurmOptions(
        nodes=1 if args.nodes is None else args.nodes, partition=args.partition, time=args.time, gpus_per_node=args.gpus_per_node,
        requeue=args.requeue, sbatch_args=tuple(args.sbatch_arg),
    )
    script = slurm.render_sbatch(spec, options, run_dir=run_dir, python=args.python, cwd=os.getcwd())
    if args.dry_run:
        print(script, end="")
        return 0
    job = slurm.submit(script, run_dir)
    if args.no_wait:
        print(job.job_id, flush=True)
        print(f"disttrain: submitted Slurm job {job.job_id}; output: {Path(run_dir) / 'slurm.out'}, "
              f"{Path(run_dir) / 'slurm.err'}; stop it with scancel {job.job_id}", file=sys.stderr, flush=True)
        return 0
    print(f"disttrain: submitted Slurm job {job.job_id} ({options.nodes} node{'s' if options.nodes > 1 else ''}); "
          f"logs: {run_dir}; Ctrl-C cancels it", file=sys.stderr, flush=True)
    return job.follow(pending_timeout_s=args.pending_timeout)
