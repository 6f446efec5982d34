"""A node's private folder in the temporary directory, for the life of its agent.

It holds the workers' exit marks (exit_abort.py) and, where a job uses them, their Unix sockets (in-place
regroups, the Flight Recorder's servers): a socket's path must stay short (108 bytes), which a run folder's
need not be. The agent removes it at its end. An agent that cannot (SIGKILLed, a host's power cut) leaves it
behind: the next agent on the host removes every such folder whose agent is gone, so none piles up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import psutil

PREFIX = "disttrain-node-"


def _host() -> str:
    """This host, in 8 characters: a socket's path in the folder must stay short."""
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def _started(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``'s 22nd field): fixed for the
    life of the process. Not ``psutil``'s ``create_time()``, which adds the boot time as the wall clock now
    puts it: once the clock is stepped or slewed by a second, an agent that still runs reads as gone, and the
    next agent on the host removed its folder (its recorder and regroup sockets) from under its job."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # after the command's name, which may hold anything


def _owner_tag(pid: int) -> str | None:
    """``<host>-<pid>-<start>``: the agent, told apart from a later process that reuses its pid
    (and, should the temporary directory be shared, from an agent of another host)."""
    started = _started(pid)
    return None if started is None else f"{_host()}-{pid}-{started}"


def _stale(folder: Path, host: str) -> bool:
    """Made on this host by an agent that no longer runs."""
    owner = folder.name[len(PREFIX):].rpartition("-")[0]  # tempfile's random suffix has no "-"
    made_on, _, pid = owner.rpartition("-")[0].rpartition("-")
    if made_on != host or not pid.isdigit():
        return False
    started = _started(int(pid))
    if started is None:  # no /proc entry to read: gone, unless it is only hidden from this user
        return not psutil.pid_exists(int(pid))
    return f"{host}-{pid}-{started}" != owner


def sweep(tmp: str | None = None) -> None:
    """Remove the folders left by this host's agents that are gone (only this user's: the others' are not ours)."""
    host, uid = _host(), os.getuid()
    for folder in Path(tmp or tempfile.gettempdir()).glob(PREFIX + "*"):
        try:
            mine = folder.is_dir() and not folder.is_symlink() and folder.stat().st_uid == uid
        except OSError:
            continue
        if mine and _stale(folder, host):
            shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def node_scratch() -> Iterator[Path]:
    """This agent's folder (0700, as ``mkdtemp`` makes it), the stale ones swept first; removed at the end."""
    sweep()
    folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{_owner_tag(os.getpid())}-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


__all__ = ["PREFIX", "node_scratch", "sweep"]
