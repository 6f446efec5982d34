"""The root-cause block: which rank failed first, where, how, and its last lines.

It is built from the files the agent already keeps (the rank's stderr and stdout), so it
works for every script, with or without torch's ``@record`` decorator. A rank that died of
SIGKILL is named as killed for memory when the kernel says so (see :mod:`.oom`).
"""

from __future__ import annotations

import json
import signal
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from ..workerenv import rank_file
from .oom import OomWatch

TAIL_LINES = 15
# What a rank says when a peer vanished: the peer, not this rank, is where to look.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "NCCL communicator was aborted", "ProcessGroupNCCL is shutting down")


@dataclass(frozen=True, kw_only=True)
class RankFailure:
    rank: int
    host: str
    exit_code: int  # shell convention: 128+N for a death by signal N
    signal_name: str | None
    pid: int
    timestamp: float
    attempt: int = 0
    stopped_by_agent: bool = False  # SIGTERM from the agent's shutdown: a consequence, not a cause
    raised_at: float | None = None  # when an exception ended it (its marker's mtime, ns-precise)


def rank_failure(*, rank: int, host: str, raw_code: int, pid: int, timestamp: float, attempt: int,
                 run_dir: str) -> RankFailure:
    """A failed worker as torch's agent saw it (``raw_code``: negative for a signal), and when it raised.

    A rank whose exception was raised before the agent's SIGTERM came was ending with Python's code 1
    for it (atexit, interpreter teardown): it failed on its own, and is said so -- its peer, told
    by the group it closed, may well have exited, and been seen, first.
    """
    try:
        raised = rank_file(run_dir, rank, attempt, "raised").stat().st_mtime
    except OSError:
        raised = None
    code, sig = shell_exit_code(raw_code)
    stopped = raw_code == -signal.SIGTERM
    if stopped and raised is not None:
        code, sig, stopped = 1, None, False
    return RankFailure(rank=rank, host=host, exit_code=code, signal_name=sig, pid=pid,
                       timestamp=timestamp if raised is None else raised, attempt=attempt,
                       stopped_by_agent=stopped, raised_at=raised)


def shell_exit_code(raw: int) -> tuple[int, str | None]:
    """torch reports a death by signal as a negative exit code; shells say 128+N."""
    if raw < 0:
        try:
            name = signal.Signals(-raw).name
        except ValueError:
            name = f"signal {-raw}"
        return 128 + (-raw), name
    return raw, None


def tail(path: Path, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` lines a person would read (not the track lines meant for the tracker)."""
    from ..wire import for_people

    try:
        with open(path, errors="replace") as fh:
            return [line.rstrip("\n") for line in deque(filter(for_people, fh), maxlen=lines)]
    except OSError:
        return []


def last_output_time(run_dir: str, failure: RankFailure) -> float:
    """When the rank last wrote anything: ns-precise, unlike torch's whole-second timestamps."""
    times = []
    for stream in ("stderr", "stdout"):
        try:
            times.append(rank_file(run_dir, failure.rank, failure.attempt, stream).stat().st_mtime)
        except OSError:
            pass
    return max(times, default=failure.timestamp)


def failed_at(run_dir: str, failure: RankFailure) -> float:
    """When the rank raised, else when it last wrote anything."""
    return failure.raised_at if failure.raised_at is not None else last_output_time(run_dir, failure)


def root_cause(failures: list[RankFailure], run_dir: str) -> RankFailure:
    """The rank that failed first.

    Ranks the agent itself stopped come last. Among the others, torch's failure times have
    one-second resolution (when the agent noticed), and a crash makes its peers fail within
    milliseconds ("Connection closed by peer"), so the tie is broken by who raised first, or
    else wrote their last line first.
    """
    return min(
        failures,
        key=lambda f: (f.stopped_by_agent, int(f.timestamp), failed_at(run_dir, f), f.rank),
    )


def failed_line(first: RankFailure, run_dir: str) -> str:
    """The launcher's copy of this node's root cause, timed by the rank's own last write (the
    kernel's time of the worker's own output, ns-precise) -- not by when anyone noticed it."""
    from ..wire import RankFailed

    return RankFailed(host=first.host, rank=first.rank, exit_code=first.exit_code,
                      at=failed_at(run_dir, first),
                      lost_peer=lost_a_peer(failure_lines(first, run_dir))).to_line()


def error_file_lines(run_dir: str, failure: RankFailure, lines: int = TAIL_LINES) -> list[str]:
    """What torch's ``@record`` wrote for the rank (``rank<R>.error.json``): message and traceback tail."""
    path = rank_file(run_dir, failure.rank, failure.attempt, "error.json")
    try:
        data = json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError):
        return []
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        stack = str((message.get("extraInfo") or {}).get("py_callstack") or "").rstrip("\n").splitlines()
        text = str(message.get("message") or "")
    else:
        stack, text = [], str(message or "")
    out = stack[-lines:] if stack else []
    if text and (not out or text not in out[-1]):
        out.append(text)
    return out


def strip_torch_prefix(line: str, rank: int) -> str:
    """torch's excepthook writes "[rankN]: ..."; the block already says whose lines these are."""
    return line.removeprefix(f"[rank{rank}]: ").removeprefix(f"[rank{rank}]:")


def lost_a_peer(lines: list[str]) -> bool:
    return any(marker in line for line in lines for marker in PEER_LOST)


def last_lines(first: RankFailure, run_dir: str) -> list[str]:
    """The failed rank's last lines: of its stderr, else of its stdout."""
    stderr = rank_file(run_dir, first.rank, first.attempt, "stderr")
    stdout = rank_file(run_dir, first.rank, first.attempt, "stdout")
    return [strip_torch_prefix(line, first.rank) for line in (tail(stderr) or tail(stdout))]


def failure_lines(first: RankFailure, run_dir: str) -> list[str]:
    """The failed rank's last lines and what its error file says: where a lost peer shows."""
    return last_lines(first, run_dir) + error_file_lines(run_dir, first)


def format_failure(first: RankFailure, failures: list[RankFailure], run_dir: str, *,
                   finished: tuple[tuple[int, str], ...] = (), oom: OomWatch | None = None) -> str:
    """The root-cause block. ``finished``: (rank, host) of the ranks that exited 0 while others
    still ran, on this node or another; ``oom``: started with the workers, to tell a SIGKILL of
    the kernel's OOM killer from any other."""
    last = last_lines(first, run_dir)
    from_file = error_file_lines(run_dir, first)
    memory = oom.explain(first.pid) if oom is not None and first.signal_name == "SIGKILL" else None
    how = f"was killed by {first.signal_name}" if first.signal_name else f"exited with code {first.exit_code}"
    if memory:
        how = "was killed by the kernel's OOM killer (SIGKILL: out of memory)"
    others = sorted(f.rank for f in failures if f.rank != first.rank and not f.stopped_by_agent)
    stopped = sorted(f.rank for f in failures if f.rank != first.rank and f.stopped_by_agent)
    lines = []
    if finished and lost_a_peer(last + from_file):
        hosts: dict[str, list[int]] = {}
        for rank, host in sorted(finished):
            hosts.setdefault(host, []).append(rank)
        gone = "; ".join(f"{'ranks' if len(r) > 1 else 'rank'} {', '.join(map(str, r))} on {h}" for h, r in hosts.items())
        lines.append(
            f"disttrain: {gone} exited with code 0 while the other ranks were still "
            f"running, and the job broke: rank {first.rank} then {how} because it lost its peer. Every rank "
            "must make the same collective calls (the same number of steps, or disttrain.prepare's uneven-"
            "input join)")
    else:
        suffix = "; the other ranks were stopped" if stopped else ""
        lines.append(f"disttrain: rank {first.rank} on {first.host} {how} (pid {first.pid}){suffix}")
    if memory:
        lines.append(f"  out of memory: {memory}")
        lines.append("  fix: fewer processes per host, a smaller batch per process, or more memory for the job")
    lines += [f"  logs: {rank_file(run_dir, first.rank, first.attempt, 'stderr')}",
              f"        {rank_file(run_dir, first.rank, first.attempt, 'stdout')}"]
    if others:
        lines.append(f"  also failed after it: rank {', '.join(map(str, others))}")
    if from_file and not any(from_file[-1] in line for line in last):
        lines.append(f"  error of rank {first.rank} ({rank_file(run_dir, first.rank, first.attempt, 'error.json')}):")
        lines.extend(f"    {line}" for line in from_file)
    if last:
        lines.append(f"  last lines of rank {first.rank}:")
        lines.extend(f"    {line}" for line in last)
    return "\n".join(lines)
