"""``disttrain run``: torchrun's flags, disttrain's defaults; this machine or ``--hosts`` over ssh."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from ..backends.ssh import parse_ssh_options
from ..backends.ssh_launch import plan_hosts, run_hosts
from ..backends.sync import sync_all
from ..config.hosts import Host
from ..config.launch import LaunchSpec, parse_env, parse_nproc, parse_ranks
from ..errors import UsageError
from ..home import disttrain_home, new_run_id
from ..net import free_port, port_in_use
from ..placement import oversubscription_hint
from ..plan.launch import LaunchPlan, make_plan
from ..preflight.facts import local_facts
from ..private import write_private
from ..runtime import comm
from ..workerenv import forwarded_env
from . import slurm_run
from .common import add_host_args, hosts_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run a training script on N processes",
        description="Run SCRIPT (or -m MODULE) as a data-parallel job. Everything after the "
        "script is passed to it verbatim. Flags use torchrun's names, so "
        "`torchrun --nproc-per-node 2 train.py` becomes `disttrain run --nproc-per-node 2 train.py`.",
    )
    p.add_argument("-n", "--nproc-per-node", "--nproc_per_node", dest="nproc", default="auto",
                   help="processes per node: a number or 'auto' (one per GPU; on CPU one per two cores)")
    p.add_argument("-m", "--module", action="store_true",
                   help="treat SCRIPT as a Python module, like `python -m`")
    slurm_run.add_args(p)  # --backend (local, ssh, slurm), --dist-backend and the Slurm flags
    p.add_argument("--framework", default="pytorch", metavar="pytorch|tensorflow",
                   help="tensorflow: give each worker its TF_CONFIG (MultiWorkerMirroredStrategy) and "
                   "tf.keras = tf-keras when installed (default: pytorch)")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (torchrun-style manual multi-node)")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
                   help="this node's rank when --nnodes > 1")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None,
                   help="address of node rank 0 (default 127.0.0.1 on one node)")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                   help="rendezvous port on the master (default: a free one)")
    p.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0,
                   help="restart the worker group up to this many times when a worker fails")
    p.add_argument("--standalone", action="store_true",
                   help="accepted for torchrun compatibility (one node is the default)")
    p.add_argument("--ranks", default="all",
                   help="show output of these ranks only, e.g. 0 or 0,2-3 (all are still logged)")
    p.add_argument("--log-dir", default=None,
                   help="folder for this run's per-rank logs (default: a new run folder under "
                   "$DISTTRAIN_HOME/runs, printed at start)")
    p.add_argument("--env", action="append", default=[], metavar="KEY[=VALUE]",
                   help="set an environment variable for every worker (repeatable); KEY alone "
                   "passes this shell's value, so that a secret is not typed on the command line")
    p.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", default="static",
                   help="static (default: node ranks in host order) or c10d (torch's dynamic rendezvous)")
    p.add_argument("--rdzv-timeout", dest="rdzv_timeout", type=int, default=120,
                   help="seconds to wait for all nodes to join before failing (default 120)")
    p.add_argument("--hang-timeout", dest="hang_timeout", type=int, default=0, metavar="S",
                   help="stop the job, with every rank's stack, when no rank made progress for S "
                   "seconds (ranks using disttrain's runtime; default 0: off)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="where disttrain.resume() saves and finds checkpoints (DISTTRAIN_CHECKPOINT_DIR)")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="steps between checkpoints for disttrain.resume() (0: at each epoch's end)")
    p.add_argument("--grad-compression", default=None, metavar="none|fp16|bf16|powersgd[:R]",
                   help="how DDP compresses gradients for the all-reduce, for scripts using "
                   "disttrain.prepare (DISTTRAIN_GRAD_COMPRESSION; see `disttrain bench --comm`)")
    p.add_argument("--bucket-mb", default=None, metavar="MB",
                   help="DDP's gradient bucket size in MB for disttrain.prepare (default 25)")
    p.add_argument("--stop-grace", dest="stop_grace", type=int, default=15,
                   help="seconds workers get to exit after SIGTERM before SIGKILL (default 15)")
    add_host_args(p)
    p.add_argument("--sync", action="store_true",
                   help="with --hosts: first copy the working directory to the same path on every "
                   "host (changed files only; .git, caches and virtualenvs skipped)")
    p.add_argument("--no-preflight", action="store_true",
                   help="with --hosts: skip the reachability checks run before the job")
    p.add_argument("--dry-run", action="store_true", help="print the launch plan as JSON and exit")
    p.add_argument("script", metavar="SCRIPT", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...",
                   help="arguments for the script, passed verbatim")
    p.set_defaults(handler=handle)


def spec_from_args(args: argparse.Namespace) -> LaunchSpec:
    return LaunchSpec(
        entry=args.script,
        is_module=args.module,
        script_args=tuple(args.script_args),
        nproc_per_node=parse_nproc(args.nproc),
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        backend=args.dist_backend,
        max_restarts=args.max_restarts,
        ranks=parse_ranks(args.ranks),
        log_dir=args.log_dir,
        env={**comm.launch_env(args.grad_compression, args.bucket_mb, dist_backend=args.dist_backend,
                                framework=args.framework), **parse_env(args.env, os.environ)},
        rdzv_backend=args.rdzv_backend,
        rdzv_timeout_s=args.rdzv_timeout,
        stop_grace_s=args.stop_grace,
        hang_timeout_s=args.hang_timeout,
        checkpoint_dir=os.path.abspath(args.checkpoint_dir) if args.checkpoint_dir else None,
        checkpoint_every=args.checkpoint_every,
        framework=args.framework,
    )


def check_entry(spec: LaunchSpec) -> None:
    """A missing script or module is reported before any process starts."""
    if spec.is_module:
        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(spec.entry) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.pop(0)
        if not found:
            raise UsageError(f"module {spec.entry!r} not found (is it on PYTHONPATH or in {os.getcwd()}?)")
    elif not Path(spec.entry).is_file():
        raise UsageError(f"script not found: {spec.entry}")


def make_run_dir(run_dir: str, *, given: str | None) -> None:
    """Create the run folder, or say in one line why it cannot be and what to change."""
    fix = "pass a writable --log-dir" if given else "set DISTTRAIN_HOME to a writable folder (or pass --log-dir)"
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        probe = Path(run_dir) / ".write-test"
        probe.touch()
        probe.unlink()
    except OSError as err:
        why = "a file is in the way" if isinstance(err, (FileExistsError, NotADirectoryError)) else err.strerror
        raise UsageError(f"cannot write the run folder {run_dir}: {why or err}; {fix}") from None


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


def multihost_plan(args: argparse.Namespace, hosts: tuple[Host, ...]) -> LaunchPlan:
    """Ask every host for its facts over ssh, check them, and plan one node per host."""
    options = parse_ssh_options(args.ssh_option)
    spec = spec_from_args(args)
    if args.sync and not args.dry_run:
        sync_all(hosts, os.getcwd(), python=args.python, options=options)
    run_id = new_run_id(spec.entry, is_module=spec.is_module)
    plan, _ = plan_hosts(
        spec, hosts, python=args.python, options=options, cwd=os.getcwd(),
        paths=[] if spec.is_module else [spec.entry], run_id=run_id,
        run_dir=os.path.abspath(spec.log_dir or str(disttrain_home() / "runs" / run_id)),
        preflight=not args.no_preflight and not args.dry_run,
    )
    return plan


def plan_from_args(args: argparse.Namespace, hosts: tuple[Host, ...] | None) -> LaunchPlan:
    if hosts:
        return multihost_plan(args, hosts)
    if args.sync:
        raise UsageError("--sync copies the working directory to --hosts; without hosts there is nothing to copy to")
    spec = spec_from_args(args)
    check_entry(spec)
    run_id = new_run_id(spec.entry, is_module=spec.is_module)
    run_dir = spec.log_dir or str(disttrain_home() / "runs" / run_id)
    facts = local_facts(slurm_run.step_cpus(slurm_run.allocation_for(args)))
    plan = make_plan(
        spec,
        facts,
        python=sys.executable,
        master_port=choose_port(spec),
        run_id=run_id,
        run_dir=os.path.abspath(run_dir),
        inherited_env=os.environ,
    )
    hint = None if facts.cuda_devices else oversubscription_hint(nproc=plan.nodes[0].nproc, cpus=facts.cpus,
                                                                  host=facts.hostname)
    if hint:
        print(f"disttrain: note: {hint}", file=sys.stderr, flush=True)
    return plan


def handle(args: argparse.Namespace) -> int:
    slurm_run.resolve_backends(args)
    alloc = slurm_run.allocation_for(args)
    if (alloc is not None and not alloc.in_step) or (alloc is None and args.launch_backend == "slurm"):
        return slurm_run.handle(args, alloc)
    hosts = hosts_from_args(args)
    plan = plan_from_args(args, hosts)
    if args.dry_run:
        print(plan.to_json())
        return 0
    make_run_dir(plan.run_dir, given=args.log_dir)
    write_private(Path(plan.run_dir) / "plan.json", plan.to_json())
    where = ", ".join(node.host for node in plan.nodes)
    kind = "TensorFlow" if plan.framework == "tensorflow" else plan.backend
    print(
        f"disttrain: {plan.world_size} worker{'s' if plan.world_size > 1 else ''} ({kind}) "
        f"on {where}, rendezvous {plan.master_addr}:{plan.master_port}; logs: {plan.run_dir}",
        file=sys.stderr,
        flush=True,
    )
    if hosts:
        return run_hosts(
            plan, hosts, python=args.python, options=parse_ssh_options(args.ssh_option),
            cwd=os.getcwd(), env=forwarded_env(os.environ),
        )
    from ..agent.node import run_node  # imports torch's elastic agent

    return run_node(plan, plan.nodes[0])
