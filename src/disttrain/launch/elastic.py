"""An elastic job's hosts, at the launcher (``--nnodes MIN:MAX``): the tries of hosts not running,
and the record of every change. Every decision is the supervisor's
(:class:`~disttrain.launch.policies.Elastic`); this carries some out and records them all:

- **lost**: the host's agent ended without its workers failing -- the connection to it dropped
  (ssh's 255: no answer to its keep-alives), the agent was killed (a signal), or the agent said
  nothing for the supervisor's silence limit. The others regroup; below MIN the job stops.
  An agent that ends with a failure of its workers is a failure of the job, as without a range.
- **back**: the supervisor admits hosts not running (room below MAX, their wait over:
  :class:`~disttrain.launch.policies.Backoff`); each is tried here, in the background and
  beside the others (a host that does not answer holds up no other's try): one
  that answers the preflight is ready (:class:`Ready`) and waits for the supervisor to let its
  batch in (:class:`~disttrain.launch.policies.JoinWindow`): then it gets its plan and joins
  the next round with the others of its batch (torch's agents make room for them).

Each change is one line when the next round trains again -- which host left or joined, the
new world size, the step the workers resumed from (``disttrain.resume()``'s own line), the
seconds it took -- and an entry of ``membership.json`` in the run folder
(:mod:`~disttrain.launch.membership_record`).
"""

from __future__ import annotations

import dataclasses
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..config.hosts import Host
from ..errors import DisttrainError, UsageError
from ..preflight.checks import check_facts, fact_checks, first_failure
from ..wire import AttemptStarted, Beats, HostFacts, WireError
from ..workerenv import RESUMED_MARKER
from .membership_record import Change, membership_line, write_record
from .supervision import Agents, AgentState

RESUME_LINE_WAIT_S = 3.0  # after a round's first step, for rank 0's "resuming from step N" line
FIRST_STEP_WAIT_S = 60.0  # a round whose ranks report no steps is said once its workers started, after this
TRIES_AT_ONCE = 16  # hosts tried side by side (each try: an ssh connection and its preflight)
CALIBRATE_S = 3.0  # a member's port, asked once when it joins: none in this long, it is never probed


@dataclass(frozen=True)
class Ready:
    """A host that answered the preflight; ``go`` sends it its plan (its agent then joins the next
    round) and returns the agent's process; ``cancel`` ends its session unused."""

    go: Callable[[], subprocess.Popen]
    cancel: Callable[[], None]


class Membership:
    """The changes of one elastic launch's members (see the module). ``hosts``: every host of the
    range, in order; ``running``: the hosts started, in agent order (agent ``k`` of the flow runs
    ``hosts[running[k]]``). ``join(index)``: host ``index``'s preflight -- a :class:`Ready` that
    waits for :meth:`go`, or its agent's process already given its plan (a DisttrainError when it
    does not answer); None: no host is tried.

    Who is a member is not kept here: :attr:`table` is the supervisor's table of agents
    (:class:`~disttrain.launch.supervision.Agents`: the flow's supervisor is built on it), which
    moves its rows (lost, done) before this records the change; this adds a row for a host that
    joins, once its agent started."""

    def __init__(self, *, hosts: Sequence[str], running: Sequence[int], run_dir: str,
                 join: Callable[[int], subprocess.Popen | Ready] | None = None,
                 own_failure: Callable[[int, int, str, float | None], str | None] | None = None,
                 kept_alive: bool = False, answers: Callable[[int, float], bool | None] | None = None) -> None:
        self.hosts = tuple(hosts)
        # The agents' connections are kept alive by their transport (ssh's keep-alives end one within
        # seconds of its host going away): a silent agent whose connection is up is slow, not lost.
        self.kept_alive = kept_alive
        self.say: Callable[[str], None] = print
        self._run_dir = run_dir
        self._join = join
        self._own_failure = own_failure or (lambda _index, _code, _last, _quiet: None)
        self._answers = answers  # None: the transport cannot be asked (no probe, no calibration)
        self._unreachable: queue.Queue[int] = queue.Queue()  # agent slots whose host took no connection
        self._unprobed: set[int] = set()  # hosts whose port took no connection while ssh reached them
        self._lock = threading.Lock()
        self.table = Agents()
        for index in running:
            self.table.add(self.hosts[index], time.monotonic())
        self._joined: queue.Queue[tuple[int, subprocess.Popen]] = queue.Queue()
        self._tries = threading.BoundedSemaphore(TRIES_AT_ONCE)
        self._missed: queue.Queue[str] = queue.Queue()  # hosts tried that did not answer
        self._held: dict[int, Ready] = {}  # hosts ready, waiting for their batch to be let in
        self._fresh: queue.Queue[int] = queue.Queue()  # hosts ready since the last ready()
        self._stop = threading.Event()
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
        self._last_attempt = -1
        self._attempted: set[int] = set()  # agent slots that joined a round
        self.restart_why: str | None = None  # why the supervisor planned no in-place round, the last time
        start = Change(time=time.time(), change="start", host=None, why="the job started",
                       hosts=self.member_hosts())
        self._pending.append([start, time.monotonic(), None, time.monotonic(), None])

    # -- who runs --------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """An agent ended well: the job is done, nobody joins any more."""
        return bool(self.table.in_state(AgentState.DONE))

    def member_hosts(self) -> tuple[str, ...]:
        return tuple(row.host for row in self.table.live())

    def host_of(self, slot: int) -> str:
        return self.table[slot].host

    def _index(self, slot: int) -> int:
        """Agent ``slot``'s host, by its place in the range."""
        return self.hosts.index(self.table[slot].host)

    def start(self, say: Callable[[str], None]) -> None:
        """``say`` shows a line to the user."""
        self.say = say
        self._write()
        for row in self.table.live():
            self._calibrate(self.hosts.index(row.host))

    def _calibrate(self, index: int) -> None:
        """Ask a member's port once: where it takes no connection while ssh reaches the host (a
        firewall between, a port forwarded elsewhere), its silence is never taken for a lost machine."""
        if self._answers is None:
            return

        def ask() -> None:
            if self._answers(index, CALIBRATE_S) is False:
                self._unprobed.add(index)
            else:
                self._unprobed.discard(index)

        threading.Thread(target=ask, name=f"disttrain-calibrate-{self.hosts[index]}", daemon=True).start()

    def close(self) -> None:
        self._stop.set()  # a try still under way ends its session when it answers
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for ready in held:  # never let in: their sessions end
            ready.cancel()
        with self._lock:
            if self.finished and self._round is not None and not self._round_said and not (
                    self._kept() and self._resumed is None):
                # The job ran to its end on this round before a step was reported (a script
                # without disttrain reports none, and FIRST_STEP_WAIT_S had not passed): say it.
                # Not an in-place round whose workers never said they went on in it: the steps
                # seen were their old world's (the job ended before the regroup took effect).
                self._said_round(self._trained[0] if self._trained else None, self._round[1])
            for change, at, formed, *_ in self._pending:  # no round trained after them: recorded, not said
                self._settle(change, at, formed, None, say=False, untrained="the job ended before a round trained")
            self._pending = []
        self._write()

    # -- what the agents say ----------------------------------------------------------------

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
        if self._round is not None and not self._round_said and self._trained is not None:
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
                entry_why = f"the in-place round {entry[4]} fell back: {why or 'its workers were started again'}"
            if (entry[0].path, entry[0].path_why) != (path, entry_why):
                entry[0] = dataclasses.replace(entry[0], path=path, path_why=entry_why)
                self._write()  # the record says how the round is forming, as it is known
        if attached or not restarted or self._restart_said >= number:
            return
        # No change waits for this round, yet workers that ran were started again: if the last change
        # was said "in place" on the round just before, it was not (its workers failed after all).
        last = self.changes[-1] if self.changes else None
        if last is not None and last.path == "in place" and last.attempt is not None and last.attempt < number:
            self._restart_said = number
            fixed = dataclasses.replace(last, path="restart", path_why=(
                f"the in-place round {last.attempt} fell back: {why or 'its workers were started again'}"))
            self.changes[-1] = fixed
            self.say(f"disttrain: membership: the workers were started again in round {number} "
                     f"({fixed.path_why}): the regroup after {last.host} {last.change} was not in place")
            self._write()

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
        a round whose script reports no steps, after :data:`FIRST_STEP_WAIT_S`."""
        with self._lock:
            if self._round is None or self._round_said:
                return
            _, started, _ = self._round
            now = time.monotonic()
            if self._trained is not None:
                trained_at, seen = self._trained
                # Kept workers' steps count on from their old world: only rank 0's resume line
                # (said once the regroup took effect) tells that the round itself trains.
                if self._resumed is not None or (now - seen >= RESUME_LINE_WAIT_S and not self._kept()):
                    self._said_round(trained_at, started)
            elif now - started >= FIRST_STEP_WAIT_S:
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
        hosts = self._round_hosts(self._round[2], ())[0] if self._round is not None else ()
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
            self._write()

    def _settle(self, change: Change, at: float, formed: float | None, when: float | None, *,
                steps: bool = True, say: bool = True, earlier: Sequence[Change] = (),
                untrained: str | None = None) -> None:
        """``untrained``: no round trained after the change, and why (its ``path`` is then none)."""
        attempt = world = None
        hosts, waiting = change.hosts, change.waiting
        if self._round is not None and formed is not None:
            attempt, _, said = self._round
            world = said.world_size if untrained is None else None  # no world of that size ever stepped
            hosts, waiting = self._round_hosts(said, hosts)
        seconds = None if when is None else round(max(0.0, when - at), 2)
        path, path_why = (change.path, change.path_why) if untrained is None else (None, untrained)
        done = dataclasses.replace(change, attempt=attempt, world_size=world, resumed_from=self._resumed,
                                   seconds=seconds, regrouped=None if formed is None else round(formed - at, 2),
                                   hosts=hosts, waiting=waiting, path=path, path_why=path_why)
        self.changes.append(done)
        if say and (change.change != "start" or earlier):
            self.say(membership_line(done, steps=steps, earlier=earlier))

    def _round_hosts(self, said: AttemptStarted, members: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The current round's hosts (in rank order) and the members not in it, once every node of
        the round said its world; until then ``members``, the hosts known at the change."""
        if len(self._round_nodes) < said.nodes:
            return members, ()
        nodes = sorted(self._round_nodes.values(), key=lambda s: min(s.ranks, default=0))
        hosts = tuple(dict.fromkeys(s.host for s in nodes))
        return hosts, tuple(h for h in self.member_hosts() if h not in hosts)

    # -- hosts that end ---------------------------------------------------------------------

    def transport_cause(self, slot: int, code: int, last: str, quiet_s: float | None = None) -> str | None:
        """What agent ``slot``'s transport says of its end with ``code`` (``last``: its last own line,
        ``quiet_s``: its silence before): ssh's lost connection, say; the supervisor judges the rest."""
        return self._own_failure(self._index(slot), code, last, quiet_s) or None

    def probe(self, slot: int, timeout_s: float) -> None:
        """Does agent ``slot``'s host take a connection within ``timeout_s``? Asked in a thread of its
        own; a host that does not is in :meth:`unreachable` (one that does, or cannot be asked, is not)."""
        index = self._index(slot)
        if self._answers is None or index in self._unprobed:
            return

        def ask() -> None:
            if self._answers(index, timeout_s) is False:
                self._unreachable.put(slot)

        threading.Thread(target=ask, name=f"disttrain-probe-{self.hosts[index]}", daemon=True).start()

    def unreachable(self) -> list[int]:
        """The agent slots whose host took no connection since the last call."""
        return _drained(self._unreachable)

    def leave(self, slot: int, why: str, *, backoff: float | None = None) -> list[int]:
        """Agent ``slot``'s host is lost (its row, moved by the supervisor): the change recorded; the
        slots that must regroup (the other members).

        The change dates from the host's last word (its agent speaks each second): when it went
        silent, not when the launcher gave up on it."""
        with self._lock:
            row = self.table[slot]
            now = time.monotonic()
            last_word = min(row.heard, now)
            # The hosts whose agents still ran: the members, and those the launcher is stopping
            # because of this very loss (below the minimum) -- they ran when it happened.
            running = tuple(r.host for r in self.table.rows if r.slot != slot and r.state in (
                AgentState.STARTING, AgentState.RUNNING, AgentState.REGROUPING, AgentState.STOPPED))
            change = Change(time=time.time() - (now - last_word), change="left", host=row.host, why=why,
                            hosts=running, noticed=round(now - last_word, 2),
                            backoff=round(backoff, 1) if backoff else None)
            self._pending.append([change, last_word, None, now, None])
            members = [member.slot for member in self.table.live()]
        self._write()
        return members

    def ended(self, slot: int) -> None:
        """Agent ``slot`` finished (exit 0): the job is done; no host joins any more."""
        self._stop.set()

    # -- hosts that come back ---------------------------------------------------------------

    def joined(self) -> list[subprocess.Popen]:
        """Agents started since the last call, in slot order (the flow relays them as its next agents)."""
        out = []
        while True:
            try:
                host, proc = self._joined.get_nowait()
            except queue.Empty:
                return out
            if self.finished:  # too late: the others are done
                _dismiss(proc)
                continue
            with self._lock:
                name = self.hosts[host]
                back = any(row.host == name for row in self.table.in_state(AgentState.LOST))
                self.table.add(name, time.monotonic())
                self._calibrate(host)
                change = Change(time=time.time(), change="joined", host=name,
                                why="it answered again" if back else "it answered the preflight",
                                hosts=self.member_hosts())
                self._pending.append([change, time.monotonic(), None, time.monotonic(), None])
            self.say(f"disttrain: {self.hosts[host]} answered: it joins the next rendezvous round")
            self._write()
            out.append(proc)

    def ready(self) -> list[str]:
        """The hosts that answered the preflight since the last call (the supervisor batches them)."""
        return [self.hosts[index] for index in _drained(self._fresh)]

    def go(self, names: Sequence[str]) -> None:
        """The supervisor lets these ready hosts in: each gets its plan (see :meth:`joined`)."""
        for name in names:
            index = self.hosts.index(name)
            with self._lock:
                ready = self._held.pop(index, None)
            if ready is None:
                continue
            try:
                proc = ready.go()
            except DisttrainError as err:
                self.say(f"disttrain: {name} was ready but could not be given its plan: {err}")
                self._missed.put(name)
                continue
            self._joined.put((index, proc))

    def try_hosts(self, names: Sequence[str]) -> None:
        """The supervisor admits these hosts: each is tried in a thread of its own (see :meth:`ready`,
        :meth:`missed`); none when there is no ``join``."""
        if self._join is None:
            return
        for name in names:
            threading.Thread(target=self._try, args=(self.hosts.index(name),), name=f"disttrain-try-{name}",
                             daemon=True).start()

    def missed(self) -> list[str]:
        """The hosts tried since the last call that did not answer (tried again when the supervisor says)."""
        return _drained(self._missed)

    def _try(self, host: int) -> None:
        with self._tries:
            if self._stop.is_set():
                return
            try:
                answer = self._join(host)
            except DisttrainError:
                self._missed.put(self.hosts[host])
                return
        if isinstance(answer, Ready):
            with self._lock:
                closed = self._stop.is_set()
                if not closed:
                    self._held[host] = answer
            if closed:  # the launch ended while it was tried: close() ended the others
                answer.cancel()
                return
            self._fresh.put(host)  # the supervisor lets it in with its batch
        else:
            self._joined.put((host, answer))

    # -- the record -------------------------------------------------------------------------

    def _write(self) -> None:
        write_record(self._run_dir, [*self.changes, *(entry[0] for entry in self._pending)])


def _drained(items: queue.Queue) -> list:
    """What ``items`` holds now, taken out in order (its producers are the membership's threads)."""
    out = []
    while True:
        try:
            out.append(items.get_nowait())
        except queue.Empty:
            return out


def _dismiss(proc: subprocess.Popen) -> None:
    """An agent that got its plan too late: its stdin closed, it stops (killed if it lingers)."""
    try:
        proc.stdin.close()
        proc.wait(timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()


def starting_hosts(hosts: Sequence[Host], facts: Sequence[HostFacts | Exception], *, master_port: int,
                   min_nnodes: int, max_nnodes: int) -> tuple[list[int], dict[int, str]]:
    """Which hosts of an elastic range start: those that pass the preflight, at most ``max_nnodes``,
    each compared with the first that does (the reference: versions alike); and why each other one
    waits. No host is required: the launcher holds the rendezvous (rendezvous_store.py).

    Fewer than ``min_nnodes``: the first failure, as without a range."""
    ref = next((i for i in range(len(hosts))
                if first_failure(fact_checks([hosts[i]], [facts[i]], master_port=master_port)) is None), None)
    if ref is None:
        check_facts(hosts, facts, master_port=master_port)  # raises the first failure
    starting, waiting = [ref], {}
    for i in range(len(hosts)):
        if i == ref:
            continue
        failure = first_failure(fact_checks([hosts[ref], hosts[i]], [facts[ref], facts[i]], master_port=master_port))
        if failure is not None and failure.host == hosts[i].name:
            waiting[i] = failure.detail
        elif len(starting) < max_nnodes:
            starting.append(i)
        else:
            waiting[i] = f"a spare: --nnodes {min_nnodes}:{max_nnodes} runs at most {max_nnodes} hosts"
    if len(starting) < min_nnodes:
        check_facts(hosts, facts, master_port=master_port)  # raises the first failure
        raise UsageError(f"only {len(starting)} of the hosts can start, fewer than --nnodes {min_nnodes}:{max_nnodes}")
    return sorted(starting), waiting
