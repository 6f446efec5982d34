"""``disttrain bench``: the seed chapter's 1/2/4-process timing, as one command.

    disttrain bench train.py -n 1,2,4 [--global-batch 128] [--steps 20] [-- script args]

Each count runs as ``disttrain run`` would (the launch spec shipped as JSON, see
:mod:`disttrain.scaling.runner`) with the global batch kept constant (the script's
per-process batch flag gets ``global batch / processes``, as the chapter halved it by
hand), the steady-state samples/s are read from the runtime's step timer, and the table
says which count to use here and why.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from ..config.launch import LaunchSpec, parse_env
from ..errors import UsageError
from ..plotfile import plot_path
from ..runtime.comm import parse_compression
from ..scaling import comm, plot, report
from ..scaling.bench import (
    BenchSpec,
    busy_before,
    context_notes,
    headline,
    json_context,
    machine_facts,
    parse_counts,
    run_all,
)
from ..tracking import TRACKERS, Sink, check_tracker, script_params
from ..tracking.sink import open_or_say
from .common import add_host_args, hosts_from_args

DEFAULT_COUNTS = "1,2,4"
DEFAULT_REPEAT = 2


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="time a training script with several process counts; recommend one",
        usage="disttrain bench [options] SCRIPT [options] [-- script args]",
        description="Run SCRIPT under each process count of -n (one `disttrain run` each, --repeat "
        "times, the counts interleaved), keeping the global batch constant by passing --global-batch / "
        "processes to the script's per-process batch flag. Prints samples/s, speed-up and parallel "
        "efficiency per count and the count to use on this machine, and flags numbers that are the "
        "machine's noise. Options may come before or after SCRIPT; the script's own arguments go "
        "after `--`.",
    )
    _add_options(p, lambda value: value)
    # One REMAINDER for the script and what follows: with a positional of its own for the
    # script, argparse would swallow a `--` right after it, and `train.py -- --lr 1` could
    # not be told from `train.py --lr 1`.
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="SCRIPT [options] [-- script args]",
                   help="the training script (or module with -m), more bench options, then `--` "
                   "and the script's own arguments")
    # The same options once more, for those written after SCRIPT; unset ones stay unset.
    trailing = type(p)(prog=p.prog, add_help=False)
    _add_options(trailing, lambda value: argparse.SUPPRESS)
    p.set_defaults(handler=handle, trailing_parser=trailing)


def _add_options(p: argparse.ArgumentParser, default) -> None:
    p.add_argument("-n", "--nproc", default=default(DEFAULT_COUNTS), metavar="LIST",
                   help=f"process counts per host to try, e.g. 1,2,4 (default {DEFAULT_COUNTS})")
    p.add_argument("--global-batch", type=int, default=default(128), metavar="N",
                   help="samples per step over all processes, the same for every count (default 128)")
    p.add_argument("--batch-arg", default=default("--batch-size"), metavar="FLAG",
                   help="the script's per-process batch flag, written --batch-arg=--per-gpu-batch "
                   "(default --batch-size)")
    p.add_argument("--steps", type=int, default=default(20), metavar="N",
                   help="training steps to time per count, after the warm-up (default 20)")
    p.add_argument("--warmup", type=int, default=default(5), metavar="N",
                   help="untimed steps first (default 5)")
    p.add_argument("--repeat", type=int, default=default(DEFAULT_REPEAT), metavar="R",
                   help="runs of each count, the counts interleaved (1,2,4,4,2,1...); the best run counts, "
                   f"and runs far apart are flagged as noise (default {DEFAULT_REPEAT})")
    p.add_argument("--timeout", type=float, default=default(600.0), metavar="S",
                   help="seconds one count may take before it is stopped (default 600)")
    p.add_argument("--json", action="store_true", default=default(False),
                   help="print the results as JSON instead of the table")
    p.add_argument("--plot", metavar="PNG", default=default(None),
                   help="also draw speed-up against the ideal line (needs disttrain[plot])")
    p.add_argument("--dry-run", action="store_true", default=default(False),
                   help="print every count's command and launch spec (--env values left out) and exit")
    p.add_argument("--comm", action="store_true", default=default(False),
                   help="also split each multi-process step into compute and communication (a run "
                   "without gradient sync), run gradient compressions, local SGD and DiLoCo to the script's "
                   "end (throughput and validation accuracy), and say which mode to use")
    p.add_argument("--comm-modes", default=default(None), metavar="LIST",
                   help="with --comm: the modes to try beside plain DDP, e.g. powersgd,localsgd:8 "
                   f"(default {','.join(comm.TRIED)})")
    p.add_argument("--link-gbit", type=float, default=default(None), metavar="G",
                   help="with --comm: the link's rate in Gbit/s, to compare with the all-reduce bound")
    p.add_argument("-m", "--module", action="store_true", default=default(False),
                   help="treat SCRIPT as a Python module, like `python -m`")
    # Passed through to every `disttrain run`.
    p.add_argument("--dist-backend", dest="dist_backend", default=default(None),
                   help="process-group backend (gloo, nccl), as for run")
    p.add_argument("--master-port", type=int, default=default(None), help="as for run")
    p.add_argument("--env", action="append", default=default([]), metavar="KEY=VALUE",
                   help="an environment variable for every worker (repeatable), as for run")
    add_host_args(p)
    if default(None) is argparse.SUPPRESS:
        for action in p._actions:  # add_host_args sets its own defaults
            action.default = argparse.SUPPRESS
    p.add_argument("--track", default=default(None), metavar="|".join(TRACKERS),
                   help="send the bench to this tracker as one run (configured its own way, as for run): "
                   "samples/s, speed-up and efficiency at each world size, the table and the plot")
    p.add_argument("--sync", action="store_true", default=default(False),
                   help="with --hosts: copy the working directory to every host first, as for run")
    p.add_argument("--no-preflight", action="store_true", default=default(False),
                   help="with --hosts: skip run's reachability checks")


def finish_parsing(args: argparse.Namespace) -> argparse.Namespace:
    """Options written after SCRIPT, and the script's arguments after ``--``."""
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command or command[0].startswith("-"):
        raise UsageError("disttrain bench: name the training script (see disttrain bench --help)")
    args.script, rest = command[0], command[1:]
    split = rest.index("--") if "--" in rest else len(rest)
    options, args.script_args = rest[:split], rest[split + 1:]
    try:
        args.trailing_parser.parse_args(options, namespace=args)
    except UsageError as err:
        message = str(err)
        if "unrecognized arguments" in message:
            hint = "; the script's own arguments go after `--`"
            at = message.rfind(" (see ")
            raise UsageError(message[:at] + hint + message[at:] if at > 0 else message + hint) from None
        raise
    return args


def spec_from_args(args: argparse.Namespace) -> BenchSpec:
    hosts = hosts_from_args(args)
    launch = LaunchSpec(entry=args.script, is_module=args.module, script_args=tuple(args.script_args),
                        dist_backend=args.dist_backend, master_port=args.master_port,
                        env=parse_env(args.env, os.environ))
    where: list[str] = []  # the launcher's flags; everything else travels in the spec
    if args.hosts:
        where += ["--hosts", args.hosts]
    if args.hostfile:
        where += ["--hostfile", args.hostfile]
    for option in args.ssh_option:
        where += ["--ssh-option", option]
    if args.python != sys.executable:
        where += ["--python", args.python]
    if args.sync:
        where.append("--sync")
    if args.no_preflight:
        where.append("--no-preflight")
    spec = BenchSpec(
        launch=launch, where=tuple(where), counts=parse_counts(args.nproc), hosts=tuple(h.name for h in hosts or ()),
        global_batch=args.global_batch, batch_arg=args.batch_arg, steps=args.steps,
        warmup=args.warmup, timeout_s=args.timeout, repeat=args.repeat,
    )
    if not spec.hosts and not launch.is_module and Path(spec.script).is_dir():
        raise UsageError(f"{spec.script} is a directory, not a script: name the .py file to run in it")
    if not spec.hosts and not launch.is_module and not Path(spec.script).is_file():
        raise UsageError(f"script not found: {spec.script}")
    return spec


def handle(args: argparse.Namespace) -> int:
    args = finish_parsing(args)
    spec = spec_from_args(args)
    args.comm_modes = comm_modes(args.comm_modes, asked=args.comm)
    if args.plot:
        plot.require_matplotlib()
        plot_path(args.plot)  # a place that cannot take it fails now, not after the measuring
    if args.dry_run:  # each count's command and spec (its --env by name only, as run --dry-run)
        counts = [{"command": spec.command(), "spec": json.loads(spec.count(n).public_json())} for n in spec.counts]
        if args.json:
            print(json.dumps(counts))
        else:
            print("\n".join(f"{shlex.join(c['command'])} <<< {json.dumps(c['spec'])}" for c in counts))
        return 0
    tracked = open_or_say(args.track, f"bench-{Path(spec.script).stem}", params={
        **script_params(sys.argv, spec.launch.script_args), "counts": args.nproc,
        "global_batch": str(spec.global_batch), "steps": str(spec.steps)},
        say=lambda line: print(line, file=sys.stderr, flush=True)) if check_tracker(args.track) else None
    try:
        code = _measure(args, spec, tracked)
    except BaseException:
        if tracked is not None:
            tracked.finish(1)
        raise
    if tracked is not None:
        tracked.finish(code)
    return code


def comm_modes(raw: str | None, *, asked: bool) -> tuple[str, ...]:
    """``--comm-modes``: the modes ``bench --comm`` tries beside plain DDP, each a ``--grad-compression``
    value (checked, in its lower-case spelling, once each; ``none`` is plain DDP, always measured)."""
    if raw is None:
        return comm.TRIED
    if not asked:
        raise UsageError("--comm-modes needs --comm (it names the modes that --comm tries)")
    modes = []
    for word in raw.split(","):
        try:
            name, _ = parse_compression(word)
        except UsageError as err:
            raise UsageError(f"--comm-modes: {err}") from None
        mode = word.strip().lower()
        if name != "none" and mode not in modes:
            modes.append(mode)
    return tuple(modes)


def _measure(args: argparse.Namespace, spec: BenchSpec, tracked: Sink | None) -> int:
    notes = context_notes(busy=None if spec.hosts else busy_before())
    if args.link_gbit is not None and not args.link_gbit > 0:
        raise UsageError(f"--link-gbit must be more than 0, got {args.link_gbit:g}")
    measurements = run_all(spec)
    comm_results = comm.measure(spec, link_gbit=args.link_gbit, tried=args.comm_modes, plain={
        m.nproc: m.samples_per_s for m in measurements if m.ok}) if args.comm else []
    rows = report.scaling(measurements)
    cpus, gpus = machine_facts(measurements, local=not spec.hosts)
    hosts = max(1, len(spec.hosts))
    recommendation = report.recommend(rows, cpus=cpus, gpus=gpus, hosts=hosts)
    title = headline(spec, cpus, gpus)
    if args.json:
        data = report.to_json(rows, recommendation, **json_context(spec, cpus, gpus), notes=notes)
        if args.comm:
            data["communication"] = [r.to_json() for r in comm_results]
        print(json.dumps(data, indent=2))
    else:
        print(report.format_table(rows, recommendation, hosts=hosts, title=title))
        for result in comm_results:
            print("\n".join(result.lines()))
        for note in notes:
            print(f"note: {note}")
    path = None
    if args.plot:
        path = plot.write_plot(args.plot, rows, title=title)
        print(f"disttrain bench: plot written to {path}", file=sys.stderr)
    if tracked is not None:  # the world size is the step: a curve per number
        for row in rows:
            values = {"samples_per_s": row.measurement.samples_per_s, "speedup": row.speedup,
                      "efficiency": row.efficiency}
            tracked.metrics({k: v for k, v in values.items() if v is not None}, row.world_size, time.time())
        tracked.text("bench.json", json.dumps(report.to_json(rows, recommendation, **json_context(spec, cpus, gpus),
                                                             notes=notes), indent=2))
        if path is not None:
            tracked.artifact(Path(path))
    return 0 if all(m.ok for m in measurements) else 1


