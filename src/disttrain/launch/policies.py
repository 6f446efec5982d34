"""The supervisor's policies (:class:`~disttrain.launch.supervision.Supervisor` asks each, in order,
what an event means): :class:`FailFast` (without a range: the first agent that does not end well
ends the job), :class:`Elastic` (``--nnodes MIN:MAX``: a lost host is left behind while MIN remain;
which hosts are tried, and when (:class:`Backoff`), and which join together (:class:`JoinWindow`);
in place or restart, and each round's number), :class:`HangWatch` (one stall rule for every rank,
paused while a regroup forms).

Each returns a decision of :mod:`.supervision`'s, or None; no I/O. The tests drive them through a
supervisor with fake agents and a fake clock.
"""

from __future__ import annotations

import signal
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..agent.watchdog import stalled
from ..wire import InPlace
from .supervision import (
    LATE_S,
    Admit,
    Agent,
    AgentState,
    Decision,
    Dump,
    Event,
    EventKind,
    Held,
    Join,
    Probe,
    RegroupWithout,
    Slow,
    Stop,
    Supervisor,
)

SLOW_S = 60.0  # an agent whose connection its transport keeps alive (ssh) is slow, not lost, up to this
# ...unless its host takes no TCP connection: asked once the agent has said nothing for PROBE_AFTER_S
# (or 1.5 times its longest recent gap, on a loaded host), given PROBE_TIMEOUT_S. A machine that
# lost power or its network answers nothing (ssh's keep-alives would say so only after 3-4 s); a
# live one's kernel answers at once, however loaded.
PROBE_AFTER_S = 1.3
PROBE_TIMEOUT_S = 0.8
FLAP_WINDOW_S = 60.0  # a host lost within this long of its first step (or before one) is flapping
BACKOFF_FIRST_S = 10.0  # the wait before admitting a flapping host again: this, doubled each flap,
BACKOFF_MAX_S = 120.0  # up to this
RETRY_S = 3.0  # a host not running is tried this long after it was seen out, and again after each miss,
RETRY_FAST_S = 90.0  # for this long (a late boot, not a dead host); then twice as long after each miss,
RETRY_MAX_S = 30.0  # up to this. Each wait is stretched by the host's own factor (retry_phase)
REGROUP_MARGIN_S = 15.0  # a regroup forms within the rendezvous timeout plus this, or the job stops
# Hosts that answer the preflight are let in together, as torch's last_call_timeout batches the
# nodes of a rendezvous: a batch goes once no other host answered for JOIN_QUIET_S (or for twice
# the longest of the last 8 gaps between answers, up to JOIN_PACE_MAX_S: hosts booting one by one keep coming
# at their own pace), or JOIN_HOLD_S after its first answered (however many keep coming), and
# never while a round forms -- so N staggered arrivals cost about span / JOIN_HOLD_S + 1 rounds.
# While hosts of the range that never joined are still booting (seen out less than RETRY_FAST_S),
# only the hold lets a batch go: the others of a late boot are waited for, not let in one by one.
# A batch that fills the job to its maximum goes at once: nobody else can come.
JOIN_QUIET_S = 2.0
JOIN_PACE_MAX_S = 12.0
JOIN_HOLD_S = 30.0
# A round forms until its ranks step: a batch let in before would find workers still starting, not
# yet able to take a regroup in place, and restart everyone. Not waited for past this (a script
# whose ranks never report a step).
TRAINS_WITHIN_S = 30.0


def retry_phase(host: str) -> float:
    """Host ``host``'s own factor on its retry waits, 0.5 to 1.5, fixed by its name: hosts seen out
    together are tried spread over time, not in waves (whose answers would split the join
    window's batches, as the gaps between waves look like the end of a boot)."""
    return 0.5 + zlib.crc32(host.encode()) % 1000 / 1000


def ranks_said(ranks: Sequence[int]) -> str:
    """``rank 2`` or ``ranks 2, 3``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def held_notice(row: Agent, now: float) -> Held:
    """The once-said notice of ``row``'s stopped ranks."""
    row.held_said = True
    return Held(slot=row.slot, host=row.host, ranks=row.held, held_s=round(now - row.held_since, 1))


def exit_cause(code: int) -> str | None:
    """An agent's exit that means its host went away, as it was: a signal, or ssh's lost connection."""
    number = -code if code < 0 else code - 128 if code > 128 else None
    if number is not None:
        try:
            sig = signal.Signals(number)
        except ValueError:
            sig = None
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            return f"its agent was killed by {sig.name}"
    return None



class FailFast:
    """Without a range: an agent that ends otherwise than well (lost or failed) ends the job."""

    def decide(self, sup: Supervisor, event: Event) -> Decision | None:
        if event.kind is EventKind.TICK:
            return next((held_notice(row, event.at) for row in sup.held(event.at) if not row.held_said), None)
        if event.kind is not EventKind.EXITED or event.code == 0:
            return None
        return Stop(code=event.code or 1, reason=event.cause or "its workers failed", slot=event.slot)


@dataclass
class Backoff:
    """When a host not running may be tried: :data:`RETRY_S` after it was seen out and after each try
    it did not answer, for :data:`RETRY_FAST_S`; then twice as long after each miss (up to
    :data:`RETRY_MAX_S`); each wait times the host's :func:`retry_phase`. And a flapping host's wait
    on top: each loss within :data:`FLAP_WINDOW_S` of its first step (or before it) doubles it, capped.

    The bound: after its first flaps a host is admitted at most once every ``max_s`` seconds, so a
    host that flaps every P seconds costs the others at most two regroups (its join, its loss) per
    ``max_s + P`` seconds -- with R seconds a regroup, a share of at most 2R / (max_s + P) of the run.
    """

    first_s: float = BACKOFF_FIRST_S
    max_s: float = BACKOFF_MAX_S
    window_s: float = FLAP_WINDOW_S
    retry_s: float = RETRY_S
    flaps: dict[str, int] = field(default_factory=dict)
    not_before: dict[str, float] = field(default_factory=dict)  # a flapping host's
    since: dict[str, float] = field(default_factory=dict)  # seen out, since it last joined
    misses: dict[str, int] = field(default_factory=dict)  # tries not answered after its first RETRY_FAST_S out
    retry_at: dict[str, float] = field(default_factory=dict)

    def out(self, host: str, now: float) -> None:
        """``host`` is seen not running (at the start, or lost): its first try waits :attr:`retry_s`."""
        self.since.setdefault(host, now)
        self.retry_at.setdefault(host, now + self.retry_s * retry_phase(host))

    def missed(self, host: str, now: float) -> None:
        if not self.booting(host, now):
            self.misses[host] = self.misses.get(host, 0) + 1
        wait = self.retry_s * 2 ** self.misses.get(host, 0) * retry_phase(host)
        self.retry_at[host] = now + min(RETRY_MAX_S, wait)

    def booting(self, host: str, now: float) -> bool:
        """Whether ``host`` was seen out less than :data:`RETRY_FAST_S` ago: it may be booting still."""
        return now - self.since.get(host, now) < RETRY_FAST_S

    def joined(self, host: str) -> None:
        for kept in (self.since, self.misses, self.retry_at):
            kept.pop(host, None)

    def due(self, host: str, now: float) -> bool:
        return self.retry_at.get(host, now) <= now and self.wait(host, now) <= 0

    def lost(self, host: str, *, stepped: float | None, now: float) -> float:
        """Host ``host``, whose ranks first stepped at ``stepped`` (None: never), was lost at ``now``: the
        wait before it is admitted again. The window counts from its first step, not its admission: under
        load a host's start and its round's forming took over a minute, and one lost right after it
        trained was taken for a stable host."""
        if stepped is not None and now - stepped > self.window_s:
            self.flaps.pop(host, None)
            self.not_before.pop(host, None)
            return 0.0
        self.flaps[host] = self.flaps.get(host, 0) + 1
        wait = min(self.max_s, self.first_s * 2 ** (self.flaps[host] - 1))
        self.not_before[host] = now + wait
        return wait

    def wait(self, host: str, now: float) -> float:
        return max(0.0, self.not_before.get(host, 0.0) - now)


@dataclass
class JoinWindow:
    """The hosts ready to join, held until their batch goes (see :data:`JOIN_QUIET_S`)."""

    quiet_s: float = JOIN_QUIET_S
    pace_max_s: float = JOIN_PACE_MAX_S
    hold_s: float = JOIN_HOLD_S
    ready: dict[str, float] = field(default_factory=dict)  # host -> when it answered
    last: float | None = None  # the last answer, of this batch or an earlier one
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=8))  # between the recent answers

    def arrived(self, host: str, now: float) -> None:
        if host in self.ready:
            return
        if self.last is not None:
            self.gaps.append(now - self.last)
        self.last = now
        self.ready[host] = now

    def drop(self, host: str) -> None:
        self.ready.pop(host, None)

    def due(self, now: float, room: int, booting: bool = False) -> str | None:
        """Why the batch goes now; None: it waits for more. ``room``: hosts the job may still take;
        ``booting``: hosts of the range that never joined may be booting still (waited for: the
        batch goes at its hold, not when quiet)."""
        if not self.ready:
            return None
        if len(self.ready) >= room:
            return "it fills the job to its maximum: nobody else to wait for"
        first, last = min(self.ready.values()), max(self.ready.values())
        quiet = max(self.quiet_s, min(self.pace_max_s, 2 * max(self.gaps, default=0.0)))
        if now - last >= quiet and not booting:
            return f"no other host answered for {quiet:g} s"
        if now - first >= self.hold_s:
            return f"the first of them waited {self.hold_s:g} s"
        return None

    def take(self, room: int) -> tuple[str, ...]:
        """The batch, in the order they answered, at most ``room`` (the rest wait for the next)."""
        batch = tuple(sorted(self.ready, key=self.ready.get))[:max(0, room)]
        for host in batch:
            del self.ready[host]
        return batch


class Elastic:
    """``--nnodes MIN:MAX``: a lost host is left behind while MIN remain; a host lost soon after it
    joined backs off (:class:`Backoff`); a regroup that does not form in time stops the job."""

    def __init__(self, *, min_nnodes: int, max_nnodes: int, regroup_s: float, store: str,
                 backoff: Backoff | None = None, joins: JoinWindow | None = None,
                 slow_s: float | None = None, next_round: Callable[[], int] | None = None,
                 hosts: Sequence[str] = (), probe_s: float | None = None) -> None:
        """``slow_s``: the agents' connections are kept alive by their transport (ssh's keep-alives
        end it within seconds when the host is gone): a silent agent whose process still runs is
        slow, not lost, up to this; None: no such transport, silence is loss. ``next_round``: the
        next job-wide round number, from the store the agents' rounds take theirs from (an
        in-place round has no rendezvous to number it); None: regroups restart the workers.
        ``hosts``: every host of the range, those not running tried in this order. ``probe_s``: a
        silent agent's host is asked for a connection with this limit (:class:`Probe`); None: never."""
        self.slow_s = slow_s
        self.probe_s = probe_s
        self.hosts = tuple(hosts)
        self.trying: set[str] = set()  # admitted, their preflight not answered yet
        self.next_round = next_round
        self.min_nnodes, self.max_nnodes = min_nnodes, max_nnodes
        self.regroup_s = regroup_s
        self.store = store  # where the rendezvous is, for the bounded wait's message
        self.backoff = backoff or Backoff()
        self.joins = joins or JoinWindow()
        self.regroup_since: float | None = None

    def forming(self, sup: Supervisor) -> bool:
        """A round forms: an agent regroups, has its plan and no round yet (a batch let in), or its
        round's ranks have not stepped yet (:data:`TRAINS_WITHIN_S`)."""
        now = sup.clock()
        return bool(sup.agents.in_state(AgentState.REGROUPING)) or any(
            now - row.joined < self.regroup_s for row in sup.agents.in_state(AgentState.STARTING)) or any(
            row.progress is None and row.round_at is not None and now - row.round_at < TRAINS_WITHIN_S
            for row in sup.agents.in_state(AgentState.RUNNING))

    def decide(self, sup: Supervisor, event: Event) -> Decision | None:
        if event.kind is EventKind.ROUND and not sup.agents.in_state(AgentState.REGROUPING):
            self.regroup_since = None
        if event.kind is EventKind.READY:
            self.trying.discard(event.host)
            if not sup.finished and event.host not in {row.host for row in sup.agents.live()}:
                self.joins.arrived(event.host, event.at)
            return None
        if event.kind is EventKind.MISSED:
            self.trying.discard(event.host)
            self.backoff.missed(event.host, event.at)
            return None
        if event.kind is EventKind.JOINED:
            self.trying.discard(event.host)
            self.backoff.joined(event.host)
            return None
        if event.kind is EventKind.EXITED and event.code == 0:
            # The job's training is done: a host let in while it trained, whose round never stepped,
            # waits for ranks that are gone -- its failure to connect would fail a finished job.
            for row in sup.agents.live():
                if not row.stepped and sup.trained_at is not None and row.joined > sup.trained_at and not any(
                        mate.progress is not None for mate in sup.round_mates(row)):
                    sup.agents.move(row.slot, AgentState.STOPPED, "the job finished before its round trained")
            return None
        if event.kind is EventKind.UNREACHABLE:
            row = sup.agents[event.slot]
            silent = event.at - row.heard
            if row.state.final or not row.probed:  # it spoke since it was asked about
                return None
            sup.agents.move(row.slot, AgentState.LOST, f"its agent said nothing for {silent:.1f} s and its host "
                            f"took no connection within {self.probe_s:g} s (power or network lost)")
            self.backoff.lost(row.host, stepped=row.first_step, now=event.at)
            return self._regroup(sup, (row,), event)
        if event.kind is EventKind.EXITED and event.code != 0:
            row = sup.agents[event.slot]
            if row.state is AgentState.FAILED:  # its workers failed: the job's failure, as without a range
                return Stop(code=event.code, reason="its workers failed", slot=event.slot)
            self.backoff.lost(row.host, stepped=row.first_step, now=event.at)
            return self._regroup(sup, (row,), event)
        if event.kind is EventKind.TICK:
            limit = sup.silence_limit()
            late = [row for row in sup.agents.live() if event.at - row.heard > limit]
            cut = limit if self.slow_s is None else max(self.slow_s, limit)
            silent = [row for row in late if event.at - row.heard > cut]
            # Connection up and its round stepping: its ranks train, only its agent is stuck.
            carried = [row for row in silent if self.slow_s is not None and sup.steps_without(row, event.at)]
            silent = [row for row in silent if row not in carried]
            if silent:
                for row in silent:
                    sup.agents.move(row.slot, AgentState.LOST, f"its agent said nothing for {cut:.0f} s" + (
                        ", its connection up (stuck)" if self.slow_s is not None else ""))
                    self.backoff.lost(row.host, stepped=row.first_step, now=event.at)
                return self._regroup(sup, tuple(silent), event)
            stopped = sup.held(event.at)
            if stopped and len(stopped) < len(sup.agents.live()):  # a whole job suspended waits as one
                for row in stopped:
                    sup.agents.move(row.slot, AgentState.LOST, f"its {ranks_said(row.held)} stopped by a signal "
                                    f"(SIGSTOP) for {event.at - row.held_since:.0f} s")
                    self.backoff.lost(row.host, stepped=row.first_step, now=event.at)
                return self._regroup(sup, tuple(stopped), event)
            if stopped and not stopped[0].held_said:
                return held_notice(stopped[0], event.at)
            if self.probe_s is not None:
                ask = next((row for row in sup.agents.live() if not row.probed and event.at - row.heard > max(
                    PROBE_AFTER_S, 1.5 * max(row.gaps, default=0.0))), None)
                if ask is not None:
                    ask.probed = True
                    return Probe(slot=ask.slot, host=ask.host, timeout_s=self.probe_s)
            slow = next((row for row in late if not row.slow_said), None)
            if slow is not None:
                slow.slow_said = True
                return Slow(slot=slow.slot, host=slow.host, silent_s=round(event.at - slow.heard, 1),
                            limit_s=max(self.slow_s, limit))
            stuck = next((row for row in carried if not row.carried_said), None)
            if stuck is not None:
                stuck.carried_said = True
                return Slow(slot=stuck.slot, host=stuck.host, silent_s=round(event.at - stuck.heard, 1),
                            limit_s=cut, training=True)
            room = self.max_nnodes - len(sup.agents.live())
            why = self.joins.due(event.at, room, booting=self._booting(sup, event.at))
            if why is not None and not sup.finished and not self.forming(sup):
                batch = self.joins.take(room)
                if batch:
                    return Join(hosts=batch, reason=why)
            if self.regroup_since is not None and event.at - self.regroup_since > self.regroup_s:
                waiting = ", ".join(row.host for row in sup.agents.in_state(AgentState.REGROUPING))
                return Stop(code=1, reason="regroup timed out",
                            report=f"disttrain: the regroup did not form within {self.regroup_s:.0f} s "
                                   f"(rendezvous {self.store}; waiting: {waiting or 'none'}): stopped the job")
            return self._admit(sup, event.at)
        return None

    def lost_cause(self, row: Agent, event: Event) -> str | None:
        """Why agent ``row``, ended badly without its transport's word, means its host is gone: a
        signal, or an end before it joined any round (the host, not the training); None: its workers
        failed, which is the job's failure."""
        if killed := exit_cause(event.code):
            return killed
        if row.attempt is None:
            return f"its agent ended (exit {event.code}) before joining a round: {event.last.strip() or 'no message'}"
        return None

    def _regroup(self, sup: Supervisor, lost: tuple[Agent, ...], event: Event) -> Decision:
        members = sup.agents.live()
        lost_hosts = tuple(row.host for row in lost)
        if sup.finished:  # the job is done: nothing to regroup
            return RegroupWithout(lost=lost_hosts, members=(), slots=(), reason=lost[0].why or "")
        if len(members) < self.min_nnodes:
            everyone = "; ".join(f"{row.host}: {row.why}" for row in sup.agents.in_state(AgentState.LOST))
            # A host that took no connection is a lost connection, as ssh's own exit would have said (255).
            code = event.code or (255 if event.kind is EventKind.UNREACHABLE else 1)
            return Stop(code=code, reason="below the minimum", slot=lost[-1].slot,
                        report=f"disttrain: {len(members)} host(s) left, below the minimum of --nnodes "
                               f"{self.min_nnodes}:{self.max_nnodes}: stopped the job\n"
                               f"  hosts lost: {everyone}\n"
                               f"  still running: {', '.join(row.host for row in members) or 'none'}")
        for row in members:
            sup.agents.move(row.slot, AgentState.REGROUPING)
        self.regroup_since = event.at
        in_place, restart_why = self._in_place(members)
        return RegroupWithout(lost=lost_hosts, members=tuple(row.host for row in members),
                              slots=tuple(row.slot for row in members), reason="; ".join(
                                  f"{row.host}: {row.why}" for row in lost),
                              in_place=in_place, restart_why=restart_why)

    def _in_place(self, members: Sequence[Agent]) -> tuple[InPlace | None, str | None]:
        """The survivors' next round, numbered here: their workers keep their order, renumbered
        from 0. None, and why, where they restart instead."""
        if self.next_round is None:
            return None, "DISTTRAIN_REGROUP=restart"
        if len({row.attempt for row in members}) != 1 or members[0].attempt is None:
            return None, "a host was not in the current round yet"
        ordered = sorted(members, key=lambda row: min(row.ranks, default=0))
        try:
            attempt = self.next_round()
        except (RuntimeError, OSError):  # the store did not answer: the restart path's rendezvous decides
            return None, f"the store at {self.store} did not answer"
        ranks: dict[int, int] = {}
        for row in ordered:
            for rank in sorted(row.ranks):
                ranks[rank] = len(ranks)
        for row in ordered:  # planned: a loss before the agents' word of this round regroups from it
            row.attempt, row.ranks = attempt, tuple(ranks[rank] for rank in sorted(row.ranks))
        return InPlace(attempt=attempt, ranks=ranks, group_ranks={row.host: i for i, row in enumerate(ordered)},
                       world_size=len(ranks), store=self.store), None

    def _booting(self, sup: Supervisor, now: float) -> bool:
        """Whether a host of the range that never joined, nor answered yet, may be booting still."""
        ever = {row.host for row in sup.agents.rows}
        return any(host not in ever and host not in self.joins.ready and self.backoff.booting(host, now)
                   for host in self.hosts)

    def _admit(self, sup: Supervisor, now: float) -> Admit | None:
        """The hosts of the range not running to try now: their wait over, room below MAX for them
        beside the members, those being tried and those ready."""
        if sup.finished:
            return None
        live = {row.host for row in sup.agents.live()}
        out = [h for h in self.hosts if h not in live and h not in self.trying and h not in self.joins.ready]
        for host in out:
            self.backoff.out(host, now)
        room = self.max_nnodes - len(live) - len(self.trying) - len(self.joins.ready)
        due = tuple(h for h in out if self.backoff.due(h, now))[:max(0, room)]
        if not due:
            return None
        self.trying.update(due)
        return Admit(hosts=due)


class HangWatch:
    """One stall rule: no rank of any live agent moved for ``timeout_s`` -> dump; not while a
    regroup forms (no rank can move then), nor before any rank moved at all, nor while an agent's
    word is late (:data:`LATE_S`: its ranks may be moving; the silence clock decides first)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def decide(self, sup: Supervisor, event: Event) -> Decision | None:
        if event.kind is not EventKind.TICK or not self.timeout_s:
            return None
        live = sup.agents.live()
        if not live or any(row.state is AgentState.REGROUPING or event.at - row.heard > LATE_S for row in live):
            return None
        progress = [row.progress for row in live if row.progress is not None]
        if not progress or stalled(max(progress), event.at, self.timeout_s) is None:
            return None
        for row in live:
            sup.agents.move(row.slot, AgentState.HUNG)
        return Dump(slots=tuple(row.slot for row in live),
                    reason=f"no rank on any host progressed for {self.timeout_s:g} s")
