"""Until this node's workers start: say what the node waits for, and let Ctrl-C end the wait.

While torch's agent waits in the rendezvous its main thread is blocked inside the C++ store,
where Python never gets to run a signal handler: Ctrl-C used to be ignored until
``--rdzv-timeout``. Python's C-level handler still writes the signal number to a wakeup fd,
so a thread watching that fd can end the process at once; nothing has been started yet,
so there is nothing to stop. Once the workers start (or the launch ends) a byte on a second pipe
wakes that thread at once: the node's end never waits for its next half-second look.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from typing import TextIO

FIRST_PROGRESS_S = 5.0
PROGRESS_EVERY_S = 15.0


class RendezvousWait:
    """Context manager around the agent's launch; call :meth:`workers_started` when workers exist."""

    def __init__(self, what: str, *, timeout_s: float, report_to: TextIO) -> None:
        self.what = what
        self.timeout_s = timeout_s
        self.report_to = report_to
        self._started = threading.Event()
        self._done = threading.Event()
        self._pipe: tuple[int, int] | None = None
        self._saved_fd: int | None = None
        self._thread: threading.Thread | None = None
        self._wake = os.pipe()  # a byte here ends the watch's wait at once

    def workers_started(self) -> None:
        self._started.set()
        self._nudge()

    def _nudge(self) -> None:
        try:
            os.write(self._wake[1], b"x")
        except OSError:  # closed already (the block ended)
            pass

    def __enter__(self) -> "RendezvousWait":
        if threading.current_thread() is threading.main_thread():  # set_wakeup_fd is main-thread only
            self._pipe = os.pipe()
            os.set_blocking(self._pipe[1], False)
            self._saved_fd = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="disttrain-rdzv-wait", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._nudge()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._pipe is not None:
            signal.set_wakeup_fd(self._saved_fd if self._saved_fd is not None else -1)
            for fd in self._pipe:
                os.close(fd)
        for fd in self._wake:
            os.close(fd)

    def _say(self, text: str) -> None:
        print(f"disttrain: {text}", file=self.report_to, flush=True)

    def _watch(self) -> None:
        start = time.monotonic()
        next_progress = start + FIRST_PROGRESS_S
        # Nothing to do once the workers exist: a signal then is torch's agent's to handle.
        while not self._done.is_set() and not self._started.is_set():
            readable = [self._pipe[0]] if self._pipe else []
            ready, _, _ = select.select([*readable, self._wake[0]], [], [], 0.5)
            if self._pipe and self._pipe[0] in ready:
                signums = os.read(self._pipe[0], 64)
                if signums and not self._started.is_set():
                    signum = signums[-1]
                    name = signal.Signals(signum).name if signum in signal.Signals._value2member_map_ else signum
                    self._say(f"{name} while {self.what}; no worker was started")
                    os._exit(128 + signum)
            now = time.monotonic()
            if not self._started.is_set() and now >= next_progress:
                self._say(f"still {self.what} ({now - start:.0f} s of {self.timeout_s:.0f} s; Ctrl-C to stop)")
                next_progress = now + PROGRESS_EVERY_S
