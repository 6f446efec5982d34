"""The hang watchdog of one node: no progress for ``--hang-timeout`` seconds ends the job.

Ranks using the runtime touch a heartbeat file as they go (:mod:`disttrain.runtime.heartbeat`).
When none of this node's live ranks moved for the timeout, the watchdog asks each for its
Python stacks (SIGUSR1 → faulthandler; ``py-spy dump`` when installed, which also sees
native frames), names where each rank is, and stops the node's workers. A rank that has
not beaten yet (still loading data, compiling) does not arm the watchdog.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from ..wire import Beats

HANG_EXIT = 124  # as timeout(1): the job ran out of time, nothing crashed
POLL_S = 1.0
DUMP_WAIT_S = 3.0

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


@dataclass(frozen=True)
class Beat:
    rank: int
    pid: int
    stacks: Path
    mtime: float
    steps: int = 0


def live_beats(folder: Path) -> list[Beat]:
    """Heartbeats of ranks still running (a restart leaves its predecessors' files behind)."""
    beats = []
    for path in sorted(folder.glob("rank*")):
        if path.suffix:
            continue
        try:
            info = json.loads(path.read_text())
            mtime = path.stat().st_mtime
        except (OSError, ValueError):
            continue
        if psutil.pid_exists(info["pid"]):
            beats.append(Beat(info["rank"], info["pid"], Path(info["stacks"]), mtime, int(info.get("steps", 0))))
    return beats


def stalled_for(beats: list[Beat], now: float) -> float:
    """Seconds since the most recent progress of any rank (0 when none beat yet)."""
    return now - max(b.mtime for b in beats) if beats else 0.0


def where(stack_text: str) -> str:
    """``file:line in func`` of the innermost frame of the main thread, plus the innermost
    frame outside torch and the standard library when that differs (the user's call site)."""
    main = _main_thread(stack_text)
    frames = [m for m in (_FRAME.match(line) for line in main) if m]
    if not frames:
        return "no Python stack (the process did not answer)"
    top = frames[0]
    text = f"{Path(top['file']).name}:{top['line']} in {top['func']}"
    own = next((f for f in frames if not _is_library(f["file"])), None)
    if own is not None and own is not top:
        text += f", called from {Path(own['file']).name}:{own['line']} in {own['func']}"
    return text


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


def dump_stacks(beats: list[Beat]) -> dict[int, str]:
    """Every live rank's stacks, by rank."""
    pyspy = shutil.which("py-spy")
    out: dict[int, str] = {}
    if pyspy:
        for b in beats:
            try:
                res = subprocess.run([pyspy, "dump", "--pid", str(b.pid)], capture_output=True,
                                     text=True, timeout=DUMP_WAIT_S * 3)
                if res.returncode == 0 and res.stdout.strip():
                    b.stacks.write_text(res.stdout)
                    out[b.rank] = res.stdout
            except (OSError, subprocess.SubprocessError):
                pass
    rest = [b for b in beats if b.rank not in out]
    sizes = {}
    for b in rest:
        sizes[b.rank] = _size(b.stacks)
        try:
            os.kill(b.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + DUMP_WAIT_S
    while rest and time.monotonic() < deadline:
        time.sleep(0.1)
        rest = [b for b in rest if _size(b.stacks) <= sizes[b.rank]]
    for b in beats:
        if b.rank not in out:
            try:
                out[b.rank] = b.stacks.read_text()
            except OSError:
                out[b.rank] = ""
    return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def report(host: str, timeout_s: float, stacks: dict[int, str], beats: list[Beat], *, anywhere: bool = False) -> str:
    lines = [f"disttrain: no progress on {'any host' if anywhere else host} for {timeout_s:.0f} s (--hang-timeout); "
             f"where each rank on {host} is (innermost call first):"]
    paths = {b.rank: b.stacks for b in beats}
    pids = {b.rank: b.pid for b in beats}
    for rank in sorted(stacks):
        if rank in pids and _is_stopped(pids[rank]):  # it cannot answer: say why, not "did not answer"
            lines.append(f"  rank {rank}: stopped by a signal (SIGSTOP/SIGTSTP, pid {pids[rank]}); "
                         "it runs on only after SIGCONT   <- the culprit")
            continue
        # The others wait inside torch for it: the rank stopped in its own code is the culprit.
        mark = "   <- stopped in the script's own code" if _in_own_code(stacks[rank]) else ""
        lines.append(f"  rank {rank}: {where(stacks[rank])}{mark}")
    if paths:
        lines.append(f"  full stacks: {paths[min(paths)].parent}/rank<N>.stacks")
    return "\n".join(lines)


def _is_stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def _in_own_code(stack_text: str) -> bool:
    frames = [m for m in (_FRAME.match(line) for line in _main_thread(stack_text)) if m]
    return bool(frames) and not _is_library(frames[0]["file"])


def beats_line(host: str, beats: list[Beat], now: float) -> str:
    """What the launcher needs from this node each second (:class:`~disttrain.wire.Beats`)."""
    return Beats(host=host, ranks={b.rank: (b.steps, round(now - b.mtime, 2)) for b in beats}).to_line()


class Watchdog:
    """Polls the node's heartbeat folder in a daemon thread; ``fired`` holds the report.

    ``report_to_launcher``: the node is one of several; instead of judging alone, it sends
    its heartbeats to the launcher (:func:`beats_line` on stderr) and dumps its ranks' stacks
    when the launcher, which sees every host, asks (:meth:`dump_and_stop`).
    """

    def __init__(self, folder: str, timeout_s: float, host: str, on_hang, *,
                 report_to_launcher=None, always: bool = False) -> None:
        self.folder = Path(folder)
        self.timeout_s = timeout_s
        self.host = host
        self.fired: str | None = None
        self._on_hang = on_hang
        self._report = report_to_launcher
        self._always = always  # beat even without ranks: an elastic job's launcher hears the agent is alive
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disttrain-hang-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def dump_and_stop(self, timeout_s: float) -> None:
        """The launcher saw no progress anywhere: this node's part of the report, then stop."""
        if self.fired is not None:
            return
        beats = live_beats(self.folder)
        self.fired = report(self.host, timeout_s, dump_stacks(beats), beats, anywhere=True)
        self._on_hang()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            beats = live_beats(self.folder)
            if self._report is not None:
                if beats or self._always:
                    self._report(beats_line(self.host, beats, time.time()))
                continue
            if stalled_for(beats, time.time()) < self.timeout_s:
                continue
            self.fired = report(self.host, self.timeout_s, dump_stacks(beats), beats)
            self._on_hang()
            return
