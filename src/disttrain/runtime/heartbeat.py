"""Signs of life for the launcher's hang watchdog (``disttrain run --hang-timeout``).

Each rank owns one file in the node's heartbeat folder, holding its pid and where its
stacks go; its mtime is the rank's last progress (a batch from a prepared loader, a
collective of the runtime). The agent on the node reads the mtimes; when none moved for
``--hang-timeout`` seconds it sends SIGUSR1, on which :mod:`faulthandler` writes every
thread's Python stack to the rank's ``.stacks`` file next to its logs.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import time
from pathlib import Path
from typing import TextIO

from ..workerenv import WorkerEnv, rank_file

MIN_INTERVAL_S = 1.0  # an mtime every second is all the watchdog needs

_file: Path | None = None
_last = 0.0
_stacks: TextIO | None = None
_info = ""
_steps = 0


def start(env: WorkerEnv) -> None:
    """Called by ``init()`` in launched runs: set up the stack dump on SIGUSR1.

    The heartbeat file itself is written at the first beat, so that start-up (imports,
    loading data) never counts as a hang.
    """
    global _file, _stacks, _info
    if not (env.heartbeat_dir and env.run_dir) or _file is not None:
        return
    stacks = rank_file(env.run_dir, env.rank, env.attempt, "stacks")
    stacks.parent.mkdir(parents=True, exist_ok=True)
    _stacks = open(stacks, "w")  # kept open: faulthandler writes to its descriptor from a signal
    faulthandler.register(signal.SIGUSR1, file=_stacks, all_threads=True)
    _file = Path(env.heartbeat_dir) / f"rank{env.rank}"
    _info = json.dumps({"pid": os.getpid(), "rank": env.rank, "stacks": str(stacks)})[:-1]  # + steps, per beat


def forget() -> None:
    """An in-place regroup renumbered this rank: its file goes, the next ``start()`` writes the new one's."""
    global _file, _last
    if _file is not None:
        try:
            _file.unlink()
        except OSError:
            pass
    _file, _last = None, 0.0


def beat() -> None:
    """Record progress; cheap enough to call every step (one clock read, at most one small
    write a second). The file holds the step count: the launcher compares ranks' rates."""
    global _last, _steps
    if _file is None:
        return
    _steps += 1
    now = time.monotonic()
    if now - _last < MIN_INTERVAL_S:
        return
    try:
        if _last == 0.0:
            _file.parent.mkdir(parents=True, exist_ok=True)
        tmp = _file.with_suffix(".tmp")
        tmp.write_text(f'{_info}, "steps": {_steps}}}')
        os.replace(tmp, _file)
    except OSError:  # the run folder was removed under us: nothing left to watch
        pass
    _last = now
