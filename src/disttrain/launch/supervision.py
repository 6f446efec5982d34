"""The launcher's supervision of a running job as one state machine: a table of agents, a
transitions table, events in, decisions out.

Every node's agent is one row of :class:`Agents` (its host, its :class:`AgentState`, when it was
last heard, its ranks' steps). Whatever happens -- an agent's line, its exit, a host that answers
again, the clock -- is one :class:`Event`; :class:`Supervisor` moves the rows and asks its
policies, each of which may return a decision:

- :class:`Stop`: the job ends (a failure, fewer hosts than the minimum, a regroup that never
  formed), with the exit code and the one block to show;
- :class:`RegroupWithout`: these hosts are lost, the others form a new round (the value the
  in-place regroup builds on: the lost hosts, the new members, the reason);
- :class:`Dump`: no rank anywhere moved for ``--hang-timeout``: every agent reports its ranks;
- :class:`Admit`: hosts not running are tried (their preflight): room left, their wait over;
- :class:`Join`: the hosts that answered the preflight meanwhile get their plans, together: one
  round for all of them (:class:`JoinWindow`), never while a round forms (until its ranks step);
- :class:`Slow`: an agent is late, but its connection is up (ssh's keep-alives): said once, not lost;
- nothing: go on.

The policies: :class:`FailFast` (without a range: the first agent that does not end well ends the
job), :class:`Elastic` (``--nnodes MIN:MAX``: a lost host is left behind while MIN remain; which hosts are tried, and
when, and which join together; a host lost soon after it joined waits longer each time), :class:`HangWatch`
(one silence clock for every agent, one stall rule for every rank, paused while a regroup forms).

No I/O here: the flow (:mod:`.flow`) relays the streams and turns decisions into wire messages;
the tests drive this module with fake agents and a fake clock.
"""

from __future__ import annotations

import signal
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from ..agent.watchdog import stalled
from ..wire import InPlace

SILENT_S = 5.0  # an agent speaks each second: this long without a word, its host is cut off or stuck
JITTER_FACTOR = 3.0  # ...or this many times the longest recent gap between its words (a loaded host's pace)
GAPS_KEPT = 30  # the recent gaps kept per agent, for that
SLOW_S = 60.0  # an agent whose connection its transport keeps alive (ssh) is slow, not lost, up to this
# ...unless its host takes no TCP connection: asked once the agent has said nothing for PROBE_AFTER_S
# (or 1.5 times its longest recent gap, on a loaded host), given PROBE_TIMEOUT_S. A machine that
# lost power or its network answers nothing (ssh's keep-alives would say so only after 3-4 s); a
# live one's kernel answers at once, however loaded.
PROBE_AFTER_S = 1.3
PROBE_TIMEOUT_S = 0.8
LATE_S = 2.0  # an agent this long without a word: its ranks' progress is unknown, no hang is judged
FLAP_WINDOW_S = 60.0  # a host lost within this long of joining is flapping
BACKOFF_FIRST_S = 10.0  # the wait before admitting a flapping host again: this, doubled each flap,
BACKOFF_MAX_S = 120.0  # up to this
RETRY_S = 3.0  # a host not running is tried this long after it was seen out, and again after each miss,
RETRY_FAST_S = 90.0  # for this long (a late boot, not a dead host); then twice as long after each miss,
RETRY_MAX_S = 30.0  # up to this. Each wait is stretched by the host's own factor (retry_phase)
HELD_S = 10.0  # a rank stopped by a signal this long: its host leaves an elastic job (said, without a range)
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


class AgentState(str, Enum):
    """Where one node's agent is, as the launcher sees it."""

    STARTING = "starting"  # it has its plan; no round of workers yet
    RUNNING = "running"  # its workers run in the current round
    REGROUPING = "regrouping"  # told (or about) to form a new round without lost hosts
    HUNG = "hung"  # asked for its ranks' states: no rank anywhere moved
    DONE = "done"  # ended well (exit 0)
    FAILED = "failed"  # ended with its workers' failure: the job's failure
    LOST = "lost"  # its host is gone (connection dropped, agent killed, silent)
    STOPPED = "stopped"  # stopped by the launcher (the job ended elsewhere)

    def __str__(self) -> str:
        return self.value

    @property
    def final(self) -> bool:
        return self in FINAL


FINAL = frozenset({AgentState.DONE, AgentState.FAILED, AgentState.LOST, AgentState.STOPPED})
_ENDS = frozenset({AgentState.DONE, AgentState.FAILED, AgentState.LOST, AgentState.STOPPED})

TRANSITIONS: dict[AgentState, frozenset[AgentState]] = {
    AgentState.STARTING: frozenset({AgentState.RUNNING, AgentState.REGROUPING, AgentState.HUNG}) | _ENDS,
    AgentState.RUNNING: frozenset({AgentState.RUNNING, AgentState.REGROUPING, AgentState.HUNG}) | _ENDS,
    AgentState.REGROUPING: frozenset({AgentState.RUNNING, AgentState.REGROUPING, AgentState.HUNG}) | _ENDS,
    AgentState.HUNG: frozenset({AgentState.STOPPED, AgentState.LOST, AgentState.FAILED, AgentState.DONE}),
    AgentState.DONE: frozenset(),
    AgentState.FAILED: frozenset(),
    AgentState.LOST: frozenset(),
    AgentState.STOPPED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A move the table does not allow: a bug in the launcher, never the user's doing."""


# -- the table -------------------------------------------------------------------------------


@dataclass
class Agent:
    """One row: agent ``slot`` runs on ``host``."""

    slot: int
    host: str
    state: AgentState = AgentState.STARTING
    heard: float = 0.0  # the launcher's clock: its last line
    joined: float = 0.0  # when it got its plan
    round_at: float | None = None  # when its workers started their current round
    attempt: int | None = None  # its workers' current round (or the in-place round planned for them)
    ranks: tuple[int, ...] = ()  # its workers' global ranks in that round
    stepped: bool = False  # its ranks have stepped, in some round
    progress: float | None = None  # the launcher's clock: its ranks' freshest progress
    steps: dict[int, int] = field(default_factory=dict)  # rank -> steps, in the current round
    why: str | None = None  # a final state's cause, as the record says it
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=GAPS_KEPT))  # between its recent words
    slow_said: bool = False  # its lateness was said (once per silence)
    carried_said: bool = False  # past the limit, its round stepping without its word, was said (once per silence)
    held: tuple[int, ...] = ()  # its ranks stopped by a signal (SIGSTOP), as its last beats said
    held_since: float | None = None  # the launcher's clock: since when some of its ranks are stopped
    held_said: bool = False
    probed: bool = False  # its host was asked for a connection (once per silence)


class Agents:
    """The table of agents, in slot order (a host that comes back gets a new slot)."""

    def __init__(self) -> None:
        self.rows: list[Agent] = []

    def add(self, host: str, now: float) -> Agent:
        row = Agent(slot=len(self.rows), host=host, heard=now, joined=now)
        self.rows.append(row)
        return row

    def __getitem__(self, slot: int) -> Agent:
        return self.rows[slot]

    def move(self, slot: int, state: AgentState, why: str | None = None) -> None:
        row = self.rows[slot]
        if state not in TRANSITIONS[row.state]:
            raise IllegalTransition(f"agent {slot} ({row.host}): {row.state} -> {state}")
        row.state = state
        if why is not None:
            row.why = why

    def live(self) -> list[Agent]:
        """The members: agents not in a final state."""
        return [row for row in self.rows if not row.state.final and row.state is not AgentState.HUNG]

    def in_state(self, *states: AgentState) -> list[Agent]:
        return [row for row in self.rows if row.state in states]


# -- events and decisions --------------------------------------------------------------------


class EventKind(str, Enum):
    HEARD = "heard"  # a line from the agent (``progress``: its ranks' freshest progress, launcher clock)
    ROUND = "round"  # the agent's workers started a round (``attempt``, their ``ranks``)
    EXITED = "exited"  # the agent's process ended with ``code``; ``cause``: a lost host's, when known
    JOINED = "joined"  # a host answered again: a new agent (``host``; ``slot``: its row, already added)
    READY = "ready"  # a host tried answered the preflight (``host``): it waits for its batch (:class:`JoinWindow`)
    MISSED = "missed"  # a host tried did not answer (``host``): tried again later (:class:`Backoff`)
    UNREACHABLE = "unreachable"  # a silent agent's host took no connection (:class:`Probe`)
    TICK = "tick"  # the clock moved


@dataclass(frozen=True)
class Event:
    kind: EventKind
    at: float
    slot: int | None = None
    host: str | None = None
    code: int | None = None
    cause: str | None = None  # EXITED: its transport's word on its end (ssh's lost connection), if any
    last: str = ""  # EXITED: its agent's last own line
    progress: float | None = None
    steps: dict[int, int] | None = None
    attempt: int | None = None
    ranks: tuple[int, ...] = ()
    held: tuple[int, ...] | None = None  # HEARD: its ranks stopped by a signal (None: the line says nothing of it)


@dataclass(frozen=True)
class Stop:
    """The job ends: ``code`` its exit, ``slot`` the agent whose end it is (its report), ``report`` the
    launcher's own block when it has one."""

    code: int
    reason: str
    slot: int | None = None
    report: str = ""


@dataclass(frozen=True)
class RegroupWithout:
    """The hosts ``lost`` are gone; ``members`` (their slots ``slots``) form the next round: in place
    (``in_place``: the survivors' workers stay, renumbered) or, ``restart_why``, by a restart."""

    lost: tuple[str, ...]
    members: tuple[str, ...]
    slots: tuple[int, ...]
    reason: str
    in_place: InPlace | None = None
    restart_why: str | None = None


@dataclass(frozen=True)
class Dump:
    """No rank moved for the hang timeout: every live agent reports its ranks, then stops."""

    slots: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class Admit:
    """The hosts ``hosts`` (not running) are tried now: their preflight, which answers with READY or
    MISSED."""

    hosts: tuple[str, ...]


@dataclass(frozen=True)
class Probe:
    """Agent ``slot`` on ``host`` has said nothing for :data:`PROBE_AFTER_S`: does its host take a TCP
    connection within ``timeout_s``? UNREACHABLE when not."""

    slot: int
    host: str
    timeout_s: float


@dataclass(frozen=True)
class Slow:
    """Agent ``slot`` on ``host`` has said nothing for ``silent_s``, its connection up: it is waited
    for (up to ``limit_s``), not lost."""

    slot: int
    host: str
    silent_s: float
    limit_s: float
    training: bool = False  # past ``limit_s``: its round's other ranks step, so its own do


@dataclass(frozen=True)
class Held:
    """Agent ``slot``'s ranks ``ranks`` on ``host`` have been stopped by a signal (SIGSTOP) for
    ``held_s``: no rank anywhere can step past them. Said once; a job without a range waits for them."""

    slot: int
    host: str
    ranks: tuple[int, ...]
    held_s: float


@dataclass(frozen=True)
class Join:
    """The hosts ``hosts`` (ready: they answered the preflight) get their plans now, together: the
    next round takes them all."""

    hosts: tuple[str, ...]
    reason: str


Decision = Stop | RegroupWithout | Dump | Admit | Join | Slow | Held | Probe


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


# -- the policies ----------------------------------------------------------------------------


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
    on top: each loss within :data:`FLAP_WINDOW_S` of joining doubles it, capped.

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

    def lost(self, host: str, *, joined: float, now: float) -> float:
        """Host ``host`` (joined at ``joined``) was lost at ``now``: the wait before it is admitted again."""
        if now - joined > self.window_s:
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
            self.backoff.lost(row.host, joined=row.joined, now=event.at)
            return self._regroup(sup, (row,), event)
        if event.kind is EventKind.EXITED and event.code != 0:
            row = sup.agents[event.slot]
            if row.state is AgentState.FAILED:  # its workers failed: the job's failure, as without a range
                return Stop(code=event.code, reason="its workers failed", slot=event.slot)
            self.backoff.lost(row.host, joined=row.joined, now=event.at)
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
                    self.backoff.lost(row.host, joined=row.joined, now=event.at)
                return self._regroup(sup, tuple(silent), event)
            stopped = sup.held(event.at)
            if stopped and len(stopped) < len(sup.agents.live()):  # a whole job suspended waits as one
                for row in stopped:
                    sup.agents.move(row.slot, AgentState.LOST, f"its {ranks_said(row.held)} stopped by a signal "
                                    f"(SIGSTOP) for {event.at - row.held_since:.0f} s")
                    self.backoff.lost(row.host, joined=row.joined, now=event.at)
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


# -- the machine -----------------------------------------------------------------------------


class Supervisor:
    """The table, the policies, the loop's one entry (:meth:`handle`)."""

    def __init__(self, hosts: Sequence[str], *, policies: Sequence, clock: Callable[[], float] = time.monotonic,
                 silent_s: float = SILENT_S, agents: Agents | None = None) -> None:
        """``agents``: the table to supervise, its rows already there (an elastic launch's, which
        :class:`~disttrain.launch.elastic.Membership` records the changes of); else one row per host."""
        self.clock = clock
        self.silent_s = silent_s
        self.policies = list(policies)
        self.trained_at: float | None = None  # when a rank first stepped (None: no rank reports steps)
        self.ended: Stop | None = None  # the decision that ended the job
        if agents is None:
            agents = Agents()
            now = clock()
            for host in hosts:
                agents.add(host, now)
        self.agents = agents

    @property
    def finished(self) -> bool:
        """An agent ended well: the job is done, nobody is admitted or regrouped."""
        return bool(self.agents.in_state(AgentState.DONE))

    @property
    def elastic(self) -> Elastic | None:
        return next((p for p in self.policies if isinstance(p, Elastic)), None)

    def handle(self, event: Event) -> list[Decision]:
        """Move the table for ``event``, then ask every policy; the decisions, in policy order."""
        if self.ended is not None or not self._apply(event):
            return []  # the job ended, or a late word of an agent already judged
        decisions = []
        for policy in self.policies:
            decision = policy.decide(self, event)
            if decision is not None:
                decisions.append(decision)
                if isinstance(decision, Stop):
                    self.ended = decision
                    self._stop_all()
                    break
        return decisions

    def silence_limit(self) -> float:
        """How long an agent may be silent before it is late: :data:`SILENT_S`, or
        :data:`JITTER_FACTOR` times the longest recent gap between any live agent's words (a
        loaded machine delays them all alike), whichever is longer."""
        gaps = [gap for row in self.agents.live() for gap in row.gaps]
        return max(self.silent_s, JITTER_FACTOR * max(gaps, default=0.0))

    def round_mates(self, row: Agent) -> list[Agent]:
        """The other agents whose workers are in ``row``'s round. Every step waits for all of a
        round's ranks: when theirs step, ``row``'s do, whatever its own agent says."""
        return [other for other in self.agents.rows
                if other is not row and row.attempt is not None and other.attempt == row.attempt]

    def steps_without(self, row: Agent, now: float) -> bool:
        """Whether ``row``'s round steps without a word from its agent: a mate of it that still runs
        said its ranks stepped after ``row``'s last word, within the silence limit."""
        limit = self.silence_limit()
        return any(other.state is AgentState.RUNNING and other.progress is not None
                   and other.progress > row.heard and now - other.progress <= limit
                   for other in self.round_mates(row))

    def held(self, now: float) -> list[Agent]:
        """The live agents some of whose ranks have been stopped by a signal for :data:`HELD_S`."""
        return [row for row in self.agents.live() if row.held_since is not None and now - row.held_since >= HELD_S]

    def late(self, now: float | None = None) -> bool:
        """Whether the ranks' rates say nothing now: a live agent's word is late (:data:`LATE_S`), or
        the job ended (the rates of a host lost or stopped are frozen at their last value)."""
        now = self.clock() if now is None else now
        return self.ended is not None or any(now - row.heard > LATE_S for row in self.agents.live())

    def tick(self) -> list[Decision]:
        return self.handle(Event(EventKind.TICK, at=self.clock()))

    def _apply(self, event: Event) -> bool:
        """Move the table; False when the event concerns an agent already judged."""
        if event.kind is EventKind.JOINED:
            if event.slot is None:
                self.agents.add(event.host, event.at)
            return True
        if event.slot is None:
            return True
        row = self.agents[event.slot]
        if row.state.final:
            return False
        if event.kind not in (EventKind.EXITED, EventKind.UNREACHABLE):  # not its words: a lost host's record dates from its last
            if event.at > row.heard:
                row.gaps.append(event.at - row.heard)
                row.slow_said = row.carried_said = row.probed = False
            row.heard = max(row.heard, event.at)
        if event.kind is EventKind.HEARD:
            if event.progress is not None and row.state is AgentState.STARTING:
                self.agents.move(row.slot, AgentState.RUNNING)  # its ranks move (a job without rounds)
            if event.progress is not None:
                row.progress = event.progress if row.progress is None else max(row.progress, event.progress)
                row.stepped = True
                if self.trained_at is None:
                    self.trained_at = event.at
            if event.steps:
                row.steps.update(event.steps)
            if event.held is not None:
                if not event.held:
                    row.held_since, row.held_said = None, False
                elif row.held_since is None:
                    row.held_since = event.at
                row.held = event.held
        elif event.kind is EventKind.ROUND:
            row.progress, row.steps, row.round_at, row.attempt = None, {}, event.at, event.attempt
            row.ranks = event.ranks
            if row.state is not AgentState.HUNG:
                self.agents.move(row.slot, AgentState.RUNNING)
        elif event.kind is EventKind.EXITED:
            if event.code == 0:
                self.agents.move(row.slot, AgentState.DONE, "it finished")
            elif row.state is AgentState.HUNG:  # as asked: reported its ranks, stopped
                self.agents.move(row.slot, AgentState.STOPPED, "stopped after the hang verdict")
                return False
            elif (cause := self._lost_cause(row, event)) is not None:
                self.agents.move(row.slot, AgentState.LOST, cause)
            else:
                self.agents.move(row.slot, AgentState.FAILED, "its workers failed")
        return True

    def _lost_cause(self, row: Agent, event: Event) -> str | None:
        """Why an agent that ended badly means its host is gone; None: its workers failed, which is
        the job's failure. Without a range, only its transport's word counts (the job ends either way)."""
        if event.cause is not None or self.elastic is None:
            return event.cause
        if killed := exit_cause(event.code):
            return killed
        if row.attempt is None:  # it never got as far as a round: the host, not the training
            return f"its agent ended (exit {event.code}) before joining a round: {event.last.strip() or 'no message'}"
        return None

    def _stop_all(self) -> None:
        for row in self.agents.rows:
            if not row.state.final:
                self.agents.move(row.slot, AgentState.STOPPED, "stopped by the launcher: the job ended elsewhere")
