"""A moment for the other workers to end on their own once one has failed.

torch's agent stops the rest of a worker group (SIGTERM) at the first poll that sees a failure.
A rank that leaves early with code 0 closes its connections first and exits a little later
(the interpreter's teardown): its peer fails on the closed connection, and the agent's SIGTERM
then reaches a rank that was already on its way out, which is recorded as stopped by the agent
-- and the report blames the peer instead of the rank that left. Waiting up to
:data:`EXIT_GRACE_S` for the others to end by themselves, before the signal, lets such a rank's
own exit code stand. Ranks still running after it are stopped as before.

When the launcher stops the node (another node failed first, as far as the launcher heard), the
ranks that had already failed here on their own are kept (:class:`FailedBeforeStop`): the agent
reports them with their times, and the launcher may find one of them was the root cause.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator

EXIT_GRACE_S = 1.0
_POLL_S = 0.02


class FailedBeforeStop:
    """The workers that had exited non-zero when their group was stopped: ``(rank, exit code, pid)``."""

    def __init__(self) -> None:
        self.failed: list[tuple[int, int, int]] = []
        self._context = None

    def note(self, context) -> None:
        """Each time a worker group is closed: a new group (a restart) starts afresh; the same one
        closed again keeps what its first close saw (its SIGTERMs are the stop's own)."""
        found = [(int(context.envs.get(local_rank, {}).get("RANK", local_rank)), handler.proc.returncode,
                  handler.proc.pid)
                 for local_rank, handler in context.subprocess_handlers.items()
                 if handler.proc.poll() not in (None, 0, -signal.SIGTERM)]
        if context is not self._context:
            self._context, self.failed = context, found
        elif found and not self.failed:
            self.failed = found


@contextlib.contextmanager
def exits_awaited() -> Iterator[FailedBeforeStop]:
    """torch's subprocess worker group waits :data:`EXIT_GRACE_S` after a failure before it stops
    the others (for the life of the block: this process runs one node)."""
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    original = SubprocessContext._close
    early = FailedBeforeStop()

    def close(self, death_sig, timeout: int = 30) -> None:
        early.note(self)  # before any signal of the stop: these ended by themselves
        if getattr(self, "_failures", None):
            deadline = time.monotonic() + EXIT_GRACE_S
            while time.monotonic() < deadline and any(
                    h.proc.poll() is None for h in self.subprocess_handlers.values()):
                time.sleep(_POLL_S)
        original(self, death_sig, timeout)

    SubprocessContext._close = close
    try:
        yield early
    finally:
        SubprocessContext._close = original
