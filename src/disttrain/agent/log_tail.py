"""The workers' output tails end as soon as their worker group is closed, not at their next look.

torch's agent copies each teed worker log to the terminal with one thread per file (``TailLog``)
that looks for new lines every 0.1 s and sleeps in between. Closing the group tells each thread
to finish, and waits for the stdout tails and then the stderr tails: each thread first ends its
sleep, so a run that succeeded still waited up to 0.1 s per stream after its last worker exited
(disttrain tees every stream, so every run paid it; torchrun pays it only with ``--tee``).

Here each thread waits between looks on the very event that tells it to finish: it wakes at
once, reads what is left to the end of the file, and ends. Every line is still delivered; the
look interval while the workers run is torch's.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterator
from threading import Event
from typing import TextIO

from ..wire import for_people

# What torch's TailLog passes to its tail function; another signature keeps torch's own.
_PARAMETERS = ("header", "file", "dst", "finished", "interval_sec", "log_line_filter")


def tail_until_finished(header: str, file: str, dst: TextIO, finished: Event, interval_sec: float,
                        log_line_filter: Callable[[str], bool] | None = None, *, terminal: bool = True) -> None:
    """Copy ``file``'s lines to ``dst``, each after ``header`` (those ``log_line_filter`` keeps; never a
    wire message when ``dst`` is a terminal -- a track line is for the tracker, which reads the file; an
    agent under a launcher passes it on, its output being the launcher's channel),
    until ``finished`` is set and the file is read to its end; the file may not exist yet."""
    while not os.path.exists(file):
        if finished.is_set():  # the producer never wrote it
            return
        finished.wait(interval_sec)

    def copy(line: str) -> None:
        if (not terminal or for_people(line)) and (log_line_filter is None or log_line_filter(line)):
            dst.write(header + line)

    with open(file, errors="replace") as fh:
        part = ""  # a line whose end is not written yet: copied whole, with one header (torch's copies each piece)
        while True:
            part += fh.readline()
            if part.endswith("\n"):
                copy(part)
                part = ""
            elif finished.is_set():  # at the end of a file no one writes any more
                if part:
                    copy(part)
                return
            else:
                finished.wait(interval_sec)  # new lines, or the stop: whichever comes first


@contextlib.contextmanager
def tails_end_at_once(*, terminal: bool = True) -> Iterator[None]:
    """torch's log tails use :func:`tail_until_finished` for the life of the block (this process
    runs one node); a torch whose tail function takes other arguments is left as it is. ``terminal``:
    the tails write to the user's terminal (no launcher above reads them), so no wire line is shown."""
    from torch.distributed.elastic.multiprocessing import tail_log

    original = tail_log.tail_logfile
    if tuple(inspect.signature(original).parameters) != _PARAMETERS:
        yield
        return
    tail_log.tail_logfile = tail_until_finished if terminal else functools.partial(tail_until_finished, terminal=False)
    try:
        yield
    finally:
        tail_log.tail_logfile = original
