"""A process told apart from a later one that reuses its pid: when it started, in clock ticks since boot.

That number, ``/proc/<pid>/stat``'s 22nd field, is fixed for the life of the process. ``psutil``'s
``create_time()`` is not: it adds the boot time as the wall clock now puts it, so once the clock is stepped
or slewed across a second (a fresh machine setting its clock), a process that still runs reads as another.
The next agent on the host then removed a live one's scratch folder, sockets and all, and ``jobs list``
would have marked a running job Failed. Linux only, as the rest of the launcher.
"""

from __future__ import annotations

import os


def started(pid: int) -> int | None:
    """When ``pid`` started, in ticks since boot; None when there is no such process (or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()  # after the command's name, which may hold anything
    except OSError:
        return None
    return int(fields[19])


# A start recorded by 0.7.8 or before: psutil's create_time(), seconds since the epoch (and past this one).
_EPOCH_2020 = 1_577_836_800


def same_process(pid: int, start: int | float | None) -> bool:
    """``pid`` runs and is the process that started at ``start`` (None: any process with that pid). A
    zombie still counts: it is gone only once reaped."""
    now = started(pid)
    if now is None:
        return False
    if start is None or now == start:
        return True
    if start < _EPOCH_2020:
        return False
    import psutil  # an older record's runner, which may still run: told as it was then, within a second

    try:
        return abs(psutil.Process(pid).create_time() - start) < 1.0
    except psutil.Error:
        return False


def this_process() -> int:
    now = started(os.getpid())
    assert now is not None, "/proc is not mounted"
    return now


__all__ = ["same_process", "started", "this_process"]
