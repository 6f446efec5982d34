"""An elastic job's hosts, at the launcher (``--nnodes MIN:MAX``): the tries of hosts not running,
and each change handed to the record (:mod:`~disttrain.launch.rounds`). Every decision is the
supervisor's (:class:`~disttrain.launch.policies.Elastic`); this carries some out and records them all:

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
seconds it took -- and an entry of ``membership.json`` in the run folder (:mod:`~disttrain.launch.rounds`).
"""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..config.hosts import Host
from ..errors import DisttrainError, UsageError
from ..preflight.checks import check_facts, fact_checks, first_failure
from ..wire import HostFacts
from .membership_record import Change
from .rounds import Rounds
from .supervision import Agents, AgentState

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
        self.rounds = Rounds(run_dir=run_dir, members=self.member_hosts)

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
        self.say = self.rounds.say = say
        self.rounds.write()
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
        self.rounds.close(self.finished)

    # -- what the agents say (the rounds') ---------------------------------------------------

    def agent_line(self, slot: int, line: str) -> bool:
        """An agent's own line (not a worker's): True when it was the rounds' to consume."""
        return self.rounds.agent_line(slot, line)

    def rank_line(self, text: str) -> None:
        self.rounds.rank_line(text)

    def poll(self) -> None:
        self.rounds.poll()


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
            members = [member.slot for member in self.table.live()]
        self.rounds.add(change, last_word, now)
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
            self.rounds.add(change, time.monotonic(), time.monotonic())
            self.say(f"disttrain: {self.hosts[host]} answered: it joins the next rendezvous round")
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
