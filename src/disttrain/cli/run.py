"""``disttrain run``: torchrun's options with torchrun's meaning, disttrain's additions; a thin
client of :mod:`disttrain.launch`.

Parse the flags (torchrun's from the table in ``config/torchrun.py``, then their ``PET_``
variables) into a LaunchSpec, pick the launcher (``cli/launchers.py``), then the same three
lines for every launcher: ``--dry-run`` prints what it would start, else run it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from .. import torchcompat
from ..checkpoint_check import check_location
from ..checkpoint_layout import CheckpointLayout
from ..checkpoint_url import RemoteLayout, check_url, is_url
from ..config import torchrun
from ..config.launch import (
    DEFAULT_RDZV_TIMEOUT_S,
    DEFAULT_STOP_GRACE_S,
    AgentOptions,
    LaunchSpec,
    parse_env,
    parse_nproc,
    parse_ranks,
)
from ..errors import UsageError
from ..home import run_folder
from ..launch import BatchLauncher, LaunchContext, Launcher, RunFolderEvents
from ..launch.local import LocalLauncher
from ..launch.slurm_env import SlurmAllocation
from ..private import private_dirs
from ..runtime import comm
from ..tracking import TRACKERS, check_tracker, script_params, sink_class
from ..tracking.follower import RunTracker
from ..wire import RunSpec
from ..workerenv import ACCELERATE_USE_CPU, cpu_library_warning
from . import launchers
from .common import add_host_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run a training script on N processes",
        description="Run SCRIPT (or -m MODULE) as a data-parallel job. Everything after the "
        "script is passed to it verbatim. Every torchrun option is accepted with torchrun's meaning "
        "(and from its PET_<NAME> variable), so `torchrun ARGS` becomes `disttrain run ARGS`; "
        "see docs/torchrun.md.",
    )
    _add_torchrun_args(p)
    p.add_argument("--framework", default="pytorch", metavar="pytorch|tensorflow",
                   help="tensorflow: give each worker its TF_CONFIG (MultiWorkerMirroredStrategy) and "
                   "tf.keras = tf-keras when installed (default: pytorch)")
    p.add_argument("--ranks", default="all",
                   help="show output of these (global) ranks only, e.g. 0 or 0,2-3 (all are still logged)")
    p.add_argument("--env", action="append", default=[], metavar="KEY[=VALUE]",
                   help="set an environment variable for every worker (repeatable); KEY alone passes this "
                   "shell's value, so that a secret is not typed on the command line; values are never "
                   "printed or written to the run folder")
    p.add_argument("--no-forward-env", dest="forward_env", action="store_false",
                   help="with --hosts: do not send this shell's exported variables to the other hosts "
                   "(only NCCL_*, GLOO_*, TORCH_*, PYTHONPATH, OMP_NUM_THREADS, LOGLEVEL and --env)")
    p.add_argument("--rdzv-timeout", dest="rdzv_timeout", type=int, default=DEFAULT_RDZV_TIMEOUT_S,
                   help=f"seconds to wait for all nodes to join before failing (default {DEFAULT_RDZV_TIMEOUT_S})")
    p.add_argument("--hang-timeout", dest="hang_timeout", type=int, default=0, metavar="S",
                   help="stop the job, with every rank's stack, when no rank made progress for S "
                   "seconds (ranks using disttrain's runtime; default 0: off)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="where disttrain.resume() saves and finds checkpoints (DISTTRAIN_CHECKPOINT_DIR): a "
                   "folder, or an fsspec URL such as s3://bucket/run (credentials from the AWS chain)")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="steps between checkpoints for disttrain.resume() (0: at each epoch's end)")
    p.add_argument("--checkpoint-retry-s", dest="checkpoint_retry_s", type=float, default=None, metavar="S",
                   help="seconds a checkpoint store may stay unreachable (refused or reset connections, "
                   "throttling, 5xx) while saves retry before one fails (default 120; 0: no retry)")
    p.add_argument("--create-bucket", action="store_true",
                   help="create --checkpoint-dir's bucket when it does not exist (never done otherwise: a "
                   "typo would make a new bucket)")
    p.add_argument("--grad-compression", default=None,
                   metavar="none|fp16|bf16|powersgd[:R]|localsgd[:H]|diloco[:H]",
                   help="how DDP communicates, for scripts using disttrain.prepare: a gradient compression, "
                   "or local SGD / DiLoCo synchronising every H steps (DISTTRAIN_GRAD_COMPRESSION; "
                   "see `disttrain bench --comm`)")
    p.add_argument("--bucket-mb", default=None, metavar="MB",
                   help="DDP's gradient bucket size in MB for disttrain.prepare (default 25)")
    add_track_args(p)
    p.add_argument("--stop-grace", dest="stop_grace", type=int, default=None,
                   help=f"seconds workers get to exit after SIGTERM before SIGKILL (default {DEFAULT_STOP_GRACE_S}; "
                   "torchrun's --shutdown-timeout)")
    _add_where_args(p)
    p.add_argument("script", metavar="SCRIPT", help="training script (or module with -m, program with --no-python)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...",
                   help="arguments for the script, passed verbatim")
    p.set_defaults(handler=handle)

    # `disttrain bench`'s counts: the launch spec on stdin (disttrain.wire.RunSpec: its --env values
    # never on a command line); the flags say only where it runs.
    shipped = sub.add_parser("run-spec")
    _add_where_args(shipped)
    shipped.set_defaults(handler=handle_spec)


def add_track_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--track", default=None, metavar="|".join(TRACKERS),
                   help="send the run to this tracker, configured its own way (MLFLOW_TRACKING_URI, WANDB_MODE, "
                   "TRACKIO_DIR...): parameters, disttrain.log() metrics, membership, hang verdict, exit, goodput "
                   "(pip install 'disttrain[track]'; see docs/tracking.md)")
    p.add_argument("--track-ranks", action="store_true",
                   help="with --track: each rank's own disttrain.log() values too (rankN/NAME), beside the mean")


def _add_torchrun_args(p: argparse.ArgumentParser) -> None:
    """torchrun's options from the table (config/torchrun.py), every spelling; default None, so
    that what was not given is then looked up in PET_<NAME> (:func:`torchrun_values`)."""
    g = p.add_argument_group("torchrun's options", "each also read from PET_<NAME> (PET_NPROC_PER_NODE=2), "
                             "the command line winning")
    for option in torchrun.OPTIONS:
        flags = ("-n", *option.flags) if option.dest == "nproc_per_node" else option.flags
        text = option.meaning + (f"; {option.here}" if option.here else "")
        if option.dest == "print_completion":  # acts while parsing, as torchrun's does: no script needed
            g.add_argument(*flags, dest=option.dest, action=_PrintCompletion, default=None, help=text,
                           metavar="|".join(option.choices))
        elif option.flag:
            g.add_argument(*flags, dest=option.dest, action="store_const", const=True, default=None, help=text)
        else:
            # choices are checked by the spec (cli/main.py's one-line errors read argparse's "invalid
            # choice" as an unknown subcommand)
            g.add_argument(*flags, dest=option.dest, default=None, type=option.convert,
                           metavar=option.metavar or "|".join(option.choices or ()) or None, help=text)


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


class _PrintCompletion(argparse.Action):
    """``--print-completion SHELL``: disttrain's completion script for SHELL (shtab), then exit 0."""

    def __call__(self, parser, namespace, values, option_string=None):
        torchcompat.refuse_missing_options({self.dest: values})
        if values not in torchrun.COMPLETION_SHELLS:
            raise UsageError(f"{option_string} takes one of {', '.join(torchrun.COMPLETION_SHELLS)}, got {values!r}")
        try:
            import shtab
        except ImportError:
            raise UsageError(f"{option_string} needs the shtab package: pip install shtab") from None
        print(shtab.complete(getattr(parser, "root", parser), shell=values))
        parser.exit(0)


# What each torchrun option is when neither the command line nor PET_<NAME> gives it.
_DEFAULTS = {"nnodes": "1", "nproc_per_node": "auto", "standalone": False, "max_restarts": 0, "module": False,
             "no_python": False, "run_path": False, "node_rank": 0, "virtual_local_rank": False,
             "redirects": "0", "tee": "0", "local_ranks_filter": "", "duplicate_stdout_filters": [],
             "duplicate_stderr_filters": [], "rdzv_conf": "", "monitor_interval": 0.1, "start_method": "spawn",
             "event_log_handler": "null", "role": "default", "signals_to_handle": torchrun.DEFAULT_SIGNALS}


def torchrun_values(args: argparse.Namespace, environ: Mapping[str, str]) -> dict:
    """Every torchrun option's value: the command line, else its PET_ variable, else the default.
    An option the installed torch does not have yet, given either way, is one line (exit 2)."""
    given = {}
    for option in torchrun.OPTIONS:
        value = getattr(args, option.dest)
        given[option.dest] = torchrun.from_environ(option.dest, environ) if value is None else value
    torchcompat.refuse_missing_options(given)
    return {dest: _DEFAULTS.get(dest) if value is None else value for dest, value in given.items()}


def _stop_grace(args: argparse.Namespace, values: dict, environ: Mapping[str, str]) -> int:
    """--stop-grace and torchrun's --shutdown-timeout are one setting; torchrun's variable counts too."""
    given = {flag: v for flag, v in (("--stop-grace", args.stop_grace), ("--shutdown-timeout", values["shutdown_timeout"]))
             if v is not None}
    if len(set(given.values())) > 1:
        raise UsageError(f"--stop-grace {given['--stop-grace']} and --shutdown-timeout {given['--shutdown-timeout']} "
                         "are the same setting: give one")
    if given:
        return next(iter(given.values()))
    raw = environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if raw:
        try:
            return int(raw)
        except ValueError:
            raise UsageError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={raw!r} is not a number of seconds") from None
    return DEFAULT_STOP_GRACE_S


def resolve_args(args: argparse.Namespace, environ: Mapping[str, str]) -> list[str]:
    """Turn torchrun's options (command line, PET_) into the values the spec and the launcher
    read, on ``args``; returns the lines to say (what was ignored or assumed)."""
    nnodes_given = getattr(args, "nnodes", None) is not None or torchrun.from_environ("nnodes", environ) is not None
    values = torchrun_values(args, environ)
    low, high = torchrun.parse_nnodes(values["nnodes"])
    hosts = bool(getattr(args, "hosts", None) or getattr(args, "hostfile", None))
    notes: list[str] = []
    args.slurm_nnodes = None
    if not hosts and nnodes_given and low == high and _slurm_places(args, environ):
        # On Slurm, torchrun's --nnodes N is the number of nodes, as --nodes N (Slurm's word) is:
        # the launcher asks Slurm for them (or takes the allocation's first N) and places each.
        args.slurm_nnodes, low, high = high, 1, 1
    if hosts:  # --hosts numbers and addresses its nodes itself, one per host
        for dest, flag, default in (("node_rank", "--node-rank", 0), ("local_addr", "--local-addr", None),
                                    ("standalone", "--standalone", False)):
            if values[dest] != default:
                notes.append(f"{flag} is for a node started by hand; --hosts places every node itself: ignored")
                values[dest] = default
        if low == high and high != 1:
            notes.append(f"--nnodes {high} is for nodes started by hand; --hosts runs one node per host: ignored")
            low = high = 1
    rdzv = torchrun.resolve_rendezvous(
        rdzv_backend=values["rdzv_backend"], endpoint=values["rdzv_endpoint"], master_addr=values["master_addr"],
        master_port=values["master_port"], nnodes=(low, high), node_rank=values["node_rank"],
        standalone=values["standalone"], placed=hosts or _slurm_places(args, environ))
    notes += rdzv.notes
    # torch would read these only once the agent starts: a bad value is exit 1 after the start, an
    # ignored key or a filter that shows nobody says nothing at all
    notes += torchrun.check_rdzv_conf(torchrun.parse_rdzv_conf(values["rdzv_conf"]), rdzv.rdzv_backend)
    if str(values["nproc_per_node"]).isdigit():
        shown = torchrun.local_ranks_note(torchrun.parse_local_ranks(values["local_ranks_filter"]),
                                          int(values["nproc_per_node"]))
        notes += [shown] if shown else []
    if values["standalone"]:
        values["rdzv_id"] = None
    args.torchrun = values
    args.nnodes, args.min_nnodes = high, low
    args.node_rank = values["node_rank"] if rdzv.rdzv_backend == "static" else 0
    args.rdzv_backend, args.master_addr, args.master_port = rdzv.rdzv_backend, rdzv.master_addr, rdzv.master_port
    args.stop_grace_s = _stop_grace(args, values, environ)
    return notes


def _slurm_places(args: argparse.Namespace, environ: Mapping[str, str]) -> bool:
    """Slurm's launcher places every node (sbatch, or the nodes of the allocation we run in)."""
    launcher = getattr(args, "launcher", None) or (getattr(args, "backend", None) if getattr(
        args, "backend", None) in launchers.LAUNCHERS else None)  # --backend slurm: --launcher's old name
    if launcher is not None:
        return launcher == "slurm"
    alloc = SlurmAllocation.from_environ(environ)
    return alloc is not None and not alloc.in_job_step


def agent_options(values: dict, log_dir: str | None) -> AgentOptions:
    return AgentOptions(
        role=values["role"], monitor_interval_s=float(values["monitor_interval"]),
        start_method=values["start_method"], event_log_handler=values["event_log_handler"],
        redirects=torchrun.check_std(values["redirects"], where="--redirects"),
        tee=torchrun.check_std(values["tee"], where="--tee"),
        local_ranks_filter=torchrun.parse_local_ranks(values["local_ranks_filter"]),
        duplicate_stdout_filters=tuple(f for f in values["duplicate_stdout_filters"] if f),
        duplicate_stderr_filters=tuple(f for f in values["duplicate_stderr_filters"] if f),
        logs_specs=values["logs_specs"] and torchrun.check_logs_specs(values["logs_specs"]),
        numa_binding=values["numa_binding"],
        signals_to_handle=torchrun.check_signals(values["signals_to_handle"]),
        virtual_local_rank=bool(values["virtual_local_rank"]),
        log_line_prefix_template=values["log_line_prefix_template"] or None,
        torchrun_log_dir=os.path.abspath(log_dir) if log_dir else None,
    )


def spec_from_args(args: argparse.Namespace) -> LaunchSpec:
    """``args`` after :func:`resolve_args`."""
    values = args.torchrun
    nproc = values["nproc_per_node"]
    if str(nproc) == "xpu":
        raise UsageError("--nproc-per-node xpu: disttrain starts no XPU workers; give a number")
    return LaunchSpec(
        entry=args.script,
        is_module=bool(values["module"]),
        script_args=tuple(args.script_args),
        nproc_per_node=parse_nproc(str(nproc)),
        nnodes=args.nnodes,
        min_nnodes=args.min_nnodes if args.min_nnodes != args.nnodes else None,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        dist_backend=args.dist_backend,
        max_restarts=values["max_restarts"],
        ranks=parse_ranks(args.ranks),
        log_dir=values["log_dir"],
        env=parse_env(args.env, os.environ),
        rdzv_backend=args.rdzv_backend,
        rdzv_timeout_s=args.rdzv_timeout,
        rdzv_id=values["rdzv_id"],
        rdzv_conf=torchrun.parse_rdzv_conf(values["rdzv_conf"]),
        local_addr=values["local_addr"],
        no_python=bool(values["no_python"]),
        run_path=bool(values["run_path"]),
        stop_grace_s=args.stop_grace_s,
        hang_timeout_s=args.hang_timeout,
        checkpoint_dir=_checkpoint_dir(args.checkpoint_dir),
        checkpoint_every=args.checkpoint_every,
        checkpoint_retry_s=args.checkpoint_retry_s,
        framework=args.framework,
        forward_env=args.forward_env,
        agent=agent_options(values, values["log_dir"]),
        track=track_mode(args),
        **comm_settings(args),
    )


def _checkpoint_dir(value: str | None) -> str | None:
    """An absolute local folder (workers on other hosts start elsewhere), or a URL as it is."""
    if not value:
        return None
    return check_url(value) if is_url(value) else os.path.abspath(value)


def track_mode(args: argparse.Namespace) -> str | None:
    """--track/--track-ranks as the workers' DISTTRAIN_TRACK (the tracker checked now, before anything starts)."""
    tracker = check_tracker(getattr(args, "track", None))
    if tracker is None:
        if getattr(args, "track_ranks", False):
            raise UsageError("--track-ranks needs --track mlflow|trackio|wandb")
        return None
    sink_class(tracker)  # its client installed, its own settings possible: said now, in one line
    return "ranks" if args.track_ranks else "reduced"


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
        private_dirs(run_dir)  # 0700 when new: rank logs may hold what a script printed
        probe = Path(run_dir) / ".write-test"
        probe.touch()
        probe.unlink()
    except OSError as err:
        why = "a file is in the way" if isinstance(err, (FileExistsError, NotADirectoryError)) else err.strerror
        raise UsageError(f"cannot write the run folder {run_dir}: {why or err}; {fix}") from None


class RunEvents(RunFolderEvents):
    """What ``disttrain run`` tells its user besides the agents' output."""

    def __init__(self, *, no_wait: bool = False, log_dir: str | None = None, script: Path | None = None,
                 tracker: RunTracker | None = None, nodes: int = 1) -> None:
        self.no_wait = no_wait
        self.nodes = nodes  # a batch job's nodes (an agent launcher's are its plan's)
        self.tracker = tracker  # the run's records (goodput) and its tracker: fed what the launch relays
        if tracker is not None:
            self.transcript = tracker.tap(None)
        self.log_dir = log_dir  # as given (--log-dir), for the fix in the error line
        self.script = script  # a Python script's path, read for what the workers' variables cannot fix

    def starting(self, plan, facts, note: str = "") -> None:
        make_run_dir(plan.run_dir, given=self.log_dir)
        if self.tracker is not None:
            self.tracker.starting(len(plan.nodes))
        super().starting(plan, facts, note)
        if self.script is not None and any(ACCELERATE_USE_CPU in node.env for node in plan.nodes):
            try:
                warning = cpu_library_warning(self.script.read_text(errors="replace"), self.script.name)
            except OSError:  # on another host only: its agent runs it
                warning = None
            if warning:
                self.say(f"disttrain: warning: {warning}")

    def submitted(self, job_id: str, run_dir: str) -> None:
        if self.tracker is not None:
            self.tracker.starting(self.nodes)
        if self.no_wait:
            print(job_id, flush=True)
            self.say(f"disttrain: submitted Slurm job {job_id}; output: {run_dir}/slurm.out, {run_dir}/slurm.err; "
                     f"stop it with scancel {job_id}")
        else:
            self.say(f"disttrain: submitted Slurm job {job_id}; logs: {run_dir}; Ctrl-C cancels it")


def handle(args: argparse.Namespace) -> int:
    notes = resolve_args(args, os.environ)
    spec = spec_from_args(args)
    launcher = launchers.launcher_from_args(args)
    if spec.checkpoint_dir and not args.dry_run:  # a mistake told now, not at the first checkpoint
        check_location(spec.checkpoint_dir, create_bucket=args.create_bucket,
                       here=isinstance(launcher, LocalLauncher))
    elif args.create_bucket and not spec.checkpoint_dir:
        raise UsageError("--create-bucket makes --checkpoint-dir's bucket: give --checkpoint-dir s3://BUCKET/...")
    for note in notes:
        print(f"disttrain: note: {note}", file=sys.stderr, flush=True)
    before = checkpoints_in(spec.checkpoint_dir)
    code = launch(spec, launcher, args)
    if code == 0 and not args.dry_run and not isinstance(launcher, BatchLauncher):
        note = unwritten_note(spec, before, checkpoints_in(spec.checkpoint_dir), script_text(spec))
        if note:
            print(f"disttrain: note: {note}", file=sys.stderr, flush=True)
    return code


def checkpoints_in(location: str | None) -> set[int] | None:
    """The complete checkpoints' steps at ``location`` (None: no location, or it cannot be read now)."""
    if not location:
        return None
    try:
        layout = RemoteLayout.at(location, retry_s=0) if is_url(location) else CheckpointLayout(Path(location))
        return {step for step, _ in layout.complete()}
    except (OSError, UsageError):
        return None


def script_text(spec: LaunchSpec) -> str | None:
    if spec.is_module or spec.no_python:
        return None
    try:
        return Path(spec.entry).read_text(errors="replace")
    except OSError:
        return None


def unwritten_note(spec: LaunchSpec, before: set[int] | None, after: set[int] | None, script: str | None) -> str | None:
    """The note for a run given --checkpoint-dir that ended without writing a checkpoint there, with the
    likeliest reason; None when one was written (or the folder cannot be read to tell)."""
    if after is None or (after - (before or set())):
        return None
    return _none_written(spec, script)


def _none_written(spec: LaunchSpec, script: str | None) -> str:
    where = f"--checkpoint-dir {spec.checkpoint_dir}: no checkpoint was written"
    if script is not None and not any(call in script for call in ("resume(", "Trainer", "checkpoint.save(")):
        return (f"{where}; the script never calls disttrain.resume() or the Trainer, which are what save "
                "there (or pass the folder to disttrain.checkpoint.save)")
    every = spec.checkpoint_every
    when = f"every {every} steps" if every else "at each epoch's end"
    return f"{where}; the run ended before its first checkpoint ({when}: see --checkpoint-every)"


def handle_spec(args: argparse.Namespace) -> int:
    spec = RunSpec.from_line(sys.stdin.read()).spec
    args.nnodes, args.node_rank = spec.nnodes, spec.node_rank  # what the launcher checks of the spec
    return launch(spec, launchers.launcher_from_args(args), args)


def _entry_paths(spec: LaunchSpec) -> tuple[str, ...]:
    """Files every node must have: the script; not a module, nor a program looked up on PATH."""
    if spec.is_module or (spec.no_python and "/" not in spec.entry):
        return ()
    return (spec.entry,)


def launch(spec: LaunchSpec, launcher: Launcher, args: argparse.Namespace) -> int:
    """The same lines for every launcher: ``--dry-run`` prints what it would start, else run it."""
    run_id, run_dir = run_folder(spec.entry, spec.log_dir, is_module=spec.is_module)
    # torchrun's PYTHON_EXEC: the workers' interpreter, when --python does not say otherwise
    python = os.environ.get("PYTHON_EXEC") if args.python == sys.executable and os.environ.get("PYTHON_EXEC") \
        else args.python
    ctx = LaunchContext(run_id=run_id, run_dir=run_dir, cwd=os.getcwd(), python=python,
                        paths=_entry_paths(spec),
                        preflight=not args.no_preflight and not args.dry_run, environ=dict(os.environ))
    if args.dry_run:
        print(launcher.dry_run(spec, ctx).text(), end="")
        return 0
    script = None if spec.is_module or spec.no_python else Path(ctx.cwd) / spec.entry
    # A batch job's records are made inside its allocation (its launch there is a run of its own);
    # its tracker, when asked, follows it from here.
    batch = isinstance(launcher, BatchLauncher)
    tracker = None if batch and not getattr(args, "track", None) else RunTracker(
        run_dir, tracker=getattr(args, "track", None), name=run_id,
        params={**script_params(sys.argv, spec.script_args), "nproc_per_node": str(spec.nproc_per_node),
                "nnodes": str(spec.nnodes)})
    if tracker is not None and isinstance(launcher, LocalLauncher):
        tracker.follow_files()
    events = RunEvents(no_wait=args.no_wait, log_dir=spec.log_dir, script=script, tracker=tracker,
                       nodes=getattr(launcher, "nodes", 1))
    try:
        outcome = launcher.run(spec, ctx, events)
    except BaseException as err:  # the run ends here too: its records and its tracker run say how
        if tracker is not None:
            code = getattr(err, "exit_code", None) or (130 if isinstance(err, KeyboardInterrupt) else 1)
            tracker.finish(code, report=str(err) or type(err).__name__)
        raise
    if tracker is not None:
        tracker.finish(outcome.exit_code, report=outcome.report)
    if outcome.signal:
        print(f"disttrain: got {signal.Signals(outcome.signal).name}, stopped all nodes", file=sys.stderr, flush=True)
    return outcome.exit_code
