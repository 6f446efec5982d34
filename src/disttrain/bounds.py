"""Every number a user gives has a range, checked when it is parsed, with one line naming it.

An unbounded number does harm far from where it was typed: ``-n 10**20`` builds a plan of 10**20
ranks (nothing printed, for minutes), ``--hang-timeout 10**20`` overflows a C int inside the
watchdog (the diagnosis quietly off), an id past SQLite's 64 bits is an ``OverflowError``. The
ranges are wide (no real job comes near them) and said in the message, so the fix is plain.

A leaf (the errors only): the CLI, the launch spec, the job store and the runtime's settings
all check through :func:`within`.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import UsageError

MAX_INT = 2**31 - 1  # a C int: what torch, sockets and timers take
MAX_ID = 2**63 - 1  # SQLite's INTEGER: the job store's ids
MAX_SECONDS = 10**6  # about 11.5 days: any timeout or wait (x1000 as milliseconds still a C int)
MAX_PROCS = 4096  # processes on one node
MAX_NODES = 65536
MAX_RANK = 2**20 - 1  # a global rank named on the command line (--ranks 0-N is a set of N numbers)
MAX_STEPS = 10**9  # step counts (a checkpoint period, DiLoCo's H)
MAX_MB = 2**20  # a terabyte, in MB (a DDP bucket)


def within(what: str, value: Any, lo: float, hi: float, *, unit: str = "") -> Any:
    """``value`` when it is a finite number in ``lo..hi``; else a UsageError naming ``what`` and the range."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value) if any(c in value.lower() for c in ".en") else int(value)
        except ValueError:
            number = math.nan
    finite = isinstance(number, (int, float)) and not isinstance(number, bool) and math.isfinite(number)
    if not finite or not lo <= number <= hi:
        raise UsageError(f"{what} must be in {_num(lo)}..{_num(hi)}{f' {unit}' if unit else ''}, got {_shown(value)}")
    return value


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _shown(value: Any) -> str:
    text = str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# The CLI's numeric options by argparse dest: (low, high, unit). An option not named here gets
# DEFAULT_INT or DEFAULT_FLOAT: no number a user types goes unchecked (cli/main.py walks them all).
OPTIONS: dict[str, tuple[float, float, str]] = {
    "master_port": (1, 65535, ""),
    "port": (0, 65535, ""),  # the agent's: 0 lets the system pick
    "max_restarts": (0, 10_000, ""),
    "node_rank": (0, MAX_NODES - 1, ""),
    "nnodes": (1, MAX_NODES, "nodes"),
    "nodes": (1, MAX_NODES, "nodes"),
    "nproc_per_node": (1, MAX_PROCS, "processes"),
    "gpus_per_node": (0, 1024, "GPUs"),
    "rdzv_timeout": (1, MAX_SECONDS, "seconds"),
    "hang_timeout": (0, MAX_SECONDS, "seconds"),
    "stop_grace": (0, MAX_SECONDS, "seconds"),
    "shutdown_timeout": (0, MAX_SECONDS, "seconds"),
    "monitor_interval": (0.001, 3600, "seconds"),
    "pending_timeout": (0, MAX_SECONDS, "seconds"),
    "timeout": (0, MAX_SECONDS, "seconds"),
    "checkpoint_every": (0, MAX_STEPS, "steps"),
    "checkpoint_retry_s": (0, 86_400, "seconds"),  # 0: no retry
    "global_batch": (1, MAX_INT, ""),
    "steps": (1, MAX_STEPS, ""),
    "warmup": (0, MAX_STEPS, ""),
    "repeat": (1, 1000, ""),
    "link_gbit": (0.001, 10_000, "Gbit/s"),
    "limit": (0, MAX_INT, ""),
    "rank": (0, MAX_INT, ""),
    "trials": (1, 100_000, ""),
    "parallel": (1, 10_000, ""),
    "seed": (0, 2**32 - 1, ""),  # numpy's and Optuna's seeds
}
DEFAULT_INT = (0, MAX_INT, "")
DEFAULT_FLOAT = (0, MAX_SECONDS, "")


def option(flag: str, dest: str, value: Any) -> Any:
    """A parsed option's value, checked against its range in :data:`OPTIONS` (numbers only)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    lo, hi, unit = OPTIONS.get(dest, DEFAULT_FLOAT if isinstance(value, float) else DEFAULT_INT)
    return within(flag, value, lo, hi, unit=unit)
