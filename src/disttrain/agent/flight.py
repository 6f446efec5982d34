"""The agent's side of every rank's Flight Recorder: progress each second, the dumps at a hang.

Under ``--hang-timeout`` each worker runs torch's worker server on a Unix socket of this node
(started before the user's code by ``disttrain/_worker_site/sitecustomize.py``). Through it the
agent reads, without the rank's help:

* its progress: the collectives each of its process groups entered and completed (the
  recorder's ``pg_status``), once a second -- a plain torchrun script makes progress by its
  collectives, as a runtime script does by its loader batches. Only torch's own handlers, which
  run in C++, are asked this often: a handler written in Python takes the GIL from the server's
  thread, and one that lands while the worker's interpreter is exiting aborts the worker
  ("FATAL: exception not rethrown", seen here);
* at a hang: the whole recorder (kept next to the logs as ``rank<R>.fr.json``), the Python stack
  of every thread (``rank<R>.stacks``), and the members of every process group (the bootstrap's
  one Python handler: asked only then, of a rank that is stuck, not exiting). torch's server
  answers from a C++ thread, so a rank blocked in a collective answers too.

:func:`frontier` cuts a dump down to what the verdict needs (:mod:`disttrain.agent.verdict`).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..workerenv import HANG_SOCKETS

SITE_DIR = Path(__file__).resolve().parent.parent / "_worker_site"
POLL_TIMEOUT_S = 2.0
DUMP_TIMEOUT_S = 10.0
# The groups are a Python handler: a rank whose Python runs answers in milliseconds (the GIL changes
# hands every 5 ms); one stuck in C code holding the GIL never does, and waiting DUMP_TIMEOUT_S for
# it put the verdict 10 s past --hang-timeout. Without them the verdict knows the default group.
GROUPS_TIMEOUT_S = 1.0
# The handlers of torch's worker server that dump a rank's recorder: the CPU recorder (gloo), and
# NCCL's own in builds with CUDA.
FR_HANDLERS = {"nccl": "dump_nccl_trace_json"}
CPU_FR_HANDLER = "fr_trace_json"
FR_SINCE = "2.11"  # the first torch of the compat matrix whose worker server answers fr_trace_json (gloo)


def fr_handler(dist_backend: str) -> str:
    """The handler that dumps the recorder of ``dist_backend``'s process groups."""
    return FR_HANDLERS.get(dist_backend, CPU_FR_HANDLER)


def worker_env(*, sockets: str, inherited: Mapping[str, str]) -> dict[str, str]:
    """What this node's workers need for the hang diagnostics on top of the plan's environment
    (which sets the recorder's size and the process groups' timeout): the bootstrap first on
    ``PYTHONPATH`` -- this host's copy of disttrain, which the planner cannot know -- and the
    sockets' folder."""
    return {**site_env(inherited), HANG_SOCKETS: sockets}


def site_env(inherited: Mapping[str, str]) -> dict[str, str]:
    """The bootstrap first on the workers' ``PYTHONPATH`` (once, whoever put it there first)."""
    path = inherited.get("PYTHONPATH")
    if not path:
        return {"PYTHONPATH": str(SITE_DIR)}
    if path.split(os.pathsep)[0] == str(SITE_DIR):
        return {"PYTHONPATH": path}
    return {"PYTHONPATH": f"{SITE_DIR}{os.pathsep}{path}"}


class _Unix(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def fetch(sock: str | os.PathLike, handler: str, *, timeout: float = POLL_TIMEOUT_S, query: str = "") -> bytes | None:
    """One request to a rank's worker server; None when it does not answer (gone, busy, no server)."""
    conn = _Unix(os.fspath(sock), timeout)
    try:
        conn.request("POST", f"/handler/{handler}" + (f"?{query}" if query else ""))
        resp = conn.getresponse()
        body = resp.read()
        return body if resp.status == 200 else None
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


@dataclass(frozen=True)
class Progress:
    """A rank's collectives, summed over its process groups."""

    entered: int
    completed: int


def progress_of(status: Mapping) -> Progress:
    """From a recorder dump's ``pg_status``: ``{pg id: {"last_enqueued_collective": "4", ...}}``."""
    entered = completed = 0
    for group in status.values():
        entered += max(0, int(group.get("last_enqueued_collective", 0)))
        completed += max(0, int(group.get("last_completed_collective", 0)))
    return Progress(entered, completed)


@dataclass
class _Watched:
    pid: int
    progress: Progress
    since: float  # when the agent last saw it change (its clock)


class Recorders:
    """This node's ranks as their recorders say: which rank runs as which pid, and when each last
    completed a collective. A rank counts once it completed one (before that: imports, data)."""

    def __init__(self, folder: str, dist_backend: str, *, hang_timeout_s: float = 0, say=None) -> None:
        self.folder = Path(folder)
        self.dist_backend = dist_backend
        self.hang_timeout_s = hang_timeout_s
        self._say = say
        self._seen: dict[int, _Watched] = {}
        self._warned = False

    def sockets(self) -> dict[int, tuple[int, Path]]:
        """rank -> (pid, socket) of every rank whose worker started its server."""
        out = {}
        for pid_file in self.folder.glob("rank*.pid"):
            try:
                rank, pid = int(pid_file.stem[4:]), int(pid_file.read_text().strip())
            except (OSError, ValueError):
                continue
            sock = pid_file.with_suffix(".sock")
            if sock.exists():
                out[rank] = (pid, sock)
        return out

    def poll(self, now: float | None = None) -> dict[int, tuple[int, Progress, float]]:
        """rank -> (pid, progress, time of its last change) for the ranks that completed a collective."""
        now = time.time() if now is None else now
        for rank, (pid, sock) in self.sockets().items():
            body = fetch(sock, fr_handler(self.dist_backend))
            if body is None:
                continue
            try:
                recorder = json.loads(body)
                progress = progress_of(recorder.get("pg_status", {}))
            except (ValueError, TypeError, AttributeError):
                continue
            self._check_timeout(rank, recorder)
            seen = self._seen.get(rank)
            if seen is None or seen.pid != pid or seen.progress != progress:
                self._seen[rank] = _Watched(pid, progress, now)
        return {rank: (w.pid, w.progress, w.since) for rank, w in self._seen.items() if w.progress.completed > 0}

    def _check_timeout(self, rank: int, recorder: Mapping) -> None:
        """A group whose script chose a collective timeout below --hang-timeout (the bootstrap
        changes only torch's default): its timeout error would come first, without the verdict."""
        if self._warned or not self.hang_timeout_s or self._say is None:
            return
        short = [e for e in recorder.get("entries", ()) if 0 < int(e.get("timeout_ms") or 0) < self.hang_timeout_s * 1000]
        if short:
            self._warned = True
            group = (short[-1].get("process_group") or ["?"])[0]
            self._say(f"disttrain: warning: rank {rank}'s process group {group} times out after "
                      f"{int(short[-1]['timeout_ms']) / 1000:g} s (the script's own timeout=), before --hang-timeout "
                      f"{self.hang_timeout_s:g} s: a hang there ends in torch's timeout error, without the verdict")


@dataclass(frozen=True)
class RankDump:
    """What a rank's worker server said at the hang (None: it did not answer that part)."""

    recorder: dict | None
    stacks: str | None
    groups: dict[str, dict] | None


def dump(sock: str | os.PathLike, dist_backend: str, *, timeout: float = DUMP_TIMEOUT_S,
         stacks: bool = True) -> RankDump:
    """``stacks``: ask the server for them too (not when the bootstrap's signal dump gave them).
    The recorder is C++ and answers whatever the rank does; the stacks and the groups are Python
    handlers: a rank that holds the GIL answers neither, and once the one times out the other is
    not waited for as well."""
    def as_json(body: bytes | None):
        try:
            return json.loads(body) if body is not None else None
        except ValueError:
            return None

    recorder = as_json(fetch(sock, fr_handler(dist_backend), timeout=timeout))
    text = fetch(sock, "dump_traceback", timeout=timeout) if stacks else None
    groups = as_json(fetch(sock, "disttrain_groups", timeout=min(timeout, GROUPS_TIMEOUT_S))) \
        if text is not None or not stacks else None
    return RankDump(recorder, None if text is None else text.decode(errors="replace"), groups)
