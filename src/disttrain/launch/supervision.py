"""The launcher's supervision of a running job as one state machine: a table of agents, a
transitions table, events in, decisions out.

Every node's agent is one row of :class:`Agents` (its host, its :class:`AgentState`, when it was
last heard, its ranks' steps). Whatever happens -- an agent's line, its exit, a host that answers
again, the clock -- is one :class:`Event`; :class:`Supervisor` moves the rows and asks its
policies (:mod:`.policies`), each of which may return a decision:

- :class:`Stop`: the job ends (a failure, fewer hosts than the minimum, a regroup that never
  formed), with the exit code and the one block to show;
- :class:`RegroupWithout`: these hosts are lost, the others form a new round (the value the
  in-place regroup builds on: the lost hosts, the new members, the reason);
- :class:`Dump`: no rank anywhere moved for ``--hang-timeout``: every agent reports its ranks;
- :class:`Admit`: hosts not running are tried (their preflight): room left, their wait over;
- :class:`Join`: the hosts that answered the preflight meanwhile get their plans, together: one
  round for all of them, never while a round forms (until its ranks step);
- :class:`Slow`: an agent is late, but its connection is up (ssh's keep-alives): said once, not lost;
- :class:`Probe`: a silent agent's host is asked for a TCP connection;
- :class:`Held`: an agent's ranks are stopped by a signal: said once;
- nothing: go on.

No I/O here: the flow (:mod:`.flow`) relays the streams and turns decisions into wire messages;
the tests drive this module with fake agents and a fake clock.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from ..wire import InPlace

SILENT_S = 5.0  # an agent speaks each second: this long without a word, its host is cut off or stuck
JITTER_FACTOR = 3.0  # ...or this many times the longest recent gap between its words (a loaded host's pace)
GAPS_KEPT = 30  # the recent gaps kept per agent, for that
LATE_S = 2.0  # an agent this long without a word: its ranks' progress is unknown, no hang is judged
HELD_S = 10.0  # a rank stopped by a signal this long: its host leaves an elastic job (said, without a range)


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

TRANSITIONS: dict[AgentState, frozenset[AgentState]] = {
    AgentState.STARTING: frozenset({AgentState.RUNNING, AgentState.REGROUPING, AgentState.HUNG}) | FINAL,
    AgentState.RUNNING: frozenset({AgentState.RUNNING, AgentState.REGROUPING, AgentState.HUNG}) | FINAL,
    AgentState.REGROUPING: frozenset({AgentState.RUNNING, AgentState.REGROUPING, AgentState.HUNG}) | FINAL,
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
    first_step: float | None = None  # the launcher's clock: when its ranks first stepped (a join's worth begins there)
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

    @property
    def stepped(self) -> bool:
        """Its ranks have stepped, in some round."""
        return self.first_step is not None


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


# -- the machine -----------------------------------------------------------------------------


class Supervisor:
    """The table, the policies, the loop's one entry (:meth:`handle`). A policy answers
    ``decide(sup, event)`` with a decision or None (:mod:`.policies`)."""

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
                if row.first_step is None:
                    row.first_step = event.at
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
        the job's failure. Its transport's word, else the policy's that tells the two apart
        (``lost_cause``: an elastic job's); without such a policy the job ends either way."""
        if event.cause is not None:
            return event.cause
        judge = next((policy for policy in self.policies if hasattr(policy, "lost_cause")), None)
        return judge.lost_cause(row, event) if judge is not None else None

    def _stop_all(self) -> None:
        for row in self.agents.rows:
            if not row.state.final:
                self.agents.move(row.slot, AgentState.STOPPED, "stopped by the launcher: the job ended elsewhere")
