"""A rank that finished its script and then died in torch's teardown is a finished rank.

torch sometimes aborts a worker *after* the script's last line (``dist.destroy_process_group()``):
gloo's worker threads, kept alive by the DDP model the script still holds, free a finished
collective's work on their own and take the GIL to do it; one that asks for it once the
interpreter's finalization has begun is unwound inside a C++ destructor, and the process dies by
SIGABRT printing ``terminate called without an active exception`` (seen on the c10d rendezvous
path in about 1 run of 4; plain torchrun does it too). The training is done and saved, but the
exit code says failed, and a job would be recorded Failed.

Prevented where it can be: the worker bootstrap (``disttrain/_worker_site``) runs, after the
script's own ``atexit`` handlers, a ``gc.collect()`` and a short sleep in a process that used
torch.distributed while threads torch started are alive (none are once ``destroy_process_group``
freed the group), so those threads finish while the interpreter is whole. Told apart where it
still happens: the bootstrap first writes ``local<LOCAL_RANK>.<pid>`` in :data:`EXIT_MARKS`'
folder, only when the script ended without an unhandled exception and without a non-zero
``sys.exit``. Here, torch's worker group counts a rank that died by SIGABRT *with* its mark as
finished (exit code 0) and says so in one line; without the mark -- an abort while the script
still ran -- it is a failure as before. The other ranks are not stopped for it, so the job
completes only when every rank has finished.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

from .flight import SITE_DIR

EXIT_MARKS = "DISTTRAIN_EXIT_MARKS"  # the folder the workers' marks go to (the bootstrap reads it)
ABORTED = (-int(signal.SIGABRT), 128 + int(signal.SIGABRT))  # killed by the signal, or a shell's 134


def mark_path(folder: str | os.PathLike, local_rank: int, pid: int) -> Path:
    """Where the worker ``pid`` (local rank ``local_rank``) marks that its script returned."""
    return Path(folder) / f"local{local_rank}.{pid}"


def worker_env(folder: str, inherited: dict[str, str]) -> dict[str, str]:
    """The marks' folder, and the bootstrap first on ``PYTHONPATH`` (once, whoever put it there)."""
    path = inherited.get("PYTHONPATH") or ""
    if str(SITE_DIR) not in path.split(os.pathsep):
        path = f"{SITE_DIR}{os.pathsep}{path}" if path else str(SITE_DIR)
    return {"PYTHONPATH": path, EXIT_MARKS: folder}


def finished_then_aborted(exitcode: int | None, local_rank: int, pid: int, folder: str | os.PathLike) -> bool:
    """Whether a worker that exited with ``exitcode`` is a SIGABRT after its script returned (its mark is there)."""
    return exitcode in ABORTED and mark_path(folder, local_rank, pid).exists()


@contextlib.contextmanager
def aborts_after_return(env: dict[str, str], say, folder: Path) -> Iterator[None]:
    """For the life of the block (this process runs one node's workers): the marks' ``folder`` (made here,
    in the node's scratch folder, which the agent removes) in ``env`` (the workers' environment), and
    torch's worker group counting a rank that aborted after its script returned as finished, ``say``-ing
    so in one line.

    The hook is ``SubprocessContext._poll``, which every torch of the supported range has: before torch
    looks at its running workers, such a rank leaves them as done (not failed), so the others run to
    their own end."""
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    folder.mkdir()
    env.update(worker_env(str(folder), {**os.environ, **env}))
    original = SubprocessContext._poll

    def poll(self):
        for local_rank in list(self._running_local_ranks):
            proc = self.subprocess_handlers[local_rank].proc
            exitcode = proc.poll()
            if finished_then_aborted(exitcode, local_rank, proc.pid, folder):
                self._running_local_ranks.discard(local_rank)
                rank = (self.envs.get(local_rank) or {}).get("RANK", f"local {local_rank}")
                say(f"disttrain: rank {rank} finished its script, then died by SIGABRT in torch's teardown at "
                    f"exit (exit code {exitcode}: `terminate called without an active exception`); "
                    "counted as finished")
        return original(self)

    SubprocessContext._poll = poll
    try:
        yield
    finally:
        SubprocessContext._poll = original


__all__ = ["ABORTED", "EXIT_MARKS", "aborts_after_return", "finished_then_aborted", "mark_path", "worker_env"]
