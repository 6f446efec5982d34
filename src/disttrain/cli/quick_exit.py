"""A launcher whose run is over exits without tearing its interpreter down.

When ``disttrain run`` returns, its job is done: every worker has exited and been reaped, every
line is written, the records are closed. What is left of the process's life is the interpreter's
finalization -- torch's modules, and the thousands of objects they hold, freed one by one: about
half a second of CPU on every run, with nothing to show for it. So, when nothing else is left
either, the process runs what was registered to run at exit (``atexit``: logging's flush,
``weakref.finalize`` clean-ups, multiprocessing's), flushes Python's and C's output buffers and
ends with ``os._exit``, as a node's agent already does (:func:`disttrain.agent.entry.end_process`).

It exits the normal way instead -- finalization and all, exactly as before -- while a thread that
Python would wait for (not a daemon) is still running, or a child process is, or where it cannot
tell (no ``/proc``).
"""

from __future__ import annotations

import os
import threading

from ..process_end import exit_after_atexit


def _threads_waited_for() -> bool:
    """Whether a thread other than this one is alive that the interpreter's exit would join."""
    main = threading.main_thread()
    return any(t is not main and not t.daemon and t.is_alive() for t in threading.enumerate())


def _running_children() -> bool:
    """Whether a child of this process is still running (a zombie is not: its end is already
    written); True where /proc cannot tell."""
    pid = os.getpid()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        children = set()
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/children") as fh:
                    children.update(fh.read().split())
            except FileNotFoundError:  # the thread ended meanwhile
                continue
    except OSError:  # no /proc, or a kernel without the children files
        return True
    for child in children:
        try:
            with open(f"/proc/{child}/stat") as fh:
                state = fh.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):  # gone meanwhile
            continue
        if state not in ("Z", "X"):
            return True
    return False


def exit_now(code: int) -> int:
    """End the process with ``code`` at once when nothing is left to wait for (see the module's
    doc); else return ``code`` for the normal exit."""
    if _threads_waited_for() or _running_children():
        return code
    exit_after_atexit(code)
