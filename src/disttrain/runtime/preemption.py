"""SIGTERM and Ctrl-C (SIGINT) as a request to stop at the next step boundary, agreed on
by every rank.

A cluster that preempts a job sends SIGTERM and, some seconds later, SIGKILL; torch's
elastic agent does the same to its workers when ``disttrain run`` gets SIGTERM (the grace
is ``--stop-grace``), and passes a Ctrl-C on as SIGINT. Dying on the spot would lose the
steps since the last checkpoint, so while a :class:`~disttrain.runtime.resume.TrainingState`
has a checkpoint directory either signal only sets a flag; after each step the ranks
all-reduce it, so that all of them stop at the same step even when the signal reached them
at different moments, save there and exit with 128 + the signal (:data:`PREEMPTED_EXIT`
for SIGTERM, 130 for Ctrl-C). Ctrl-C is treated like SIGTERM on purpose: a run stopped by
hand resumes where it stopped, as a preempted one does. A second Ctrl-C does not wait for
the step to end: it interrupts at once (a rank stuck in a collective), without saving.
Without a checkpoint directory nothing is handled: Ctrl-C interrupts, and ``init()``
reports it in one line per rank rather than a traceback.

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
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_requested = 0  # the first stop signal's number; 0: none
_previous: dict[int, Any] = {}
_installed = False


def _on_signal(signum: int, frame: Any) -> None:
    global _requested
    if _requested and signum == signal.SIGINT:
        raise KeyboardInterrupt  # Ctrl-C again: now, not at the end of the step
    _requested = _requested or signum


def install() -> bool:
    """Turn SIGTERM and SIGINT into a stop request; False where signals cannot be handled
    (a thread)."""
    global _previous, _installed
    if _installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    _previous = {sig: signal.signal(sig, _on_signal) for sig in STOP_SIGNALS}
    _installed = True
    return True


def uninstall() -> None:
    """Give the signals back their previous handlers and forget any request."""
    global _previous, _installed, _requested
    if _installed:
        for sig, previous in _previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
    _previous, _installed, _requested = {}, False, 0


def requested() -> int:
    """The stop signal this process got first, 0 for none (not a collective)."""
    return _requested


def describe(signum: int) -> str:
    """How the stop line names a stop signal."""
    return "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name


class WorkerInit:
    """A DataLoader ``worker_init_fn``: if the parent handles SIGTERM, survive the agent's,
    then run the user's own function (a class, not a closure, so that it pickles for spawn)."""

    def __init__(self, user_fn: Any = None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        if _installed:  # inherited from the parent through fork
            _exit_on_sigterm_from_parent_only()
            # Ctrl-C reaches the whole process group: the parent stops at its step's end and
            # needs its workers until then (torch's would end quietly, and the parent fail).
            signal.signal(signal.SIGINT, signal.SIG_IGN)
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
    """One all-reduce per step: on every rank, the stop signal as soon as any rank got one
    (SIGTERM over SIGINT), else 0.

    ``group`` is a CPU (gloo) group, so that with NCCL the vote does not synchronise the
    host with the GPU on every step.
    """

    def __init__(self, group: Any = None, *, distributed: bool) -> None:
        self._group = group
        self._distributed = distributed
        self._flag = torch.zeros(1, dtype=torch.int32)

    def __call__(self) -> int:
        if not self._distributed:
            return _requested
        self._flag.fill_(_requested)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(self._flag.item())
