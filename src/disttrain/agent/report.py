"""The root-cause block: which rank failed first, where, how, and its last lines.

It is built from the files the agent already keeps (the rank's stderr and stdout), so it
works for every script, with or without torch's ``@record`` decorator.
"""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from .logs import rank_log

TAIL_LINES = 15


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
    try:
        with open(path, errors="replace") as fh:
            return [line.rstrip("\n") for line in deque(fh, maxlen=lines)]
    except OSError:
        return []


def last_output_time(run_dir: str, failure: RankFailure) -> float:
    """When the rank last wrote anything: ns-precise, unlike torch's whole-second timestamps."""
    times = []
    for stream in ("stderr", "stdout"):
        try:
            times.append(rank_log(run_dir, failure.rank, stream, failure.attempt).stat().st_mtime)
        except OSError:
            pass
    return max(times, default=failure.timestamp)


def root_cause(failures: list[RankFailure], run_dir: str) -> RankFailure:
    """The rank that failed first.

    Ranks the agent itself stopped come last. Among the others, torch's failure times have
    one-second resolution, and a crash makes its peers fail within milliseconds ("Connection
    closed by peer"), so the tie is broken by who wrote their last line first.
    """
    return min(
        failures,
        key=lambda f: (f.stopped_by_agent, f.timestamp, last_output_time(run_dir, f), f.rank),
    )


def format_failure(first: RankFailure, failures: list[RankFailure], run_dir: str) -> str:
    how = f"was killed by {first.signal_name}" if first.signal_name else f"exited with code {first.exit_code}"
    stderr = rank_log(run_dir, first.rank, "stderr", first.attempt)
    stdout = rank_log(run_dir, first.rank, "stdout", first.attempt)
    last = tail(stderr) or tail(stdout)
    lines = [
        f"disttrain: rank {first.rank} on {first.host} {how} (pid {first.pid}); "
        f"the other ranks were stopped",
        f"  logs: {stderr}",
        f"        {stdout}",
    ]
    others = sorted(f.rank for f in failures if f.rank != first.rank)
    if others:
        lines.append(f"  also failed after it: rank {', '.join(map(str, others))}")
    if last:
        lines.append(f"  last lines of rank {first.rank}:")
        lines.extend(f"    {line}" for line in last)
    return "\n".join(lines)
