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

from ..process_start import same_process, started

PREFIX = "disttrain-node-"


def _host() -> str:
    """This host, in 8 characters: a socket's path in the folder must stay short."""
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def _owner_tag(pid: int) -> str | None:
    """``<host>-<pid>-<start>``: the agent, told apart from a later process that reuses its pid (its start in
    ticks since boot, which no clock step moves: process_start.py), and, should the temporary directory be
    shared, from an agent of another host."""
    start = started(pid)
    return None if start is None else f"{_host()}-{pid}-{start}"


def _stale(folder: Path, host: str) -> bool:
    """Made on this host by an agent that no longer runs (the folders are this user's: their agents' pids
    are never hidden from it)."""
    owner = folder.name[len(PREFIX):].rpartition("-")[0]  # tempfile's random suffix has no "-"
    made_on, _, pid = owner.rpartition("-")[0].rpartition("-")
    start = owner.rpartition("-")[2]
    if made_on != host or not pid.isdigit() or not start.isdigit():
        return False
    return not same_process(int(pid), int(start))


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
