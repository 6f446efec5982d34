"""A transcript that also hands each complete line to a reader, timed as written: how the job's
metric definitions and the run's tracker read a launch's output without a hook in the launchers
(every launcher writes what it relays to ``Events.transcript``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TextIO


class Tapped:
    """``out`` (or nothing), with each complete line written to it also given to ``sink(time, line)``;
    with ``keep``, only each line's last ``keep`` characters (a line without end is not kept whole)."""

    def __init__(self, out: TextIO | None, sink: Callable[[float, str], None], *, keep: int | None = None) -> None:
        self._out, self._sink, self._keep = out, sink, keep
        self._partial = ""
        self._lock = threading.Lock()  # the relay writes from one thread per agent stream

    def write(self, text: str) -> int:
        written = self._out.write(text) if self._out is not None else len(text)
        with self._lock:
            lines = (self._partial + text).split("\n")
            self._partial = lines.pop()
            if self._keep is not None:
                self._partial = self._partial[-self._keep:]
                lines = [line[-self._keep:] for line in lines]
            now = time.time()
            for line in lines:
                self._sink(now, line)
        return written

    def flush(self) -> None:
        if self._out is not None:
            self._out.flush()

    def __getattr__(self, name: str):
        return getattr(self._out, name)  # close, name...
