"""The hang watchdog of one node: no progress for ``--hang-timeout`` seconds ends the job.

A rank makes progress when it completes a collective (its Flight Recorder, read through
its worker server: :mod:`.flight`) or, with the runtime, when its prepared loader yields a
batch (a heartbeat file: :mod:`disttrain.runtime.heartbeat`). A rank that has done neither
yet (importing, loading data, compiling) does not arm the watchdog.

Alone (one node, no launcher above it), the watchdog judges: when none of the node's ranks
moved for the timeout it collects every rank's recorder and stack (:mod:`.hang`), prints the
verdict (:mod:`.verdict`) and stops the workers. Under a launcher it only reports: the ranks'
progress each second (:class:`~disttrain.wire.Beats`), and when the launcher, which sees every
host, asks (:meth:`Watchdog.dump`), its ranks' states (:class:`~disttrain.wire.HangReport`); the
launcher then stops every node.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from ..wire import Beats, HangReport
from ..workerenv import rank_file
from .flight import Recorders
from .hang import Worker, collect
from .verdict import verdict

HANG_EXIT = 124  # as timeout(1): the job ran out of time, nothing crashed
POLL_S = 1.0


@dataclass(frozen=True)
class Beat:
    rank: int
    pid: int
    stacks: Path
    mtime: float  # the rank's last progress (this host's clock)
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


def merged(beats: list[Beat], recorded: dict[int, tuple[int, object, float]], stacks_of) -> list[Beat]:
    """One beat per rank from its heartbeat file and its recorder: the later progress of the two;
    the loader's steps where the runtime counts them, else the collectives completed."""
    out = {b.rank: b for b in beats}
    for rank, (pid, progress, since) in recorded.items():
        beat = out.get(rank)
        if beat is None:
            out[rank] = Beat(rank, pid, stacks_of(rank), since, progress.completed)
        elif since > beat.mtime:
            out[rank] = Beat(rank, beat.pid, beat.stacks, since, beat.steps)
    return [out[rank] for rank in sorted(out)]


def _workers() -> list[tuple[int, int, str]]:
    """(rank, pid, process status) of this agent's live workers: its children with a ``RANK`` (the
    lifeline wrapper execs the worker in its own place, so each worker is a child)."""
    out = []
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return out
    for child in children:
        try:
            status = child.status()
            rank = child.environ().get("RANK") if status != psutil.STATUS_ZOMBIE else None
        except psutil.Error:
            continue
        if rank is not None and rank.isdigit():
            out.append((int(rank), child.pid, status))
    return out


def worker_children() -> dict[int, int]:
    """rank -> pid of this agent's workers still running."""
    return {rank: pid for rank, pid, _status in _workers()}


def stopped_ranks() -> tuple[int, ...]:
    """This agent's workers stopped by a signal (SIGSTOP, SIGTSTP, a suspend): alive, not running. A
    debugger's stop (tracing) is not among them: someone is looking at that rank."""
    return tuple(sorted(rank for rank, _pid, status in _workers() if status == psutil.STATUS_STOPPED))


def freshest(beats: list[Beat]) -> float | None:
    """The most recent progress of any rank (None when none beat yet: the watchdog is not armed)."""
    return max((b.mtime for b in beats), default=None)


def stalled(last_progress: float, now: float, timeout_s: float) -> float | None:
    """The stall rule, the same for a node alone and for the launcher (which sees every host): the
    seconds since the last progress once they reach the timeout, else None."""
    quiet = now - last_progress
    return quiet if timeout_s and quiet >= timeout_s else None


def beats_line(host: str, beats: list[Beat], now: float, stopped: tuple[int, ...] = ()) -> str:
    """What the launcher needs from this node each second (:class:`~disttrain.wire.Beats`)."""
    return Beats(host=host, ranks={b.rank: (b.steps, round(now - b.mtime, 2)) for b in beats},
                 stopped=stopped).to_line()


class Attempt:
    """The workers of the current attempt, as torch's agent starts them (its ``on_envs`` hook)."""

    def __init__(self, run_dir: str, world_size: int) -> None:
        self.run_dir, self.number, self.world_size = Path(run_dir), 0, world_size
        self.ranks: tuple[int, ...] = ()

    def __call__(self, envs: dict[int, dict[str, str]], attempt: int) -> None:
        self.number = attempt
        self.ranks = tuple(sorted(int(env["RANK"]) for env in envs.values()))
        self.world_size = int(next(iter(envs.values())).get("WORLD_SIZE", self.world_size)) if envs else self.world_size

    def stacks(self, rank: int) -> Path:
        return rank_file(self.run_dir, rank, self.number, "stacks")


class Watchdog:
    """Polls the node's ranks in a daemon thread; ``fired`` holds the verdict once it fired.

    ``report_to_launcher``: the node is one of several; instead of judging alone, it sends its
    ranks' progress to the launcher each second, and their states when the launcher asks.
    """

    def __init__(self, folder: str, timeout_s: float, host: str, on_hang, *, attempt: Attempt,
                 recorders: Recorders | None = None, dist_backend: str = "gloo", report_to_launcher=None) -> None:
        self.folder = Path(folder)
        self.timeout_s = timeout_s
        self.host = host
        self.attempt = attempt
        self.recorders = recorders
        self.dist_backend = dist_backend
        self.fired: str | None = None
        self._on_hang = on_hang
        self._report = report_to_launcher
        self._lock = threading.Lock()  # the poll thread and a launcher's request both read the ranks
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disttrain-hang-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def beats(self, now: float | None = None) -> list[Beat]:
        recorded = self.recorders.poll(now) if self.recorders is not None else {}
        return merged(live_beats(self.folder), recorded, self.attempt.stacks)

    def workers(self) -> list[Worker]:
        """Every rank of the attempt, with what is known of it (pid, socket, heartbeat)."""
        served = self.recorders.sockets() if self.recorders is not None else {}
        beats = {b.rank: b for b in live_beats(self.folder)}
        children = worker_children()
        ranks = sorted(set(self.attempt.ranks) | set(served) | set(beats))
        out = []
        for rank in ranks:
            pid, sock = served.get(rank, (None, None))
            beat = beats.get(rank)
            pid = children.get(rank, pid if pid is not None else beat.pid if beat is not None else None)
            out.append(Worker(rank=rank, pid=pid, socket=sock,
                              stacks=beat.stacks if beat is not None else self.attempt.stacks(rank)))
        return out

    def dump(self) -> None:
        """The launcher saw no progress anywhere: send this node's ranks' states. The workers stay
        until the launcher stops the node, once every host reported (or its grace ran out): a node
        that stopped them at once broke its peers' collectives before their agents looked, and a
        slower host's rank then seemed in none (a Slurm verdict under load missed its mismatch)."""
        with self._lock:
            if self.fired is not None:
                return
            states = collect(self.workers(), host=self.host, dist_backend=self.dist_backend)
            self._report(HangReport(host=self.host, ranks=tuple(states)).to_line())
            self.fired = ""  # the launcher prints the verdict

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            with self._lock:
                if self.fired is not None:
                    return
                beats = self.beats()
                if self._report is not None:
                    self._report(beats_line(self.host, beats, time.time(), stopped_ranks()))  # also when empty
                    continue
                last = freshest(beats)
                if last is None or stalled(last, time.time(), self.timeout_s) is None:
                    continue
                states = collect(self.workers(), host=self.host, dist_backend=self.dist_backend)
                self.fired = verdict(states, world_size=self.attempt.world_size, timeout_s=self.timeout_s)
            self._on_hang()
            return
