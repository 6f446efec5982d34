"""A rank's Python stacks: where its main thread is, and how to get them whatever it is doing.

First from the worker bootstrap's own dump (``disttrain/_worker_site``: faulthandler on
:data:`DUMP_SIGNAL`, received by a thread of its own, written without the GIL), which answers even
for a rank stuck in native code that holds the GIL; else from torch's worker server
(``dump_traceback``, see :mod:`.flight`); for a rank without either, from ``py-spy dump`` when
installed or the runtime's SIGUSR1 handler. A signal is sent only to a process that ``/proc``
shows catching it (:func:`caught`): a plain script has no SIGUSR1 handler, and SIGUSR1's default
action kills. All print faulthandler's or py-spy's text, which :func:`where` reads.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

DUMP_WAIT_S = 3.0
# The bootstrap's dump signal (disttrain/_worker_site/sitecustomize.py: SIGRTMIN + DUMP_SIGNAL_OFFSET).
DUMP_SIGNAL = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else None
NO_STACK = "no Python stack: the rank answered no request and catches no dump signal"

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def where(stack_text: str) -> str:
    """``file:line in func`` of the innermost frame of the main thread, plus the innermost
    frame outside torch and the standard library when that differs (the user's call site)."""
    frames = _frames(stack_text)
    if not frames:
        return "no Python stack (the process did not answer)"
    top = frames[0]
    text = f"{Path(top['file']).name}:{top['line']} in {top['func']}"
    own = next((f for f in frames if not _is_library(f["file"])), None)
    if own is not None and own is not top:
        text += f", called from {Path(own['file']).name}:{own['line']} in {own['func']}"
    return text


def in_own_code(stack_text: str) -> bool:
    """The main thread's innermost frame is the script's own (not torch's, Python's or disttrain's)."""
    frames = _frames(stack_text)
    return bool(frames) and not _is_library(frames[0]["file"])


def _frames(stack_text: str) -> list[re.Match]:
    return [m for m in (_FRAME.match(line) for line in _main_thread(stack_text)) if m]


def _main_thread(text: str) -> list[str]:
    # faulthandler prints "Current thread"/"Thread 0x..." blocks; the main thread's is
    # the one with <module> at the bottom; py-spy prints 'Thread N (idle): "MainThread"'.
    blocks, block = [], []
    for line in text.splitlines():
        if line.startswith(("Thread ", "Current thread", "Process ")) and block:
            blocks.append(block)
            block = []
        block.append(line)
    blocks.append(block)
    for b in blocks:
        if any("MainThread" in line for line in b[:1]) or any("in <module>" in line for line in b):
            return b
    return blocks[0]


def _is_library(path: str) -> bool:
    return "site-packages" in path or "/lib/python" in path or "/disttrain/" in path


def is_stopped(pid: int) -> bool:
    """Stopped by SIGSTOP/SIGTSTP (or a tracer): it cannot answer until SIGCONT."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def caught(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (``SigCgt`` in /proc): sending it cannot kill."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            mask = next(int(line.split()[1], 16) for line in fh if line.startswith("SigCgt:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(mask >> (int(sig) - 1) & 1)


def bootstrap_stacks(ranks: Sequence[tuple[int, int, Path]]) -> dict[int, str]:
    """The stacks the worker bootstrap dumps on :data:`DUMP_SIGNAL`, by rank: ``(rank, pid, its
    dump file)`` each; a rank whose process does not catch the signal is not sent it."""
    if DUMP_SIGNAL is None:
        return {}
    asked = [(rank, pid, path, _size(path)) for rank, pid, path in ranks if caught(pid, DUMP_SIGNAL)]
    for _, pid, _, _ in asked:
        try:
            os.kill(pid, DUMP_SIGNAL)
        except ProcessLookupError:
            pass
    return _grown(asked)


def _grown(asked: list[tuple[int, int, Path, int]]) -> dict[int, str]:
    """What each file got after its size at the signal, waiting up to DUMP_WAIT_S for all."""
    deadline = time.monotonic() + DUMP_WAIT_S
    waiting = list(asked)
    while waiting and time.monotonic() < deadline:
        time.sleep(0.1)
        waiting = [a for a in waiting if _size(a[2]) <= a[3]]
    time.sleep(0.1)  # faulthandler writes a dump in several writes: let the last ones land
    out = {}
    for rank, _, path, before in asked:
        try:
            with open(path, errors="replace") as fh:
                fh.seek(before)
                text = fh.read()
        except OSError:
            continue
        if text.strip():
            out[rank] = text
    return out


def signalled_stacks(ranks: Sequence[tuple[int, int, Path]]) -> dict[int, str]:
    """The stacks of ranks without a worker server, by rank: ``(rank, pid, stacks file)`` each,
    from py-spy when installed, else from the runtime's SIGUSR1 handler (it appends to the file)
    where the rank has it -- a plain script does not, and SIGUSR1 would kill it."""
    pyspy = shutil.which("py-spy")
    out: dict[int, str] = {}
    if pyspy:
        for rank, pid, path in ranks:
            try:
                res = subprocess.run([pyspy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                                     timeout=DUMP_WAIT_S * 3)
                if res.returncode == 0 and res.stdout.strip():
                    path.write_text(res.stdout)
                    out[rank] = res.stdout
            except (OSError, subprocess.SubprocessError):
                pass
    rest = [(rank, pid, path, _size(path)) for rank, pid, path in ranks
            if rank not in out and caught(pid, signal.SIGUSR1)]
    for _, pid, _, _ in rest:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    out.update(_grown(rest))
    return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
