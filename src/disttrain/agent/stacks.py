"""A rank's Python stacks: where its main thread is, and how to get them when it has no server.

The stacks come from torch's worker server (``dump_traceback``, see :mod:`.flight`), or for a
rank without one from ``py-spy dump`` when installed (it also sees native frames) or from the
runtime's SIGUSR1 handler (faulthandler writes them to the rank's ``.stacks`` file). Both
print faulthandler's or py-spy's text, which :func:`where` reads.
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


def signalled_stacks(ranks: Sequence[tuple[int, int, Path]]) -> dict[int, str]:
    """The stacks of ranks without a worker server, by rank: ``(rank, pid, stacks file)`` each,
    from py-spy when installed, else from the runtime's SIGUSR1 handler (it appends to the file)."""
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
    rest = [r for r in ranks if r[0] not in out]
    sizes = {rank: _size(path) for rank, _, path in rest}
    for _, pid, _ in rest:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + DUMP_WAIT_S
    while rest and time.monotonic() < deadline:
        time.sleep(0.1)
        rest = [r for r in rest if _size(r[2]) <= sizes[r[0]]]
    for rank, _, path in ranks:
        if rank not in out:
            try:
                out[rank] = path.read_text()
            except OSError:
                out[rank] = ""
    return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
