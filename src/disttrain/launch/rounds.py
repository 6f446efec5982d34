"""The rounds of an elastic job, as the launcher hears of them, and the record of its changes: which
round each change (a host lost, one back) belongs to, how that round formed (in place, or a restart
and why), and when it trained again. The agents say each round's world
(:class:`~disttrain.wire.AttemptStarted`) and their ranks' progress (:class:`~disttrain.wire.Beats`);
rank 0 says the step it resumed from. A change is said in one line when its round trains, and
kept in ``membership.json`` (:mod:`~disttrain.launch.membership_record`) from the moment it happens.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

from ..wire import AttemptStarted, Beats, WireError
from ..workerenv import RESUMED_MARKER
from .membership_record import Change, membership_line, write_record

RESUME_LINE_WAIT_S = 3.0  # after a round's first step, for rank 0's "resuming from step N" line
FIRST_STEP_WAIT_S = 60.0  # a round of a script that reports no steps is said once its workers started, after this


class Rounds:
    """The rounds and the record of one elastic launch. ``members``: the hosts of the job now (the
    supervisor's table); ``say`` shows a line to the user."""

    def __init__(self, *, run_dir: str, members: Callable[[], tuple[str, ...]]) -> None:
        self.say: Callable[[str], None] = print
        self._run_dir = run_dir
        self._members = members
        self._lock = threading.Lock()
        self.changes: list[Change] = []
        # The changes waiting for their round to train: [change, monotonic time it happened, the
        # time the next round formed or None, the time the launcher knew of it, the in-place round
        # it fell back from or None]. A change belongs to the first round that forms after the
        # launcher knew of it -- or, when that round is replaced before it trains (an in-place round
        # whose workers were started again), to the round that replaces it.
        self._pending: list[list] = []
        self._round: tuple[int, float, AttemptStarted] | None = None  # attempt, its start, what it said
        self._round_nodes: dict[int, AttemptStarted] = {}  # slot -> what its agent said of the current round
        self._veterans: set[int] = set()  # slots in an earlier round than the current one (had workers)
        self._restart_said = -1  # the last round whose restart of an in-place regroup's workers was said
        self._round_said = False
        self._resumed: int | None = None
        self._trained: tuple[float, float] | None = None  # the round's first step, when it was seen
        self._steps_reported = False  # a rank of the job reported a step: its rounds are said by their steps
        self._last_attempt = -1
        self._attempted: set[int] = set()  # agent slots that joined a round
        self.restart_why: str | None = None  # why the supervisor planned no in-place round, the last time
        start = Change(time=time.time(), change="start", host=None, why="the job started", hosts=members())
        self._pending.append([start, time.monotonic(), None, time.monotonic(), None])

    def add(self, change: Change, at: float, known: float) -> None:
        """A change that happened at ``at`` (monotonic), known to the launcher at ``known``: it waits
        for the round that trains after it, and is in the record at once."""
        with self._lock:
            self._pending.append([change, at, None, known, None])
        self.write()

    def close(self, finished: bool) -> None:
        """The launch ended (``finished``: an agent ended well): the changes no round trained after are
        recorded, not said."""
        with self._lock:
            if finished and self._round is not None and not self._round_said and self._steps_are_its_own():
                # The job ran to its end on this round before a step was reported (a script
                # without disttrain reports none, and FIRST_STEP_WAIT_S had not passed): say it.
                # Not an in-place round whose workers never said they went on in it (nor one whose
                # nodes did not all say how it formed): the steps seen were their old world's (the
                # job ended before the regroup took effect).
                self._said_round(self._trained[0] if self._trained else None, self._round[1])
            for change, at, formed, *_ in self._pending:  # no round trained after them: recorded, not said
                self._settle(change, at, formed, None, say=False, untrained="the job ended before a round trained")
            self._pending = []
        self.write()

    def agent_line(self, slot: int, line: str) -> bool:
        """An agent's own line (not a worker's): True when it was this module's to consume."""
        now = time.monotonic()
        if Beats.matches(line):
            self._beats(line, now)
            return False  # the diagnostics read them too
        if not AttemptStarted.matches(line):
            return False
        try:
            started = AttemptStarted.from_line(line)
        except WireError:
            return False
        with self._lock:
            if started.attempt > self._last_attempt:
                self._new_round(started, now)
            self._attempted.add(slot)
            if started.attempt == self._last_attempt:
                self._round_nodes[slot] = started
                self._mark_path()
        return True

    def _new_round(self, started: AttemptStarted, now: float) -> None:
        """The first word of round ``started.attempt``: the changes the launcher knew of belong to it,
        and so do those of a round that never trained (it was replaced: a fallback)."""
        if self._round is not None and not self._round_said and self._trained is not None and self._steps_are_its_own():
            self._said_round(self._trained[0], self._round[1])  # it trained: its changes are its
        previous = self._round
        self._veterans = set(self._attempted)
        self._round_nodes = {}
        self._last_attempt = started.attempt
        self._round = (started.attempt, now, started)
        self._round_said = False
        self._resumed = None
        self._trained = None
        for entry in self._pending:
            if entry[3] > now:
                continue
            if entry[2] is None:
                entry[2] = now
            elif previous is not None and entry[2] == previous[1]:
                entry[2], entry[4] = now, previous[0]  # its round was replaced before it trained

    def _kept(self) -> bool:
        """Whether a node of the current round kept its workers (an in-place round)."""
        return any(s.in_place for s in self._round_nodes.values())

    def _steps_are_its_own(self) -> bool:
        """Whether the steps seen since the current round's start are its own: rank 0 said the round
        went on in place, or every node of it started its workers. Until the last node said, one that
        had workers may have kept them, still stepping in their old world (a new host's word often
        comes first)."""
        if self._resumed is not None:
            return True
        if self._kept():
            return False
        return not self._veterans or self._all_said()

    def _all_said(self) -> bool:
        """Whether every node of the current round said its world."""
        return len(self._round_nodes) >= self._round[2].nodes

    def _mark_path(self) -> None:
        """How the current round formed, as far as its nodes said: "in place" only when every node
        that had workers before kept them (a node new to the job starts its first ones)."""
        number = self._round[0]
        restarted = [s for slot, s in self._round_nodes.items() if not s.in_place and slot in self._veterans]
        kept = any(s.in_place for s in self._round_nodes.values())
        if kept and not restarted:
            path, why = "in place", None
        else:
            why = next((s.why for s in restarted if s.why), None) or self.restart_why
            path = "restart"
        attached = False
        for entry in self._pending:
            if entry[2] != self._round[1] or entry[0].change == "start":
                continue
            attached = True
            entry_why = why
            if path == "restart" and entry[4] is not None:  # an in-place round came first, then this
                entry_why = _fell_back(entry[4], why)
            if (entry[0].path, entry[0].path_why) != (path, entry_why):
                entry[0] = dataclasses.replace(entry[0], path=path, path_why=entry_why)
                self.write()  # the record says how the round is forming, as it is known
        if attached or not restarted or self._restart_said >= number:
            return
        # No change waits for this round, yet workers that ran were started again: if the last change
        # was said "in place" on the round just before, it was not (its workers failed after all).
        last = self.changes[-1] if self.changes else None
        if last is not None and last.path == "in place" and last.attempt is not None and last.attempt < number:
            self._restart_said = number
            fixed = dataclasses.replace(last, path="restart", path_why=_fell_back(last.attempt, why))
            self.changes[-1] = fixed
            self.say(f"disttrain: membership: the workers were started again in round {number} "
                     f"({fixed.path_why}): the regroup after {last.host} {last.change} was not in place")
            self.write()

    def rank_line(self, text: str) -> None:
        """A worker's line (prefix removed): rank 0 says the step it resumed from."""
        if text.startswith(RESUMED_MARKER):
            try:
                step = int(text[len(RESUMED_MARKER):].split()[0])
            except (ValueError, IndexError):
                return
            with self._lock:
                self._resumed = step

    def _beats(self, line: str, now: float) -> None:
        try:
            beats = Beats.from_line(line)
        except WireError:
            return
        with self._lock:
            self._steps_reported = self._steps_reported or any(steps > 0 for steps, _ in beats.ranks.values())
            if self._round is None or self._round_said:
                return
            _, started, _ = self._round
            # A rank whose last progress came after the round's workers started: it trains again.
            first = min((now - age for steps, age in beats.ranks.values() if steps > 0 and now - age >= started),
                        default=None)
            if first is not None and self._trained is None:
                self._trained = (first, now)

    def poll(self) -> None:
        """Called by the flow's loop: a round that trains is said once rank 0's resume line came (it
        may travel behind the heartbeat that showed the step) or :data:`RESUME_LINE_WAIT_S` after;
        a round of a script that reports no steps, after :data:`FIRST_STEP_WAIT_S`."""
        with self._lock:
            if self._round is None or self._round_said:
                return
            _, started, _ = self._round
            now = time.monotonic()
            if self._trained is not None:
                trained_at, seen = self._trained
                # Kept workers' steps count on from their old world: only rank 0's resume line
                # (said once the regroup took effect) tells that the round itself trains.
                if self._steps_are_its_own() and (self._resumed is not None or now - seen >= RESUME_LINE_WAIT_S):
                    self._said_round(trained_at, started)
            elif not self._steps_reported and now - started >= FIRST_STEP_WAIT_S:
                # Only a script that never reported a step: under load a joining host's workers may
                # take longer than this to start, while the kept ones wait for them in the forming group.
                self._said_round(None, started)

    def _said_round(self, trained_at: float | None, started: float) -> None:
        """The current round trains (or, ``trained_at`` None, its workers started long ago): settle
        the changes it follows (not those that came after its start: the next round answers them)."""
        self._round_said = True
        settled = [entry for entry in self._pending if entry[3] <= started]
        when = trained_at if trained_at is not None else started
        # Several changes before one round: the earlier ones are said with the last. One that still
        # holds in the round (hosts let in together) is the round's too; one undone before it (a
        # host lost, then back) trained in no world of its own.
        hosts = self._round_hosts(())[0] if self._round is not None else ()
        for (change, at, formed, *_), (later, *_) in zip(settled[:-1], settled[1:]):
            if change.change == "start":  # the start has the world it started with
                self._settle(change, at, formed, None, say=False)
            elif hosts and (change.host in hosts) == (change.change == "joined"):
                self._settle(change, at, formed, when, steps=trained_at is not None, say=False)
            else:
                self._settle(change, at, None, None, say=False,
                             untrained=f"{later.host} {later.change} before a round trained with this change")
        if settled:
            change, at, formed, *_ = settled[-1]
            self._settle(change, at, formed, when, steps=trained_at is not None,
                         earlier=[c for c, *_ in settled[:-1] if c.change != "start"])
        self._pending = [entry for entry in self._pending if entry[3] > started]
        if settled:
            self.write()

    def _settle(self, change: Change, at: float, formed: float | None, when: float | None, *,
                steps: bool = True, say: bool = True, earlier: Sequence[Change] = (),
                untrained: str | None = None) -> None:
        """``untrained``: no round trained after the change, and why (its ``path`` is then none)."""
        attempt = world = None
        hosts, waiting = change.hosts, change.waiting
        if self._round is not None and formed is not None:
            attempt, _, said = self._round
            world = said.world_size if untrained is None else None  # no world of that size ever stepped
            hosts, waiting = self._round_hosts(hosts)
        seconds = None if when is None else round(max(0.0, when - at), 2)
        path, path_why = (change.path, change.path_why) if untrained is None else (None, untrained)
        done = dataclasses.replace(change, attempt=attempt, world_size=world, resumed_from=self._resumed,
                                   seconds=seconds, regrouped=None if formed is None else round(formed - at, 2),
                                   hosts=hosts, waiting=waiting, path=path, path_why=path_why)
        self.changes.append(done)
        if say and (change.change != "start" or earlier):
            self.say(membership_line(done, steps=steps, earlier=earlier))

    def _round_hosts(self, members: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The current round's hosts (in rank order) and the members not in it, once every node of
        the round said its world; until then ``members``, the hosts known at the change."""
        if not self._all_said():
            return members, ()
        nodes = sorted(self._round_nodes.values(), key=lambda s: min(s.ranks, default=0))
        hosts = tuple(dict.fromkeys(s.host for s in nodes))
        return hosts, tuple(h for h in self._members() if h not in hosts)

    def write(self) -> None:
        write_record(self._run_dir, [*self.changes, *(entry[0] for entry in self._pending)])


def _fell_back(attempt: int, why: str | None) -> str:
    """The record's why of a restart after the in-place round ``attempt``; ``why``: the nodes' own,
    which may already say that round fell back."""
    said = f"the in-place round {attempt} fell back"
    if why and why.startswith(said):
        return why
    return f"{said}: {why or 'its workers were started again'}"
