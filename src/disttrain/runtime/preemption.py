"""SIGTERM as a request to stop at the next step boundary, agreed on by every rank.

A cluster that preempts a job sends SIGTERM and, some seconds later, SIGKILL; torch's
elastic agent does the same to its workers when ``disttrain run`` gets SIGTERM (the grace
is ``--stop-grace``). Dying on the spot would lose the steps since the last checkpoint, so
while a :class:`~disttrain.runtime.resume.TrainingState` has a checkpoint directory the
signal only sets a flag; after each step the ranks all-reduce it, so that all of them stop
at the same step even when the signal reached them at different moments, save there and
exit with :data:`PREEMPTED_EXIT`.

The agent sends SIGTERM to each worker's whole process group, DataLoader workers
included, and torch makes those die of a SIGTERM that does not come from their parent --
which would crash the training process mid-step. :class:`WorkerInit`, the
``worker_init_fn`` of every loader :func:`disttrain.prepare` returns, makes them ignore it
while their parent handles it; they still exit with their parent.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

# 128 + SIGTERM: what a shell reports for a process SIGTERM killed. Not 0, so that neither
# the elastic agent nor a scheduler mistakes a preempted run for a finished one.
PREEMPTED_EXIT = 128 + int(signal.SIGTERM)

_requested = False
_previous: Any = None
_installed = False


def _on_sigterm(signum: int, frame: Any) -> None:
    global _requested
    _requested = True


def install() -> bool:
    """Turn SIGTERM into a stop request; False where signals cannot be handled (a thread)."""
    global _previous, _installed
    if _installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    _previous = signal.signal(signal.SIGTERM, _on_sigterm)
    _installed = True
    return True


def uninstall() -> None:
    """Give SIGTERM back its previous handler and forget any request."""
    global _previous, _installed, _requested
    if _installed:
        signal.signal(signal.SIGTERM, _previous if _previous is not None else signal.SIG_DFL)
    _previous, _installed, _requested = None, False, False


def requested() -> bool:
    """Whether this process got SIGTERM (not a collective)."""
    return _requested


class WorkerInit:
    """A DataLoader ``worker_init_fn``: if the parent handles SIGTERM, survive the agent's,
    then run the user's own function (a class, not a closure, so that it pickles for spawn)."""

    def __init__(self, user_fn: Any = None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        if _installed:  # inherited from the parent through fork
            _exit_on_sigterm_from_parent_only()
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _exit_on_sigterm_from_parent_only() -> None:
    """What torch does in a DataLoader worker, minus dying of anyone else's SIGTERM.

    Not ``SIG_IGN``: the parent's own SIGTERM must still end the worker, or a training
    process exiting on an error (multiprocessing terminates, then joins its workers) waits
    until the agent kills it. Only a waiting thread sees who sent the signal.
    """
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait() -> None:
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
                os._exit(0)

    threading.Thread(target=wait, name="disttrain-worker-sigterm", daemon=True).start()


def worker_init(user_fn: Any) -> WorkerInit:
    """``user_fn`` wrapped in a :class:`WorkerInit` (once)."""
    return user_fn if isinstance(user_fn, WorkerInit) else WorkerInit(user_fn)


class StopVote:
    """One all-reduce per step: True on every rank as soon as any rank got SIGTERM.

    ``group`` is a CPU (gloo) group, so that with NCCL the vote does not synchronise the
    host with the GPU on every step.
    """

    def __init__(self, group: Any = None, *, distributed: bool) -> None:
        self._group = group
        self._distributed = distributed
        self._flag = torch.zeros(1, dtype=torch.int32)

    def __call__(self) -> bool:
        if not self._distributed:
            return _requested
        self._flag.fill_(int(_requested))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(self._flag.item())
