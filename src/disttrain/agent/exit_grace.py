"""A moment for the other workers to end on their own once one has failed.

torch's agent stops the rest of a worker group (SIGTERM) at the first poll that sees a failure.
A rank that leaves early with code 0 closes its connections first and exits a little later
(the interpreter's teardown): its peer fails on the closed connection, and the agent's SIGTERM
then reaches a rank that was already on its way out, which is recorded as stopped by the agent
-- and the report blames the peer instead of the rank that left. Waiting up to
:data:`EXIT_GRACE_S` for the others to end by themselves, before the signal, lets such a rank's
own exit code stand. Ranks still running after it are stopped as before.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

EXIT_GRACE_S = 1.0
_POLL_S = 0.02


@contextlib.contextmanager
def exits_awaited() -> Iterator[None]:
    """torch's subprocess worker group waits :data:`EXIT_GRACE_S` after a failure before it stops
    the others (for the life of the block: this process runs one node)."""
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    original = SubprocessContext._close

    def close(self, death_sig, timeout: int = 30) -> None:
        if getattr(self, "_failures", None):
            deadline = time.monotonic() + EXIT_GRACE_S
            while time.monotonic() < deadline and any(
                    h.proc.poll() is None for h in self.subprocess_handlers.values()):
                time.sleep(_POLL_S)
        original(self, death_sig, timeout)

    SubprocessContext._close = close
    try:
        yield
    finally:
        SubprocessContext._close = original
