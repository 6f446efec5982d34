"""``disttrain run``: torchrun's flags, disttrain's defaults; a thin client of :mod:`disttrain.launch`.

Parse the flags into a LaunchSpec, pick the launcher (``cli/launchers.py``), then the same
three lines for every launcher: ``--dry-run`` prints what it would start, else run it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from ..config.launch import (
    DEFAULT_RDZV_TIMEOUT_S,
    DEFAULT_STOP_GRACE_S,
    LaunchSpec,
    parse_env,
    parse_nproc,
    parse_ranks,
)
from ..errors import UsageError
from ..home import run_folder
from ..launch import Context, Launcher, RunFolderEvents
from ..runtime import comm
from ..wire import RunSpec
from . import launchers
from .common import add_host_args


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
                   help="set an environment variable for every worker (repeatable); KEY alone passes this "
                   "shell's value, so that a secret is not typed on the command line; values are never "
                   "printed or written to the run folder")
    p.add_argument("--no-forward-env", dest="forward_env", action="store_false",
                   help="with --hosts: do not send this shell's exported variables to the other hosts "
                   "(only NCCL_*, GLOO_*, TORCH_*, PYTHONPATH, OMP_NUM_THREADS, LOGLEVEL and --env)")
    p.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", default="static",
                   help="static (default: node ranks in host order) or c10d (torch's dynamic rendezvous)")
    p.add_argument("--rdzv-timeout", dest="rdzv_timeout", type=int, default=DEFAULT_RDZV_TIMEOUT_S,
                   help=f"seconds to wait for all nodes to join before failing (default {DEFAULT_RDZV_TIMEOUT_S})")
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
    p.add_argument("--stop-grace", dest="stop_grace", type=int, default=DEFAULT_STOP_GRACE_S,
                   help=f"seconds workers get to exit after SIGTERM before SIGKILL (default {DEFAULT_STOP_GRACE_S})")
    _add_where_args(p)
    p.add_argument("script", metavar="SCRIPT", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...",
                   help="arguments for the script, passed verbatim")
    p.set_defaults(handler=handle)

    # `disttrain bench`'s counts: the launch spec on stdin (disttrain.wire.RunSpec: its --env values
    # never on a command line); the flags say only where it runs.
    shipped = sub.add_parser("run-spec")
    _add_where_args(shipped)
    shipped.set_defaults(handler=handle_spec)


def _add_where_args(p: argparse.ArgumentParser) -> None:
    """Where a spec runs, as opposed to what it runs: the launcher and its hosts."""
    launchers.add_args(p)  # --launcher (local, ssh, slurm), --dist-backend and the Slurm flags
    add_host_args(p)
    p.add_argument("--sync", action="store_true",
                   help="with --hosts: first copy the working directory to the same path on every "
                   "host (changed files only; .git, caches and virtualenvs skipped)")
    p.add_argument("--no-preflight", action="store_true",
                   help="with --hosts: skip the reachability checks run before the job")
    p.add_argument("--dry-run", action="store_true", help="print the launch plan as JSON and exit")


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
        env=parse_env(args.env, os.environ),
        rdzv_backend=args.rdzv_backend,
        rdzv_timeout_s=args.rdzv_timeout,
        stop_grace_s=args.stop_grace,
        hang_timeout_s=args.hang_timeout,
        checkpoint_dir=os.path.abspath(args.checkpoint_dir) if args.checkpoint_dir else None,
        checkpoint_every=args.checkpoint_every,
        framework=args.framework,
        forward_env=args.forward_env,
        **comm_settings(args),
    )


def comm_settings(args: argparse.Namespace) -> dict:
    """--grad-compression/--bucket-mb, checked before anything starts (runtime.comm knows the rules)."""
    comm.check_launch_settings(args.grad_compression, args.bucket_mb, dist_backend=args.dist_backend,
                               framework=args.framework)
    return {"grad_compression": args.grad_compression or None,
            "bucket_mb": comm.parse_bucket_mb(args.bucket_mb, flag="--bucket-mb")}


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


class RunEvents(RunFolderEvents):
    """What ``disttrain run`` tells its user besides the agents' output."""

    def __init__(self, *, no_wait: bool = False, log_dir: str | None = None) -> None:
        self.no_wait = no_wait
        self.log_dir = log_dir  # as given (--log-dir), for the fix in the error line

    def starting(self, plan, facts, note: str = "") -> None:
        make_run_dir(plan.run_dir, given=self.log_dir)
        super().starting(plan, facts, note)

    def submitted(self, job_id: str, run_dir: str) -> None:
        if self.no_wait:
            print(job_id, flush=True)
            self.say(f"disttrain: submitted Slurm job {job_id}; output: {run_dir}/slurm.out, {run_dir}/slurm.err; "
                     f"stop it with scancel {job_id}")
        else:
            self.say(f"disttrain: submitted Slurm job {job_id}; logs: {run_dir}; Ctrl-C cancels it")


def handle(args: argparse.Namespace) -> int:
    launcher = launchers.launcher_from_args(args)
    return launch(spec_from_args(args), launcher, args)


def handle_spec(args: argparse.Namespace) -> int:
    spec = RunSpec.from_line(sys.stdin.read()).spec
    args.nnodes, args.node_rank = spec.nnodes, spec.node_rank  # what the launcher checks of the spec
    return launch(spec, launchers.launcher_from_args(args), args)


def launch(spec: LaunchSpec, launcher: Launcher, args: argparse.Namespace) -> int:
    """The same lines for every launcher: ``--dry-run`` prints what it would start, else run it."""
    run_id, run_dir = run_folder(spec.entry, spec.log_dir, is_module=spec.is_module)
    ctx = Context(run_id=run_id, run_dir=run_dir, cwd=os.getcwd(), python=args.python,
                  paths=() if spec.is_module else (spec.entry,),
                  preflight=not args.no_preflight and not args.dry_run, environ=dict(os.environ))
    if args.dry_run:
        print(launcher.dry_run(spec, ctx).text(), end="")
        return 0
    outcome = launcher.run(spec, ctx, RunEvents(no_wait=args.no_wait, log_dir=spec.log_dir))
    if outcome.signal:
        print(f"disttrain: got {signal.Signals(outcome.signal).name}, stopped all nodes", file=sys.stderr, flush=True)
    return outcome.exit_code
