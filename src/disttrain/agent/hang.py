"""This node's ranks at a hang, for the verdict: each one's recorder, stack and state.

Called by the watchdog when no rank moved for ``--hang-timeout`` (or when the launcher, which
sees every host, asks). Every rank's recorder dump and stacks are written next to its logs
(``attempt_<k>/rank<R>.fr.json``, ``rank<R>.stacks``), and kept; what the verdict needs of them
travels as :class:`~disttrain.wire.RankState`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil

from ..wire import RankState
from . import flight
from .stacks import NO_STACK, bootstrap_stacks, in_own_code, is_stopped, signalled_stacks, where
from .verdict import calls_from_recorder


@dataclass(frozen=True)
class Worker:
    """A rank of this node as the watchdog knows it."""

    rank: int
    pid: int | None
    stacks: Path  # where its stacks go: attempt_<k>/rank<R>.stacks
    socket: Path | None = None  # its worker server's, when the bootstrap started one


def dump_path(worker: Worker) -> Path:
    return worker.stacks.with_name(f"rank{worker.rank}.fr.json")


def _alive(pid: int | None) -> bool:
    try:
        return pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def collect(workers: Sequence[Worker], *, host: str, dist_backend: str) -> list[RankState]:
    """Every worker's state, the servers asked in parallel (a silent one costs its timeout once)."""
    for w in workers:
        w.stacks.parent.mkdir(parents=True, exist_ok=True)
    served = [w for w in workers if w.socket is not None and _alive(w.pid) and not is_stopped(w.pid)]
    # The bootstrap's own dump first: it answers without the GIL, and never disturbs the main thread.
    dumped = bootstrap_stacks([(w.rank, w.pid, w.socket.with_suffix(".stacks")) for w in served])

    def ask(w: Worker) -> flight.RankDump:
        return flight.dump(w.socket, dist_backend, stacks=w.rank not in dumped)

    with ThreadPoolExecutor(max_workers=max(1, len(served))) as pool:
        dumps = dict(zip((w.rank for w in served), pool.map(ask, served)))
    # Ranks without either (no server, or it said nothing): py-spy, or the runtime's SIGUSR1 if caught.
    unserved = [w for w in workers if _alive(w.pid) and not is_stopped(w.pid) and w.rank not in dumped
                and (w.rank not in dumps or dumps[w.rank].stacks is None)]
    signalled = {**dumped, **(signalled_stacks([(w.rank, w.pid, w.stacks) for w in unserved]) if unserved else {})}
    states = []
    for w in workers:
        base = {"rank": w.rank, "host": host, "pid": w.pid, "stacks": str(w.stacks)}
        if w.pid is None:  # no process of this rank to be seen (the agent knows its workers by pid)
            states.append(RankState(state="silent", **{**base, "stacks": ""}))
            continue
        if not _alive(w.pid):
            states.append(RankState(state="exited", **{**base, "stacks": ""}))
            continue
        if is_stopped(w.pid):
            states.append(RankState(state="stopped", **base))
            continue
        got = dumps.get(w.rank)
        text = signalled.get(w.rank) or (got.stacks if got else None) or ""
        if text:
            w.stacks.write_text(text)
        calls, groups, dump = (), {}, ""
        if got is not None and got.recorder is not None:
            dump_path(w).write_text(json.dumps(got.recorder))
            calls, dump = calls_from_recorder(got.recorder), str(dump_path(w))
        if got is not None and got.groups:
            groups = {name: tuple(g.get("ranks", ())) for name, g in got.groups.items() if isinstance(g, dict)}
        state = "running" if text or calls else "silent"
        states.append(RankState(state=state, where=where(text) if text else NO_STACK, own_code=in_own_code(text),
                                calls=calls, groups=groups, dump=dump, **base))
    return states
