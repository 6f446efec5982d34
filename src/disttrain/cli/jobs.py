"""``disttrain jobs ls | show ID | logs ID [-f] | metrics ID | stop ID``: the job history."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..private import mask_secrets
from .job import add_store_arg

FOLLOW_POLL_S = 0.3
FOLLOW_LAST_LINE_S = 30.0  # a runner on another host: how long its last line may take


def add_parser(sub: argparse._SubParsersAction) -> None:
    jobs = sub.add_parser("jobs", help="list, inspect, follow and stop recorded jobs",
                          description="The job history kept by `disttrain job run` (SQLite).")
    actions = jobs.add_subparsers(dest="action", required=True, metavar="ACTION")

    ls = actions.add_parser("ls", help="recorded jobs, newest first")
    ls.add_argument("-n", "--limit", type=int, default=20, help="how many (default 20; 0: all)")
    ls.add_argument("--json", action="store_true", help="print the records as JSON")
    ls.set_defaults(handler=handle_ls)

    show = actions.add_parser("show", help="one job: states and times, hosts, spec, artifacts, metrics, failure")
    show.add_argument("job", metavar="ID", help="a job id or name")
    show.add_argument("--json", action="store_true", help="print the record as JSON")
    show.set_defaults(handler=handle_show)

    logs = actions.add_parser("logs", help="a job's output, as its terminal showed it")
    logs.add_argument("job", metavar="ID", help="a job id or name")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    logs.add_argument("--rank", type=int, default=None, help="only this rank's output, without prefixes")
    logs.set_defaults(handler=handle_logs)

    stop = actions.add_parser("stop", help="stop a running job (its runner stops every instance)")
    stop.add_argument("job", metavar="ID", help="a job id or name")
    stop.add_argument("--timeout", type=float, default=30.0,
                      help="seconds to wait for the job to stop before killing its runner (default 30)")
    stop.set_defaults(handler=handle_stop)

    metrics = actions.add_parser("metrics", help="a job's metric series (metric_definitions), as a table, JSON or plot")
    metrics.add_argument("job", metavar="ID", help="a job id or name")
    metrics.add_argument("--json", action="store_true", help="every point as JSON: {name: [[time, value], ...]}")
    metrics.add_argument("--plot", metavar="PNG", default=None, help="draw every series into this PNG")
    metrics.set_defaults(handler=handle_metrics)

    for p in (ls, show, logs, stop, metrics):
        add_store_arg(p)


def _store(args: argparse.Namespace):
    from ..store import JobStore

    return JobStore(args.store)


def _shown(record) -> dict:
    """A record as printed: secrets masked, also in records kept before they were masked on write."""
    data = record.to_dict()
    data["spec"] = mask_secrets(data["spec"])
    return data


def _when(stamp: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp)) if stamp else "-"


def _took(record) -> str:
    end = record.ended or time.time()
    return f"{end - record.created:.1f} s"


def _where(record) -> str:
    machines = list(dict.fromkeys(h["host"] for h in record.hosts))
    where = f"{len(record.hosts)} on {','.join(machines)}" if record.hosts else "-"
    return f"{where} (Slurm job {record.slurm_job_id})" if record.slurm_job_id else where


def handle_ls(args: argparse.Namespace) -> int:
    from ..jobs.control import refresh

    with _store(args) as store:
        records = [refresh(store, r) for r in store.list(args.limit or None)]
    if args.json:
        print(json.dumps([_shown(r) for r in records], indent=2))
        return 0
    rows = [("ID", "NAME", "STATE", "CREATED", "DURATION", "EXIT", "INSTANCES")]
    rows += [(str(r.id), r.name, str(r.state), _when(r.created), _took(r),
              "-" if r.exit_code is None else str(r.exit_code), _where(r)) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def handle_show(args: argparse.Namespace) -> int:
    from ..jobs.control import refresh

    with _store(args) as store:
        record = refresh(store, store.get(args.job))
        series = store.metric_series(record.id)
    if args.json:
        print(json.dumps({**_shown(record), "metric_series": series}, indent=2))
        return 0
    fields = [
        ("id", str(record.id)), ("name", record.name), ("state", str(record.state)),
        ("created", _when(record.created)), ("duration", _took(record)),
        ("exit code", "-" if record.exit_code is None else str(record.exit_code)),
        ("instances", ", ".join(f"{h['instance']} on {h['host']}" for h in record.hosts) or "-"),
        *([("slurm job", record.slurm_job_id)] if record.slurm_job_id else []),
        ("job dir", record.job_dir), ("logs", f"{record.log_dir}  (disttrain jobs logs {record.id})"),
    ]
    fields += [(f"{kind} artifact", url) for kind, url in record.artifacts.items()]
    fields.append(("metrics", json.dumps(record.metrics) if record.metrics is not None else "-"))
    fields += [(f"metric {name}", f"{points[-1][1]:g} (last of {len(points)})") for name, points in sorted(series.items())]
    start = record.events[0][1] if record.events else record.created
    fields.append(("history", ", ".join(f"{state} +{t - start:.1f}s" for state, t in record.events)))
    for change in record.membership or ():  # an elastic job: who left or joined, the world after
        if change["change"] != "start":
            fields.append(("membership", f"+{change['time'] - start:.1f}s {change['host']} {change['change']} "
                                         f"({change['why']}): {len(change['hosts'])} instance(s), world size "
                                         f"{change['world_size']}, resumed from step {change['resumed_from']}, "
                                         f"{change['seconds']} s"))
    if record.goodput:  # host-seconds by class (disttrain.goodput)
        from ..goodput import summary

        fields.append(("goodput", summary(record.goodput)))
    for key, value in fields:
        print(f"{key + ':':<18}{value}")
    if record.failure:
        print("failure:" if record.state == "Failed" else "reason:")
        print("\n".join(f"  {line}" for line in record.failure.splitlines()))
    print("spec:")
    print("\n".join(f"  {line}" for line in json.dumps(mask_secrets(record.spec), indent=2).splitlines()))
    return 0


def handle_logs(args: argparse.Namespace) -> int:
    from ..errors import UsageError

    with _store(args) as store:
        record = store.get(args.job)
        logs = record.logs
        path = logs / ("job.log" if args.rank is None else f"rank{args.rank}.log")
        if args.rank is not None:
            _check_rank(record, logs, args.rank)
        if not args.follow and not path.exists():
            if args.rank is None:
                raise UsageError(f"job {record.name}: no output yet ({path})")
            # A rank that printed nothing is not a mistake: its (empty) output, and a word on stderr.
            print(f"disttrain: job {record.name}: rank {args.rank} has printed nothing"
                  f"{'' if record.state.final else ' yet'}", file=sys.stderr)
            return 0
        if args.follow:
            _follow(store, record, path, job_log=args.rank is None)
        else:
            _print_from(path, 0, b"")
    return 0


def _check_rank(record, logs: Path, rank: int) -> None:
    """``--rank`` names one of the job's ranks (known once it started: its plan.json)."""
    from ..errors import UsageError

    try:
        world = json.loads((logs / "plan.json").read_text())["world_size"]
    except (OSError, ValueError, KeyError, TypeError):
        world = None  # not started yet, or a plan from elsewhere: any rank may come
    if rank < 0 or (world is not None and rank >= world):
        ranks = f"ranks 0..{world - 1}" if world else "ranks from 0"
        raise UsageError(f"--rank {rank}: job {record.name} has {ranks}")


def _follow(store, record, path: Path, *, job_log: bool) -> None:
    """Print ``path`` as it grows until the job has ended and its runner has written its last line.

    The runner records the end first, then writes that line: a follower that stopped at the
    record's end would miss it. It stops at once if the runner is gone (killed before its last
    line), and FOLLOW_LAST_LINE_S after the end if the runner is on another host and silent.
    """
    from ..jobs.control import refresh, runner_alive
    from ..jobs.runner import last_line_start

    offset, tail = 0, b""
    ended_at = None
    while True:
        offset, tail = _print_from(path, offset, tail)
        record = refresh(store, store.get(record.id))
        if record.state.final:
            ended_at = ended_at or time.monotonic()
            marker = last_line_start(record).encode()
            if (not job_log or marker in tail or runner_alive(record) is False
                    or time.monotonic() - ended_at > FOLLOW_LAST_LINE_S):
                _print_from(path, offset, tail)  # what was written while we looked at the state
                return
        time.sleep(FOLLOW_POLL_S)


def _print_from(path: Path, offset: int, tail: bytes) -> tuple[int, bytes]:
    """Print what ``path`` holds after ``offset``; the new offset, and the last lines printed
    (enough to find the runner's last line even if it came in two reads)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return offset, tail
    sys.stdout.write(data.decode(errors="replace"))
    sys.stdout.flush()
    return offset + len(data), (tail + data)[-4096:]


def handle_metrics(args: argparse.Namespace) -> int:
    if args.plot:
        from ..plotfile import plot_path, require_matplotlib

        require_matplotlib()
        png = plot_path(args.plot)
    with _store(args) as store:
        record = store.get(args.job)
        series = store.metric_series(record.id)
    if args.plot:
        from ..jobs.metrics import plot_series

        print(f"wrote {plot_series(series, png, title=f'job {record.name}')}")
    if args.json:
        print(json.dumps(series))
    elif not args.plot:
        if not series:
            print(f"job {record.name}: no metrics recorded (give metric_definitions)")
        start = min((points[0][0] for points in series.values()), default=0.0)
        for name, points in sorted(series.items()):
            print(f"{name}: {len(points)} point(s), last {points[-1][1]:g}")
            for t, v in points:
                print(f"  +{t - start:7.1f}s  {v:g}")
    return 0


def handle_stop(args: argparse.Namespace) -> int:
    from ..jobs.control import stop_job

    with _store(args) as store:
        before = store.get(args.job)
        record = stop_job(store, args.job, timeout_s=args.timeout)
    if before.state.final:
        print(f"job {record.name} (id {record.id}) is already {record.state}; nothing to stop")
    else:
        print(f"job {record.name} (id {record.id}) {record.state}"
              + ("" if record.exit_code is None else f", exit code {record.exit_code}"))
    return 0
