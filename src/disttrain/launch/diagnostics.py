"""Diagnostics across hosts, at the launcher: one hang watchdog, stragglers, steps/s per host.

Each node's agent sends its ranks' heartbeats (step count, age of the last progress) once a
second on stderr (:class:`disttrain.wire.Beats`); only the launcher sees every
host, so only it can tell that *no rank anywhere* moved for ``--hang-timeout`` seconds (a rank
on host b stuck in its own code, the others waiting for it in a collective), or that one rank
is slower than the rest. Ages, not timestamps, travel: the hosts' clocks need not agree.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

from ..wire import Beats, WireError

STRAGGLER_FACTOR = 1.3  # a rank this much slower than the median step time is named
WINDOW_S = 20.0  # step rates are measured over this much recent time
MIN_WINDOW_S = 6.0  # and judged only once this much is seen
# A host whose beats stopped this long before the summary (its agent stopped or cut off): its rate
# covers only the time it was heard, which the summary says beside it.
SILENT_S = 10.0


class Diagnostics:
    """Stragglers and steps/s per host from the agents' beats. Whether no rank moved at all (the
    hang) is the supervisor's rule (:class:`~disttrain.launch.policies.HangWatch`); ``late()``
    says whether an agent's word is late, which freezes its ranks' rates (the supervisor's clock)."""

    def __init__(self, *, say, late=lambda: False, clock=time.monotonic) -> None:
        self.say = say
        self.clock = clock
        self.hosts: dict[int, str] = {}  # rank -> host
        self.history: dict[int, deque[tuple[float, int]]] = {}  # rank -> (time, steps)
        self.first: dict[int, tuple[float, int]] = {}
        self.named: set[int] = set()  # stragglers already reported: once each, not every step
        self.late = late

    def reset(self) -> None:
        """A new round of an elastic job: other ranks, whose step counts start again."""
        self.hosts.clear()
        self.history.clear()
        self.first.clear()
        self.named.clear()

    def consume(self, line: str) -> bool:
        """True when ``line`` was an agent's heartbeat summary (not shown to the user)."""
        if not Beats.matches(line):
            return False
        try:
            beats = Beats.from_line(line)
        except WireError:  # not ours after all (another version's): shown to the user as it came
            return False
        now = self.clock()
        for rank, (steps, _age) in beats.ranks.items():
            self.hosts[rank] = beats.host
            hist = self.history.setdefault(rank, deque())
            hist.append((now, steps))
            while hist and now - hist[0][0] > WINDOW_S:
                hist.popleft()
            self.first.setdefault(rank, (now, steps))
        self._stragglers()
        return True

    def _rates(self) -> dict[int, float]:
        rates = {}
        for rank, hist in self.history.items():
            (t0, s0), (t1, s1) = hist[0], hist[-1]
            if t1 - t0 >= MIN_WINDOW_S:
                rates[rank] = (s1 - s0) / (t1 - t0)
        return rates

    def _stragglers(self) -> None:
        # A host that fell silent freezes its ranks' rates at their last value while the others,
        # waiting for it in a collective, slow to nothing: no rate says anything then.
        if self.late():
            return
        rates = self._rates()
        if len(rates) < 2:
            return
        median = statistics.median(rates.values())
        if median <= 0:
            return
        for rank, rate in sorted(rates.items()):
            if rank in self.named:
                continue
            slower = median / rate if rate > 0 else float("inf")
            if slower >= STRAGGLER_FACTOR:
                self.named.add(rank)
                times = "no steps" if rate <= 0 else f"{slower:.1f}x the median step time ({1 / rate:.3f} s vs {1 / median:.3f} s)"
                self.say(f"disttrain: warning: straggler: rank {rank} on {self.hosts[rank]} is slower than the others: "
                         f"{times} over the last {WINDOW_S:.0f} s")

    def summary(self) -> str | None:
        """``steps/s per host: a 3.91 (ranks 0-1), b 3.88 (ranks 2-3)``; None without heartbeats."""
        per_host: dict[str, list[float]] = {}
        ranks_of: dict[str, list[int]] = {}
        heard: dict[str, float] = {}  # host -> when its last beat came
        for rank, (t0, s0) in sorted(self.first.items()):
            t1, s1 = self.history[rank][-1]
            if t1 - t0 <= 0:
                continue
            host = self.hosts[rank]
            per_host.setdefault(host, []).append((s1 - s0) / (t1 - t0))
            ranks_of.setdefault(host, []).append(rank)
            heard[host] = max(heard.get(host, t1), t1)
        if not per_host:
            return None
        now = self.clock()
        parts = [f"{host} {statistics.mean(rates):.2f} (rank{'s' if len(ranks_of[host]) > 1 else ''} "
                 f"{','.join(map(str, ranks_of[host]))}"
                 f"{f'; no beat in the last {now - heard[host]:.0f} s' if now - heard[host] >= SILENT_S else ''})"
                 for host, rates in per_host.items()]
        return "disttrain: steps/s per host (each rank's mean): " + ", ".join(parts)
