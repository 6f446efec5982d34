"""An agent's link to the launcher that started it (``disttrain agent``), once its node runs.

Up, on stderr (torch's log tailers share the stream: one write per line): the ranks' progress
each second and their states at a hang (the watchdog's), and :class:`~disttrain.wire.NodeDone`
when this node's workers all exited 0, and each elastic round's world (``AttemptStarted``). Down,
on stdin (read by :mod:`.entry`): the dump request (no progress on any host), the keep-alive, the
other nodes' ``NodeDone``, and an elastic job's ``Regroup`` (hosts were lost).

Why ``NodeDone`` travels: a rank that exits 0 early on one host makes its peers on another
fail with "Connection closed by peer"; only with the news that it left can their agent name it,
not them, as the cause (as an agent does for ranks of its own node).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

from ..wire import NodeDone
from .elastic_agent import Regroups
from .watchdog import Watchdog

PEER_NEWS_WAIT_S = 2.0  # how long a failure that lost a peer waits for the news of a peer done


class LauncherLink:
    """The node's role under a launcher (``disttrain agent``): its progress goes up, the launcher
    judges hangs and regroups; :class:`Standalone` is the role with no launcher above."""

    linked = True

    def __init__(self) -> None:
        self.dog: Watchdog | None = None
        self.stop_reason: str | None = None  # why the launcher stopped this node, once it did
        self._done: dict[int, str] = {}  # rank -> host: ranks of other nodes that exited 0
        self._news = threading.Event()
        self.regroups = Regroups()  # an elastic job's: the launcher's news of hosts lost

    def send(self, line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    say = send  # a line for the user: the launcher relays it

    def stopping(self, why: str) -> None:
        """The launcher stopped this node (closed its stdin, or fell silent): said so at the end,
        not as a signal the user might think they sent."""
        self.stop_reason = self.stop_reason or why

    def dump(self) -> None:
        if self.dog is not None:
            self.dog.dump()

    def peer_done(self, message: NodeDone) -> None:
        for rank in message.ranks:
            self._done[rank] = message.host
        self._news.set()

    def done_elsewhere(self, *, wait: bool) -> tuple[tuple[int, str], ...]:
        """(rank, host) of other nodes' ranks that exited 0; ``wait``: give the news a moment
        (the other agent saw its workers end about when ours failed)."""
        if wait and not self._done:
            self._news.wait(PEER_NEWS_WAIT_S)
        return tuple(sorted(self._done.items()))

    def watch_success(self, host: str, ranks: Callable[[], tuple[int, ...]], role: str) -> None:
        """Tell the launcher when this node's worker group succeeds: torch's agent says so through
        its metrics (``workers.<role>.succeeded``, torch.distributed.elastic.metrics), before it
        waits in its exit barrier for the other nodes."""
        from torch.distributed.elastic import metrics

        link = self

        class Succeeded(metrics.MetricHandler):
            def emit(self, metric_data) -> None:
                if metric_data.name == f"workers.{role}.succeeded":
                    link.send(NodeDone(host=host, ranks=ranks()).to_line())

        metrics.configure(Succeeded(), "torchelastic")


class Standalone:
    """A node with no launcher above it (the local launcher runs it in its own process): it judges
    its hangs itself (its watchdog), says its lines on stderr, and hears of no other node."""

    linked = False

    def __init__(self) -> None:
        self.dog: Watchdog | None = None
        self.stop_reason: str | None = None
        self.regroups = Regroups()  # nobody requests one

    def send(self, line: str) -> None:
        """A message for a launcher: there is none."""

    def say(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def dump(self) -> None: ...

    def done_elsewhere(self, *, wait: bool) -> tuple[tuple[int, str], ...]:
        return ()

    def watch_success(self, host: str, ranks: Callable[[], tuple[int, ...]], role: str) -> None:
        """No other node to tell."""


Role = LauncherLink | Standalone
