"""Tie a process's life to its parent's: when the launcher dies, even by SIGKILL, so does the job.

torch's agent starts every worker in a session of its own, so a SIGKILLed launcher leaves
its workers re-parented to init, training on as second writers of the checkpoint folder.
Linux's ``PR_SET_PDEATHSIG`` has the kernel signal a process when the thread that started it
exits; it survives ``execve``, so a worker gets it from a tiny wrapper that sets it and then
execs the real command in its own place (same pid, same argv semantics as ``python script.py``).

With ``--join FILE`` the wrapper first writes its pid to ``FILE``, a cgroup's ``cgroup.procs``
(see ``cgroup.py``): the worker, and everything it will ever start, is then in its worker
group's cgroup from its first instruction -- no race with a daemon it forks at once.

Run as a file (``python lifeline.py PPID SIGNAL [--join FILE] -- CMD...``), not as ``-m
disttrain...``: importing the package would be wasted start-up time in every worker. Only the
standard library.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def follow_parent(sig: int = signal.SIGKILL, *, parent: int | None = None) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies.

    ``parent`` is the pid that should still be the parent: if it already died before the
    call (the race between fork and prctl), the signal is raised at once. Returns False where
    the platform has no such thing (not Linux), and the caller goes on without it.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def wrap(argv: list[str] | tuple[str, ...], *, python: str, sig: int = signal.SIGKILL,
         join: str | None = None) -> list[str]:
    """``argv`` run through this file, so that it dies with the process that starts it (this one);
    ``join``: a cgroup's ``cgroup.procs`` to move into first."""
    options = ["--join", join] if join else []
    return [python, "-S", "-E", os.path.abspath(__file__), str(os.getpid()), str(int(sig)), *options, "--", *argv]


def join_cgroup(procs_file: str) -> None:
    """Move this process into the cgroup (best effort: the agent falls back on being a subreaper)."""
    try:
        with open(procs_file, "w") as fh:
            fh.write(str(os.getpid()))
    except OSError:
        pass


def main(args: list[str]) -> None:
    parent, sig, *rest = args
    if rest[:1] == ["--join"] and len(rest) > 1:
        join_cgroup(rest[1])
        rest = rest[2:]
    sep, *command = rest or [""]
    if sep != "--" or not command:
        sys.exit("usage: lifeline.py PARENT_PID SIGNAL [--join CGROUP_PROCS] -- COMMAND...")
    follow_parent(int(sig), parent=int(parent))
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
